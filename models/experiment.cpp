#include "models/experiment.h"

#include <sstream>

#include "core/errors.h"

namespace kvlens {

PrefillView Experiment::view() const {
  PrefillView v;
  v.full = &prefill.store;
  v.probs = &prefill.capture.probs;
  v.kinds = &prefill.kinds;
  v.n_heads = prefill.capture.probs.empty()
                  ? 0
                  : static_cast<int>(prefill.capture.probs[0].size() / (prefill.ids.size() * prefill.ids.size()));
  v.prompt_len = static_cast<int>(prefill.ids.size());
  return v;
}

Experiment start_experiment(const LlavaModel& model, const RGBImage& img, const ExperimentOptions& opt) {
  return start_experiment(model, model.prefill(img, opt.prompt, opt.templ, true), opt);
}

Experiment start_experiment(const LlavaModel& model, PrefillState prefill, const ExperimentOptions& opt) {
  Experiment ex;
  ex.prefill = std::move(prefill);
  const int max_step = std::max(opt.diag_steps, *std::max_element(opt.hit_steps.begin(), opt.hit_steps.end()) + 1);
  ex.full_recorder = std::make_unique<DecodeRecorder>(max_step);
  GenerateOptions g;
  g.max_new_tokens = opt.max_new_tokens;
  ex.full = model.decode(ex.prefill, nullptr, g, {ex.full_recorder.get()});
  const PrefillView pv = ex.view();
  ex.hit_rates = cache_hit_rates(pv, *ex.full_recorder, opt.hit_budget, opt.hit_steps, opt.hit_window);
  for (int l = 0; l < ex.prefill.store.n_layers(); ++l) {
    ex.sparsity_prefill.push_back(prefill_sparsity(pv, l, opt.sparsity_p));
    double s = 0;
    int n = 0;
    for (const auto& e : ex.full_recorder->entries())
      if (e.layer == l) {
        s += sparsity(e.probs.data(), e.n_heads, 1, e.n_k, opt.sparsity_p);
        ++n;
      }
    ex.sparsity_decode_full.push_back(n ? s / n : 0.0);
    for (const KVSegment& seg : ex.prefill.store.layer(l).segments)
      ex.full_fp16_bytes += seg.dense_bytes(ex.prefill.store.head_dim(), 2);
  }
  return ex;
}

MethodRun run_method(const LlavaModel& model, const Experiment& ex, const Params& params,
                     const ExperimentOptions& opt) {
  MethodRun r;
  r.params = params;
  auto policy = make_policy(params);
  DecodeRecorder rec(opt.diag_steps);
  KVStore compressed;
  GenerateOptions g;
  g.max_new_tokens = opt.max_new_tokens;
  r.result = model.decode(ex.prefill, policy.get(), g, {&rec}, &compressed);
  r.layers = compare_layers(ex.view(), rec, compressed, opt.hist_bins, opt.sparsity_p);
  r.divergence = first_divergence(ex.full.generated_ids, ex.full.chosen_probs, r.result.generated_ids,
                                  r.result.chosen_probs);
  for (const auto& d : r.layers) {
    r.mean_softmax_mse += d.softmax_mse / r.layers.size();
    r.mean_kl += d.softmax_kl / r.layers.size();
    r.mean_output_error += d.output_rel_error / r.layers.size();
  }
  const double b = static_cast<double>(r.result.bytes_after_prefill.total());
  r.compression_vs_fp16 = b > 0 ? ex.full_fp16_bytes.total() / b : 0.0;
  return r;
}

nlohmann::json experiment_json(const LlavaModel& model, const Experiment& ex, const ExperimentOptions& opt) {
  const Tokenizer& tok = model.tokenizer();
  nlohmann::json j;
  j["model"] = model.dir();
  j["prompt"] = opt.prompt;
  j["template"] = opt.templ;
  j["prompt_ids"] = ex.prefill.ids;
  j["n_visual_tokens"] = ex.prefill.n_visual;
  j["timings_ms"] = {{"vision", ex.prefill.vision_ms}, {"prefill", ex.prefill.prefill_ms}, {"decode", ex.full.decode_ms}};
  j["options"] = {{"max_new_tokens", opt.max_new_tokens}, {"diag_steps", opt.diag_steps},
                  {"sparsity_p", opt.sparsity_p}, {"hit_budget", opt.hit_budget}, {"hit_window", opt.hit_window}, {"hist_bins", opt.hist_bins}};
  j["full"] = {{"caption", ex.full.text},
               {"generated_ids", ex.full.generated_ids},
               {"bytes_fp32", to_json(ex.full.bytes_after_prefill)},
               {"bytes_fp16", to_json(ex.full_fp16_bytes)},
               {"sparsity_prefill", ex.sparsity_prefill},
               {"sparsity_decode", ex.sparsity_decode_full}};
  j["cache_hit_rate"] = to_json(ex.hit_rates);
  j["definitions"] = diagnostic_definitions();
  j["methods"] = nlohmann::json::array();
  for (const MethodRun& r : ex.runs) {
    nlohmann::json m;
    m["spec"] = r.params.spec();
    m["short_spec"] = r.params.short_spec();
    m["method"] = r.params.method();
    m["params"] = r.params.to_json();
    m["caption"] = r.result.text;
    m["generated_ids"] = r.result.generated_ids;
    m["same_as_full"] = r.result.generated_ids == ex.full.generated_ids;
    m["bytes_after_prefill"] = to_json(r.result.bytes_after_prefill);
    m["bytes_final"] = to_json(r.result.bytes_final);
    m["compression_vs_fp16"] = r.compression_vs_fp16;
    m["timings_ms"] = {{"compress", r.result.compress_ms}, {"decode", r.result.decode_ms}};
    m["mean_softmax_mse"] = r.mean_softmax_mse;
    m["mean_softmax_kl"] = r.mean_kl;
    m["mean_attn_output_rel_error"] = r.mean_output_error;
    const FirstDivergence& d = r.divergence;
    m["first_divergence"] = {{"position", d.position},
                             {"full_token", d.full_token},
                             {"full_piece", d.full_token >= 0 ? tok.piece(d.full_token) : ""},
                             {"full_prob", d.full_prob},
                             {"method_token", d.method_token},
                             {"method_piece", d.method_token >= 0 ? tok.piece(d.method_token) : ""},
                             {"method_prob", d.method_prob}};
    m["layers"] = nlohmann::json::array();
    for (const auto& l : r.layers) m["layers"].push_back(to_json(l));
    j["methods"].push_back(m);
  }
  return j;
}

std::vector<CalibrationPoint> calibrate_grid(const LlavaModel& model, const Experiment& ex,
                                             const std::string& base_spec, const std::vector<double>& taus,
                                             const ExperimentOptions& opt) {
  const Params base = parse_method_spec(base_spec);
  if (base.method() != "calibquant")
    throw InputError("calibrate: --base must be a calibquant spec, got '" + base.method() + "'");
  if (base.str("calibrate") == "off" || (base.str("calibrate") == "auto" && base.integer("bits") > 2))
    throw InputError("calibrate: the base spec '" + base.spec() +
                     "' does not calibrate (calibration applies at bits <= 2, or with calibrate=force)");
  std::vector<CalibrationPoint> pts;
  for (double t1 : taus)
    for (double t2 : taus) {
      std::map<std::string, std::string> v = base.values();
      std::ostringstream a, b;
      a << t1;
      b << t2;
      v["tau1"] = a.str();
      v["tau2"] = b.str();
      std::string spec = "calibquant:";
      bool first = true;
      for (const auto& kv : v) {
        spec += (first ? "" : ",") + kv.first + "=" + kv.second;
        first = false;
      }
      const MethodRun r = run_method(model, ex, parse_method_spec(spec), opt);
      CalibrationPoint p;
      p.tau1 = t1;
      p.tau2 = t2;
      p.mse = r.mean_softmax_mse;
      p.kl = r.mean_kl;
      p.same_caption = r.result.generated_ids == ex.full.generated_ids;
      pts.push_back(p);
    }
  return pts;
}

}  // namespace kvlens
