// kvlens eval: caption exact-match and VQA accuracy on a scene set, for the full cache and
// any number of compression methods (a paper-style table).
#include <cstdio>

#include "app/backend_option.h"
#include "app/commands.h"
#include "app/defaults.h"
#include "app/options.h"
#include "core/session.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/method.h"
#include "models/evaluate.h"

namespace kvlens::app {

namespace {

struct EvalArgs {
  std::string model, scenes, json_out, kv_storage = "fp16";
  std::vector<std::string> methods;
  EvalOptions opt;
  bool no_vqa = false;
  BackendOptions backend;
};

void run_eval(const EvalArgs& a) {
  for (const auto& m : a.methods) parse_method_spec(m);
  const RowStorage rows = parse_row_storage(a.kv_storage, "--kv-storage");
  if (!a.json_out.empty()) check_writable(a.json_out, "eval JSON");
  const SceneSet set = load_scene_set(a.scenes);
  const LlavaModel model = LlavaModel::load(a.model.empty() ? default_model_dir() : a.model, a.backend);
  std::vector<std::string> runs{""};
  runs.insert(runs.end(), a.methods.begin(), a.methods.end());
  nlohmann::json out = nlohmann::json::array();
  std::printf("%-40s %7s %9s %9s %12s %10s\n", "method", "images", "caption%", "VQA%", "KV bytes", "ms/caption");
  for (const auto& m : runs) {
    EvalOptions o = a.opt;
    o.method = m;
    o.kv_storage = rows;
    o.vqa = !a.no_vqa;
    const EvalResult r = evaluate_scenes(model, set, o);
    const std::string label = m.empty() ? "full" : parse_method_spec(m).short_spec();
    std::printf("%-40s %7d %9.1f %9.1f %12.0f %10.1f\n", label.c_str(), r.images,
                100.0 * r.caption_accuracy(), 100.0 * r.vqa_accuracy(), r.kv_bytes_mean, r.caption_ms_mean);
    std::fflush(stdout);
    out.push_back(r.to_json());
  }
  if (!a.json_out.empty()) {
    write_file_atomic(a.json_out, out.dump(1) + "\n", "eval JSON");
  }
}

}  // namespace

void add_eval_command(CLI::App& root) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* c = root.add_subcommand("eval", "Caption exact-match and VQA accuracy on a scene set (full cache and methods)");
  c->add_option("--scenes", a->scenes, "Folder written by kvlens scenes")->required();
  c->add_option("--model", a->model, "Model directory (default: the embedded model)");
  add_backend_options(c, a->backend);
  add_int(c, "--n", a->opt.max_images, 0, 10000000, "Images to evaluate (0 = all)");
  c->add_option("--method", a->methods, "Also evaluate under these method specs (repeatable)");
  add_int(c, "--max-new-tokens", a->opt.max_new_tokens, 1, kMaxNewTokensLimit, "Most tokens per answer");
  c->add_option("--kv-storage", a->kv_storage,
                "Storage of uncompressed KV rows: fp16 (rounded to half precision) or fp32 (exact)")->capture_default_str();
  c->add_flag("--no-vqa", a->no_vqa, "Captions only");
  c->add_option("--json", a->json_out, "Write the results as JSON");
  c->callback([a] { run_eval(*a); });
}

}  // namespace kvlens::app
