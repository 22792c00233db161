// kvlens caption: one image through the full-cache model, as a researcher's baseline.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "app/cli/backend_option.h"
#include "app/cli/commands.h"
#include "app/cli/defaults.h"
#include "app/cli/model_inputs.h"
#include "app/lab/experiment.h"
#include "app/cli/options.h"
#include "app/lab/session.h"
#include "core/errors.h"
#include "core/files.h"
#include "models/model.h"

namespace kvlens::app {

namespace {

struct CaptionArgs {
  std::string model, image, prompt = kDefaultPrompt, templ = kDefaultTemplate, json_out, logits_out;
  std::string kv_storage = "fp16";
  int max_new_tokens = kDefaultMaxNewTokens;
  float temperature = 0.0f, top_p = 1.0f;
  uint64_t seed = 0;
  bool pad_to_square = false;
  BackendOptions backend;
};

void run_caption(const CaptionArgs& a) {
  const RowStorage rows = parse_row_storage(a.kv_storage, "--kv-storage");
  if (!a.json_out.empty()) check_writable(a.json_out, "caption JSON");
  if (!a.logits_out.empty()) check_writable(a.logits_out, "logits");
  const std::unique_ptr<Model> model_owned = load_model(model_dir_of(a.model), a.backend);
  if (a.pad_to_square) model_owned->preprocess_config().pad_to_square = true;
  const Model& model = *model_owned;
  const RGBImage img = command_image(model, a.image);
  const std::string templ = model_template(model, a.templ);
  const PrefillState st = model.prefill(img, a.prompt, templ, false);
  GenerateOptions opt;
  opt.max_new_tokens = a.max_new_tokens;
  opt.temperature = a.temperature;
  opt.top_p = a.top_p;
  opt.seed = a.seed;
  opt.kv_storage = rows;
  const DecodeResult r = model.decode(st, nullptr, opt);
  std::printf("%s\n", r.text.c_str());
  const int n_steps = static_cast<int>(r.generated_ids.size());
  if (!a.json_out.empty()) {
    nlohmann::json j;
    j["model"] = model.dir();
    j["backend"] = model.backend().name();
    j["device"] = model.backend().device();
    j["image"] = command_image_path(model, a.image);
    j["prompt"] = a.prompt;
    j["template"] = templ;
    j["caption"] = r.text;
    j["prompt_ids"] = st.ids;
    j["generated_ids"] = r.generated_ids;
    j["n_visual_tokens"] = st.n_visual;
    j["n_prompt_tokens"] = st.ids.size();
    j["timings_ms"] = {{"preprocess", st.preprocess_ms},
                       {"vision", st.vision_ms},
                       {"prefill", st.prefill_ms},
                       {"decode", r.decode_ms},
                       {"decode_per_token", n_steps > 1 ? r.decode_ms / (n_steps - 1) : 0.0}};
    j["kv_bytes"] = r.bytes_final.total();
    j["kv_storage"] = a.kv_storage;
    write_file_atomic(a.json_out, j.dump(2) + "\n", "caption JSON");
  }
  if (!a.logits_out.empty()) {
    write_file_atomic(a.logits_out,
                      std::string_view(reinterpret_cast<const char*>(r.first_logits.data()),
                                       r.first_logits.size() * sizeof(float)),
                      "logits");
  }
}

}  // namespace

void add_caption_command(CLI::App& root) {
  auto args = std::make_shared<CaptionArgs>();
  CLI::App* c = root.add_subcommand("caption", "Caption one image with the full KV cache");
  c->add_option("--model", args->model, kModelHelp);
  add_backend_options(c, args->backend);
  c->add_option("--image", args->image, "PNG, JPEG or BMP image (default: the embedded sample image; none for a text-only model)");
  c->add_option("--prompt", args->prompt, "Text in place of {prompt} in the template")->capture_default_str();
  c->add_option("--template", args->templ, "Prompt template with <image> and {prompt}; left at this default, the checkpoint's own chat template where it ships one (a text-only model without one: {prompt} alone)")->capture_default_str();
  add_int(c, "--max-new-tokens", args->max_new_tokens, 1, kMaxNewTokensLimit, "Most tokens to generate");
  add_real(c, "--temperature", args->temperature, 0, 100, "0 = greedy; > 0 samples (seeded)");
  add_real(c, "--top-p", args->top_p, 0, 1, "Nucleus sampling mass when sampling", true);
  add_seed(c, "--seed", args->seed, "Sampling seed");
  c->add_option("--kv-storage", args->kv_storage,
                "Storage of the KV cache rows: fp16 (rounded to half precision, 2 B/value) or fp32 (exact)")
      ->capture_default_str();
  c->add_flag("--pad-to-square", args->pad_to_square, "LLaVA-1.5: pad the image to a square with the mean colour");
  c->add_option("--json", args->json_out, "Write caption, ids, n_visual_tokens and timings_ms here");
  c->add_option("--dump-logits", args->logits_out, "Write the first generated step's logits (little-endian float32)");
  c->callback([args] { run_caption(*args); });
}

}  // namespace kvlens::app
