// `kvlens scenes`: writes a procedural scene set (images, captions, VQA pairs).
#include <cstdio>
#include <memory>
#include <string>

#include "app/cli/commands.h"
#include "app/cli/options.h"
#include "core/data/scenes.h"
#include "core/errors.h"

namespace kvlens::app {

namespace {
struct ScenesArgs {
  int64_t n = 0;
  uint64_t seed = 0;
  std::string out;
  int size = 0;  // 0: the version's own (256 classic, 336 rich)
  int version = kClassicScenes;
  bool force = false;
};
}  // namespace

void add_scenes_command(CLI::App& root) {
  auto args = std::make_shared<ScenesArgs>();
  CLI::App* cmd = root.add_subcommand(
      "scenes",
      "Generate a procedural scene set: images of coloured shapes on a grey background, 5 reference "
      "captions and VQA pairs each (classic: 1-4 shapes, 3-6 pairs; rich: patterns, an overlapping "
      "pair, a group of 2-9 to count, a tiny object, 4-8 pairs)");
  add_int64(cmd, "--n", args->n, 1, kMaxScenes, "Number of scenes to generate")->required();
  add_seed(cmd, "--seed", args->seed, "Seed; the same seed and index always give the same scene");
  cmd->add_option("--out", args->out,
                  "Output folder; receives images/000000.png ... and annotations.json")
      ->required();
  add_int(cmd, "--generator-version", args->version, kClassicScenes, kRichScenes,
          "1: the classic scenes (the embedded model's); 2: the rich scenes (core/data/scenes.h)");
  add_int(cmd, "--size", args->size, 0, kMaxSceneSize,
          "Image side in pixels, at least 64 (0: 256 for version 1, 336 for version 2)");
  cmd->add_flag("--force", args->force,
                "Replace the output folder if it is not empty (only an earlier scene set)");
  cmd->footer(
      "annotations.json follows the COCO caption layout (info, images with their objects, "
      "annotations with 5 captions per image, the canonical one first) plus \"questions\" "
      "(question, answer, type: count / colour / exist / where / larger; rich scenes also shape / "
      "pattern / relation / front, and each object's pattern and role). The set is built in a "
      "temporary folder beside --out and moved into place at the end.");
  cmd->callback([args]() {
    if (args->size != 0 && args->size < kMinSceneSize)
      throw InputError("--size must be 0 (the version's own) or at least " + std::to_string(kMinSceneSize) +
                       " pixels, got " + std::to_string(args->size));
    SceneOptions opts;
    opts.version = args->version;
    opts.size = args->size;
    write_scene_set(args->out, args->n, args->seed, args->force, opts);
    std::printf("wrote %lld scenes to %s\n", static_cast<long long>(args->n), args->out.c_str());
  });
}

}  // namespace kvlens::app
