// `kvlens scenes`: writes a procedural scene set (images, captions, VQA pairs).
#include <cstdio>
#include <memory>
#include <string>

#include "app/cli/commands.h"
#include "app/cli/options.h"
#include "core/data/scenes.h"

namespace kvlens::app {

namespace {
struct ScenesArgs {
  int64_t n = 0;
  uint64_t seed = 0;
  std::string out;
  int size = 256;
  bool force = false;
};
}  // namespace

void add_scenes_command(CLI::App& root) {
  auto args = std::make_shared<ScenesArgs>();
  CLI::App* cmd = root.add_subcommand(
      "scenes",
      "Generate a procedural scene set: images of 1-4 coloured shapes on a grey background, "
      "5 reference captions and 3-6 VQA pairs each");
  add_int64(cmd, "--n", args->n, 1, kMaxScenes, "Number of scenes to generate")->required();
  add_seed(cmd, "--seed", args->seed, "Seed; the same seed and index always give the same scene");
  cmd->add_option("--out", args->out,
                  "Output folder; receives images/000000.png ... and annotations.json")
      ->required();
  add_int(cmd, "--size", args->size, kMinSceneSize, kMaxSceneSize, "Image side in pixels");
  cmd->add_flag("--force", args->force,
                "Replace the output folder if it is not empty (only an earlier scene set)");
  cmd->footer(
      "annotations.json follows the COCO caption layout (info, images with their objects, "
      "annotations with 5 captions per image, the canonical one first) plus \"questions\" "
      "(question, answer, type: count / colour / exist / where / larger). The set is built in "
      "a temporary folder beside --out and moved into place at the end.");
  cmd->callback([args]() {
    SceneOptions opts;
    opts.size = args->size;
    write_scene_set(args->out, args->n, args->seed, args->force, opts);
    std::printf("wrote %lld scenes to %s\n", static_cast<long long>(args->n), args->out.c_str());
  });
}

}  // namespace kvlens::app
