#include "app/lab/experiment.h"

#include "app/lab/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <future>

#include "core/errors.h"
#include "core/numbers.h"
#include "core/parallel.h"
#include "core/trace.h"

namespace kvlens {

PrefillView prefill_view(const PrefillState& prefill) {
  PrefillView v;
  v.full = &prefill.store;
  v.attention = prefill.capture.attention.get();
  v.kinds = &prefill.kinds;
  v.n_heads = v.attention ? v.attention->n_heads() : 0;
  v.prompt_len = static_cast<int>(prefill.ids.size());
  return v;
}

PrefillView Experiment::view() const { return prefill_view(prefill); }

Experiment start_experiment(const Model& model, const RGBImage& img, const ExperimentOptions& opt,
                            const std::vector<AttentionObserver*>& observers) {
  check_memory(model, opt, model.visual_layout(img.width, img.height));  // refused before any work when the run cannot fit
  PrefillState st;
  {
    trace::Scope span("experiment.prefill");
    st = model.prefill(img, opt.prompt, opt.templ, true);
  }
  return start_experiment(model, std::move(st), opt, observers);
}

namespace {

// The first `steps` decode rows a recorder kept of `layer` (mean over heads, keys 0 .. T + steps),
// pooled into `cols` key blocks as the prompt's map is ([steps][cols]).
std::vector<float> pooled_decode_rows(const DecodeRecorder& rec, int layer, int steps, int T, int cols) {
  const int n = T + steps;
  const std::vector<float> d = decode_attention_rows(rec, layer, steps, n);
  std::vector<float> out(static_cast<size_t>(steps) * cols);
  pool_map_rows(d.data(), steps, T, n, cols, out.data());
  return out;
}

}  // namespace

Experiment start_experiment(const Model& model, PrefillState prefill, const ExperimentOptions& opt,
                            const std::vector<AttentionObserver*>& observers) {
  if (opt.attention_maps && opt.attention_bins < 1)
    throw InputError("--attention-bins must be at least 1, got " + std::to_string(opt.attention_bins));
  Experiment ex;
  ex.prefill = std::move(prefill);
  const int max_step = std::max(opt.diag_steps, *std::max_element(opt.hit_steps.begin(), opt.hit_steps.end()) + 1);
  // Hit rates, sparsity and the attention maps read the full cache's probabilities, not its rows,
  // of the diagnostic steps and the hit-rate steps alone.
  ex.full_recorder = std::make_unique<DecodeRecorder>(max_step, false);
  std::vector<int> read(opt.hit_steps);
  for (int s = 0; s < opt.diag_steps; ++s) read.push_back(s);
  ex.full_recorder->record_only(read);
  GenerateOptions g;
  g.max_new_tokens = opt.max_new_tokens;
  g.kv_storage = opt.kv_storage;
  g.keep_going = opt.keep_going;
  std::vector<AttentionObserver*> obs{ex.full_recorder.get()};
  obs.insert(obs.end(), observers.begin(), observers.end());
  {
    trace::Scope span("experiment.full_decode");
    ex.full = model.decode(ex.prefill, nullptr, g, obs);
  }
  const PrefillView pv = ex.view();
  const int L = ex.prefill.store.n_layers();
  HitTruth truth;
  {
    // The prefill's reductions the sparsity and the hit rates read, every layer in one pass; the
    // diagnostics' decode side, which reads none of them, meanwhile on another thread (on a
    // device, while the host waits for the reductions).
    trace::Scope span("experiment.prefill_reductions");
    auto decode_side = std::async(std::launch::async, [&] {
      trace::Scope side_span("experiment.decode_side");
      truth = hit_rate_truth(pv, *ex.full_recorder, opt.hit_budget, opt.hit_steps);
      // (over the steps a method's decode sparsity reads)
      ex.sparsity_decode_full = decode_sparsities(*ex.full_recorder, L, opt.diag_steps, opt.sparsity_p);
    });
    try {
      prepare_prefill_diagnostics(pv, opt.sparsity_p, opt.hit_window);
    } catch (...) {
      decode_side.wait();
      throw;
    }
    decode_side.get();
  }
  {
    trace::Scope sparsity_span("experiment.sparsity");
    ex.sparsity_prefill = prefill_sparsities(pv, opt.sparsity_p);
    for (int l = 0; l < L; ++l)
      for (const KVSegment& seg : ex.prefill.store.layer(l).segments)
        ex.full_fp16_bytes += seg.dense_bytes(ex.prefill.store.head_dim(), 2);
  }
  {
    trace::Scope hit_span("experiment.hit_rates");
    ex.hit_rates = cache_hit_rates(pv, truth, opt.hit_window);
  }
  if (opt.attention_maps) {
    trace::Scope maps_span("experiment.attention_maps");
    const int T = pv.prompt_len, S = std::min(opt.diag_steps, ex.full_recorder->steps()), n = T + S;
    ex.attention_steps = S;
    ex.attention_rows = std::min(T, opt.attention_bins);
    ex.attention_cols = std::min(n, opt.attention_bins);
    const int R = ex.attention_rows, C = ex.attention_cols;
    for (int l = 0; l < ex.prefill.store.n_layers(); ++l) {
      std::vector<float> m(static_cast<size_t>(R + S) * C, 0.0f);
      AttentionReduction r;
      r.queries = AttentionReduction::range(0, T, T);
      r.map = m.data();
      r.map_rows = R;
      r.map_cols = C;
      r.map_keys = n;
      pv.attention->reduce(l, r);
      const std::vector<float> d = pooled_decode_rows(*ex.full_recorder, l, S, T, C);
      std::copy(d.begin(), d.end(), m.begin() + static_cast<ptrdiff_t>(R) * C);
      ex.attention.push_back(std::move(m));
    }
  }
  return ex;
}

MethodRun run_method(const Model& model, const Experiment& ex, const Params& params,
                     const ExperimentOptions& opt, const std::vector<AttentionObserver*>& observers) {
  MethodRun r;
  r.params = params;
  auto policy = make_policy(params);
  // Each recorded query is compared with its exact attention as it comes; no rows are kept (on
  // a device, none cross to the host).
  DecodeRecorder rec(opt.diag_steps, ex.view());
  KVStore compressed;
  GenerateOptions g;
  g.max_new_tokens = opt.max_new_tokens;
  g.kv_storage = opt.kv_storage;
  g.keep_going = opt.keep_going;
  std::vector<AttentionObserver*> obs{&rec};
  obs.insert(obs.end(), observers.begin(), observers.end());
  {
    trace::Scope span("experiment.method_decode");
    r.result = model.decode(ex.prefill, policy.get(), g, obs, &compressed);
  }
  if (!ex.attention.empty()) {
    const int T = static_cast<int>(ex.prefill.ids.size());
    for (int l = 0; l < ex.prefill.store.n_layers(); ++l)
      r.decode_attention.push_back(pooled_decode_rows(rec, l, ex.attention_steps, T, ex.attention_cols));
  }
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

// Attention probabilities to 1e-6: enough for a heatmap, and a third of the JSON. A positive
// value stays positive (at least 1e-6), so that 0 means no attention at all (keys not held).
nlohmann::json attention_rows(const std::vector<float>& m, int rows, int cols) {
  nlohmann::json out = nlohmann::json::array();
  for (int i = 0; i < rows; ++i) {
    nlohmann::json row = nlohmann::json::array();
    for (int j = 0; j < cols; ++j) {
      const float v = m[static_cast<size_t>(i) * cols + j];
      const double q = std::round(v * 1e6) / 1e6;
      row.push_back(v > 0 ? std::max(1e-6, q) : q);
    }
    out.push_back(std::move(row));
  }
  return out;
}

nlohmann::json experiment_json(const Model& model, const Experiment& ex, const ExperimentOptions& opt) {
  std::vector<const MethodRun*> runs;
  for (const MethodRun& r : ex.runs) runs.push_back(&r);
  return experiment_json(model, ex, runs, opt);
}

nlohmann::json experiment_json(const Model& model, const Experiment& ex,
                               const std::vector<const MethodRun*>& runs, const ExperimentOptions& opt) {
  nlohmann::json j = experiment_base_json(model, ex, opt);
  for (const MethodRun* r : runs) j["methods"].push_back(method_run_json(model, ex, *r));
  return j;
}

std::string model_template(const Model& model, const std::string& templ) {
  if (templ != kDefaultTemplate) return templ;
  // The checkpoint's own chat template for one user turn, where it ships one.
  const std::string chat = model.tokenizer().chat_prompt(model.info().takes_image());
  if (!chat.empty()) return chat;
  return model.info().takes_image() ? templ : "{prompt}";
}

PromptSpan prompt_span(const Model& model, const PrefillState& st) {
  PromptSpan s;
  const auto at = std::find(st.kinds.begin(), st.kinds.end(), SegmentKind::Visual);
  if (at == st.kinds.end() || st.n_visual == 0) return s;
  s.first = static_cast<int>(at - st.kinds.begin());
  s.n = st.n_visual;
  s.text = model.tokenizer().decode(std::vector<int>(st.ids.begin() + s.first, st.ids.begin() + s.first + s.n));
  return s;
}

nlohmann::json experiment_base_json(const Model& model, const Experiment& ex, const ExperimentOptions& opt) {
  nlohmann::json j;
  j["model"] = model.dir();
  j["backend"] = model.backend().name();
  j["device"] = model.backend().device();
  j["prompt"] = opt.prompt;
  j["template"] = opt.templ;
  j["prompt_ids"] = ex.prefill.ids;
  j["n_visual_tokens"] = ex.prefill.n_visual;
  j["token_kinds"] = nlohmann::json::array();
  for (SegmentKind k : ex.prefill.kinds) j["token_kinds"].push_back(segment_kind_name(k));
  // The patch grid of the visual tokens: rows × cols patches, the first `first` visual tokens
  // (CLS, with the "full" feature strategy) not on it, `row_stride` tokens from one row to the
  // next; for an image cut into tiles the finest grid (the tiles', whose rows end with a newline
  // token), and every grid under visual_layout.
  const ModelInfo& info = model.info();
  const VisualLayout& layout = ex.prefill.layout;
  if (const VisualGrid* fine = layout.finest()) {
    const VisualGrid& g = *fine;
    j["patch_grid"] = patch_grid_json(g);
    nlohmann::json grids = nlohmann::json::array();
    for (const VisualGrid& v : layout.grids)
      grids.push_back({{"name", v.name}, {"first", v.first}, {"rows", v.rows}, {"cols", v.cols},
                       {"row_stride", v.row_stride}, {"tile_side", v.tile_side}, {"cut_top", v.cut_top},
                       {"cut_left", v.cut_left}, {"tile_major", v.tile_major}});
    j["visual_layout"] = {{"tokens", layout.n_tokens}, {"image_width", layout.image_width},
                          {"image_height", layout.image_height}, {"grids", grids}, {"text", layout.describe()}};
  } else {
    j["patch_grid"] = {{"rows", info.patch_rows}, {"cols", info.patch_cols},
                       {"first", ex.prefill.n_visual - info.patch_rows * info.patch_cols}};
  }
  // A text-only model's "visual" tokens are the span of the prompt its template marks: where it
  // lies and what it says.
  if (!info.takes_image()) {
    const PromptSpan span = prompt_span(model, ex.prefill);
    j["prompt_span"] = {{"first", span.first}, {"n", span.n}, {"text", span.text}};
  }
  j["timings_ms"] = {{"preprocess", ex.prefill.preprocess_ms}, {"vision", ex.prefill.vision_ms},
                     {"prefill", ex.prefill.prefill_ms}, {"decode", ex.full.decode_ms}};
  j["options"] = {{"max_new_tokens", opt.max_new_tokens}, {"kv_storage", row_storage_name(opt.kv_storage)},
                  {"diag_steps", opt.diag_steps},
                  {"sparsity_p", opt.sparsity_p}, {"hit_budget", opt.hit_budget}, {"hit_window", opt.hit_window}, {"hist_bins", opt.hist_bins}};
  j["full"] = {{"caption", ex.full.text},
               {"generated_ids", ex.full.generated_ids},
               {"bytes", to_json(ex.full.bytes_after_prefill)},
               {"bytes_fp16", to_json(ex.full_fp16_bytes)},
               {"compression_vs_fp16", ex.full.bytes_after_prefill.total() > 0
                                           ? static_cast<double>(ex.full_fp16_bytes.total()) / ex.full.bytes_after_prefill.total()
                                           : 0.0},
               {"sparsity_prefill", ex.sparsity_prefill},
               {"sparsity_decode", ex.sparsity_decode_full}};
  if (ex.references) {
    j["references"] = {{"annotations", ex.references->annotations}, {"captions", ex.references->refs.size()}};
    j["full"]["cider_d"] = ex.references->cider_d(ex.full.text);
  }
  j["cache_hit_rate"] = to_json(ex.hit_rates);
  const int T = static_cast<int>(ex.prefill.ids.size());
  if (!ex.attention.empty()) {
    j["attention"] = {{"steps", ex.attention_steps}, {"size", T + ex.attention_steps}, {"prompt", T},
                      {"rows", ex.attention_rows}, {"cols", ex.attention_cols}, {"zero_is_absent", true},
                      {"layers", nlohmann::json::array()}};
    for (const auto& m : ex.attention)
      j["attention"]["layers"].push_back(attention_rows(m, ex.attention_rows + ex.attention_steps, ex.attention_cols));
  }
  j["definitions"] = diagnostic_definitions();
  j["methods"] = nlohmann::json::array();
  return j;
}

nlohmann::json method_run_json(const Model& model, const Experiment& ex, const MethodRun& r) {
  const Tokenizer& tok = model.tokenizer();
  nlohmann::json m;
  {
    m["spec"] = r.params.spec();
    m["short_spec"] = r.params.short_spec();
    if (!r.label.empty()) m["label"] = r.label;
    m["method"] = r.params.method();
    m["params"] = r.params.to_json();
    m["caption"] = r.result.text;
    m["generated_ids"] = r.result.generated_ids;
    m["same_as_full"] = r.result.generated_ids == ex.full.generated_ids;
    if (ex.references) m["cider_d"] = ex.references->cider_d(r.result.text);
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
    // Each layer's diagnostics and decode map, written on threads of their own, then in order.
    const int nl = static_cast<int>(r.layers.size()), nm = static_cast<int>(r.decode_attention.size());
    std::vector<nlohmann::json> parts(static_cast<size_t>(nl + nm));
    parallel_for(nl + nm, 8, [&](int i) {
      parts[static_cast<size_t>(i)] = i < nl ? to_json(r.layers[static_cast<size_t>(i)])
                                             : attention_rows(r.decode_attention[static_cast<size_t>(i - nl)],
                                                              ex.attention_steps, ex.attention_cols);
    });
    m["layers"] = nlohmann::json::array();
    for (int i = 0; i < nl; ++i) m["layers"].push_back(std::move(parts[static_cast<size_t>(i)]));
    if (nm > 0) {
      m["decode_attention"] = nlohmann::json::array();
      for (int i = nl; i < nl + nm; ++i) m["decode_attention"].push_back(std::move(parts[static_cast<size_t>(i)]));
    }
  }
  return m;
}

Params calibrating_base(const std::string& base_spec) {
  const Params base = parse_method_spec(base_spec);
  if (!calibration_stage(base))
    throw InputError("calibrate: --base must be a spec of a method that calibrates scores with tau1/tau2, got '" +
                     base.method() + "'");
  if (!calibration_of(base))
    throw InputError("calibrate: the base spec '" + base.spec() +
                     "' does not calibrate (calibration applies at bits <= 2, or with calibrate=force)");
  return base;
}

std::vector<CalibrationPoint> calibrate_grid(const Model& model, const Experiment& ex,
                                             const std::string& base_spec, const std::vector<double>& taus,
                                             const ExperimentOptions& opt) {
  const Params base = calibrating_base(base_spec);
  std::vector<CalibrationPoint> pts;
  for (double t1 : taus)
    for (double t2 : taus) {
      std::map<std::string, std::string> v = base.values();
      v["tau1"] = format_number(t1);
      v["tau2"] = format_number(t2);
      const MethodRun r = run_method(model, ex, make_params(base.method(), "", v), opt);
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
