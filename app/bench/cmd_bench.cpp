// kvlens bench: speed on this machine, as a table and (with --json) a JSON file.
//   kvlens bench             caption latency of a model (vision, prefill, per-token decode, median
//                            of repeated runs) with decode tokens/s against the roofline: copy
//                            bandwidth measured in the same run ÷ language-model weight bytes
//   kvlens bench attention   decode attention alone (CUDA): fp16 and 4/2/1-bit caches, contexts,
//                            batch sizes; achieved bandwidth as a share of the copy bandwidth
//   kvlens bench gemv        the decode step's one-token products alone (CUDA)
//   kvlens bench prefill     prefill / vision attention alone (CUDA) at LLaVA-1.5-7B's shapes
//   kvlens bench throughput  CalibQuant's Fig. 3 (CUDA): largest batch under a KV memory budget
//                            and decode tokens/s, fp16 against 2-bit and 1-bit visual tokens
//   kvlens bench session     the desktop app's loop without a window: a session's methods, then
//                            each parameter edit timed to its caption and to every plot's data

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <utility>

#include <nlohmann/json.hpp>

#include "app/cli/backend_option.h"
#include "app/cli/commands.h"
#include "app/cli/defaults.h"
#include "app/cli/model_inputs.h"
#include "app/lab/experiment.h"
#include "app/cli/options.h"
#include "app/lab/session.h"
#include "app/lab/session_bench.h"
#include "app/cli/trace_option.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/compress/method.h"
#include "core/numbers.h"
#include "core/parallel.h"
#include "kernels/backends.h"
#include "models/model.h"
#ifdef KVLENS_HAVE_CUDA
#include "app/bench/bench.h"
#include "kernels/cuda/kernels.h"
#endif

namespace kvlens::app {

namespace {

struct BenchArgs {
  std::string model, image, method, prompt = kDefaultPrompt, json, trace;
  int repeat = 5, max_new_tokens = 32, threads = 0;
  bool profile = false, unchained = false;
  BackendOptions backend;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// A list of integers, each parsed strictly (core/numbers) and checked against [lo, hi].
CLI::Option* add_ints(CLI::App* app, const std::string& name, std::vector<int>& var, int lo, int hi,
                      const std::string& help) {
  std::string def;
  for (int x : var) def += (def.empty() ? "" : " ") + std::to_string(x);
  return app
      ->add_option_function<std::vector<std::string>>(
          name,
          [&var, name, lo, hi](const std::vector<std::string>& v) {
            var.clear();
            for (const std::string& x : v) var.push_back(static_cast<int>(parse_integer(x, name, lo, hi)));
          },
          help + " (each in [" + std::to_string(lo) + ", " + std::to_string(hi) + "])")
      ->type_name("INT ...")
      ->default_str(def);
}

void write_json(const std::string& path, const nlohmann::json& j) {
  if (!path.empty()) write_file_atomic(path, j.dump(1) + "\n", "benchmark JSON");
}

void run_bench(const BenchArgs& a) {
  if (a.threads > 0) set_threads(a.threads);
  if (!a.method.empty()) parse_method_spec(a.method);
  if (a.profile) setenv("KVLENS_CUDA_PROFILE", "1", 1);  // read when the CUDA backend starts
  start_trace(a.trace);  // (refused here, before any work, when it cannot be written)
  const std::unique_ptr<Model> model_owned = load_model(model_dir_of(a.model), a.backend);
  const Model& model = *model_owned;
  const RGBImage img = command_image(model, a.image);  // (none for a text-only model)
  const std::string templ = model_template(model, kDefaultTemplate);
  std::vector<double> preprocess, vision, prefill, compress, per_token, total;
  std::vector<std::pair<std::string, double>> prof_prefill, prof_decode;
  int tokens = 0, prompt_tokens = 0, visual_tokens = 0;
  long long bytes = 0;
  bool chained = false;  // the decode chained its steps (GenerateOptions::chain_steps)
  for (int i = 0; i < a.repeat + 1; ++i) {  // the first run warms caches, thread pools, kernels
    std::unique_ptr<KVPolicy> policy = a.method.empty() ? nullptr : make_policy(a.method);
    const bool keep = policy && policy->needs_prefill_attention();
    model.backend().profile_report();  // per-op times of the last run only
    const PrefillState st = model.prefill(img, a.prompt, templ, keep);
    prof_prefill = model.backend().profile_report();
    GenerateOptions g;
    g.max_new_tokens = a.max_new_tokens;
    g.stop_at_eos = false;  // every run decodes the same number of tokens
    g.chain_steps = !a.unchained;
    const DecodeResult r = model.decode(st, policy.get(), g);
    prof_decode = model.backend().profile_report();
    if (i == 0) continue;
    chained = r.chained;
    preprocess.push_back(st.preprocess_ms);
    const int steps = static_cast<int>(r.generated_ids.size()) - 1;  // decode forwards
    vision.push_back(st.vision_ms);
    prefill.push_back(st.prefill_ms);
    compress.push_back(r.compress_ms);
    per_token.push_back(steps > 0 ? r.decode_ms / steps : 0.0);
    total.push_back(st.preprocess_ms + st.vision_ms + st.prefill_ms + r.compress_ms + r.decode_ms);
    tokens = static_cast<int>(r.generated_ids.size());
    prompt_tokens = static_cast<int>(st.ids.size());
    visual_tokens = st.n_visual;  // (this image's: an anyres or tiling model's depend on it)
    bytes = r.bytes_after_prefill.total();
  }
  // The research path's prefill (kvlens run, the app): the same prompt keeping its attention —
  // each layer's queries, keys and values in the backend's memory,
  // from which a layer's probabilities are recomputed when a method or a view asks.
  // Then the reductions of every layer that `run`'s prefill diagnostics read (the sparsity and
  // the hit rates' sums), from that capture, and the sparsity from them.
  std::vector<double> capture_prefill, view_ms, reductions_ms;
  std::vector<std::pair<std::string, double>> prof_reductions;
  int64_t capture_dev = 0, view_bytes = 0;
  for (int i = 0; i < std::max(1, a.repeat); ++i) {
    const PrefillState st = model.prefill(img, a.prompt, templ, true);
    capture_prefill.push_back(st.prefill_ms);
    capture_dev = st.capture.attention->capture_bytes();
    const PrefillView pv = prefill_view(st);
    model.backend().profile_report();
    const auto s0 = std::chrono::steady_clock::now();
    const ExperimentOptions defaults;
    prepare_prefill_diagnostics(pv, defaults.sparsity_p, defaults.hit_window);
    prefill_sparsities(pv, defaults.sparsity_p);
    reductions_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count());
    prof_reductions = model.backend().profile_report();
    const auto t0 = std::chrono::steady_clock::now();
    const auto probs = st.capture.attention->probs(st.capture.attention->n_layers() - 1);
    view_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    view_bytes = static_cast<int64_t>(probs->size() * sizeof(float));
  }
  Backend& be = model.backend();
  const double copy = be.copy_bandwidth();
  const double wbytes = static_cast<double>(model.decode_weight_bytes());
  // With one token there is no decode step to time.
  const double tps = median(per_token) > 0 ? 1000.0 / median(per_token) : 0.0, roof = copy / wbytes;
  std::printf("model %s\nbackend %s: %s\n", model.dir().c_str(), be.name().c_str(), be.device().c_str());
  std::printf("%d runs, prompt %d tokens (%d visual), %d tokens generated, KV bytes after prefill %lld\n", a.repeat,
              prompt_tokens, visual_tokens, tokens, bytes);
  std::printf("%-26s %12s\n", "stage (median)", "value");
  std::printf("%-26s %12.2f ms\n", "image preprocessing (host)", median(preprocess));
  std::printf("%-26s %12.2f ms\n", "vision", median(vision));
  std::printf("%-26s %12.2f ms\n", "prefill", median(prefill));
  std::printf("%-26s %12.2f ms\n", "vision + prefill", median(vision) + median(prefill));
  std::printf("%-26s %12.2f ms\n", "compress", median(compress));
  std::printf("%-26s %12.3f ms%s\n", "decode per token", median(per_token), chained ? " (steps chained)" : "");
  std::printf("%-26s %12.1f tokens/s\n", "decode", tps);
  std::printf("%-26s %12.1f GB/s\n", "copy bandwidth", copy / 1e9);
  std::printf("%-26s %12.3f GB\n", "LM weights read per token", wbytes / 1e9);
  std::printf("%-26s %12.1f tokens/s\n", "roofline (copy / weights)", roof);
  std::printf("%-26s %12.1f %%\n", "decode / roofline", 100.0 * tps / roof);
  std::printf("%-26s %12.2f ms\n", "caption total", median(total));
  std::printf("%-26s %12.2f ms\n", "prefill with capture", median(capture_prefill));
  std::printf("%-26s %12.1f MB (%s)\n", "capture memory", capture_dev / 1e6, be.name() == "cpu" ? "host" : "device");
  std::printf("%-26s %12.2f ms (%.1f MB to the host)\n", "one layer's attention", median(view_ms), view_bytes / 1e6);
  std::printf("%-26s %12.2f ms\n", "prefill reductions", median(reductions_ms));
  const int steps = std::max(1, tokens - 1);
  if (!prof_prefill.empty() || !prof_decode.empty()) {
    std::printf("\nper-op device time of the last run (no step replay while profiling)\n%-22s %12s %16s %12s\n", "op",
                "vision+prefill ms", "decode ms/token", "reductions ms");
    std::vector<std::string> names;
    for (const auto* v : {&prof_prefill, &prof_decode, &prof_reductions})
      for (const auto& x : *v)
        if (std::find(names.begin(), names.end(), x.first) == names.end()) names.push_back(x.first);
    auto op_ms = [](const std::vector<std::pair<std::string, double>>& v, const std::string& n) {
      double t = 0;
      for (const auto& x : v) t += x.first == n ? x.second : 0;
      return t;
    };
    for (const auto& n : names)
      std::printf("%-22s %12.3f %16.4f %12.3f\n", n.c_str(), op_ms(prof_prefill, n), op_ms(prof_decode, n) / steps,
                  op_ms(prof_reductions, n));
  }
  write_json(a.json, {{"model", model.dir()},
                      {"backend", be.name()},
                      {"device", be.device()},
                      {"method", a.method.empty() ? "full" : a.method},
                      {"runs", a.repeat},
                      {"chained_steps", chained},
                      {"prompt_tokens", prompt_tokens},
                      {"visual_tokens", visual_tokens},
                      {"generated_tokens", tokens},
                      {"kv_bytes_after_prefill", bytes},
                      {"preprocess_ms", median(preprocess)},
                      {"vision_ms", median(vision)},
                      {"prefill_ms", median(prefill)},
                      {"prefill_with_capture_ms", median(capture_prefill)},
                      {"capture_backend_bytes", capture_dev},
                      {"layer_attention_ms", median(view_ms)},
                      {"layer_attention_bytes", view_bytes},
                      {"prefill_reductions_ms", median(reductions_ms)},
                      {"compress_ms", median(compress)},
                      {"decode_ms_per_token", median(per_token)},
                      {"decode_tokens_per_s", tps},
                      {"copy_bandwidth_gbs", copy / 1e9},
                      {"lm_weight_bytes", wbytes},
                      {"roofline_tokens_per_s", roof},
                      {"share_of_roofline", tps / roof},
                      {"caption_total_ms", median(total)}});
  finish_trace(a.trace);
}

void need_cuda(const std::string& what) {
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) throw InputError("kvlens bench " + what + " needs the CUDA backend: " + why);
}

#ifdef KVLENS_HAVE_CUDA
// The CUDA backend on `device`, for the benchmarks that run kernels alone.
std::shared_ptr<Backend> cuda_backend(int device) {
  BackendOptions o;
  o.kind = "cuda";
  o.device = device;
  return make_backend(o);
}
#endif

struct AttnArgs {
  std::vector<int> contexts{4096, 16384, 65536}, batches{1, 16}, bits{16, 4, 2, 1}, splits{0};
  int heads = 32, kv_heads = 0, head_dim = 128, device = 0, reps = 30;
  bool no_calib = false, back_to_back = false, host_paced = false;
  std::string gqa_kernel = "auto";
  std::string json;
};

void run_attention(const AttnArgs& a) {
  // The arguments first, so that bad ones are named on any machine.
  for (int b : a.bits)
    if (b != 16 && (b < 1 || b > 8)) throw InputError("--bits: each must be 16 (fp16) or in [1, 8], got " + std::to_string(b));
  if (a.head_dim % 8 || a.head_dim > 256) throw InputError("--head-dim must be a multiple of 8, at most 256");
  const int kv_heads = a.kv_heads > 0 ? a.kv_heads : a.heads;
  if (a.heads % kv_heads)
    throw InputError("--kv-heads must divide --heads (" + std::to_string(a.heads) + "), got " + std::to_string(kv_heads));
#ifdef KVLENS_HAVE_CUDA
  if (a.gqa_kernel == "on" && !cuda::decode_f16_gqa(a.head_dim, a.heads, kv_heads))
    throw InputError("--gqa-kernel on: the GQA kernel takes head sizes 32, 64 and 128 and 2 to " +
                     std::to_string(cuda::kDecodeGqaMaxRatio) + " query heads a KV head; got head size " +
                     std::to_string(a.head_dim) + ", " + std::to_string(a.heads) + " / " + std::to_string(kv_heads) +
                     " heads");
#endif
  need_cuda("attention");
#ifdef KVLENS_HAVE_CUDA
  auto be = cuda_backend(a.device);
  const double copy = be->copy_bandwidth();
  cuda::AttnBenchConfig c;
  c.device = a.device;
  c.heads = a.heads;
  c.kv_heads = kv_heads;
  c.gqa_kernel = a.gqa_kernel;
  c.head_dim = a.head_dim;
  c.contexts = a.contexts;
  c.batches = a.batches;
  c.bits = a.bits;
  c.calibrated = !a.no_calib;
  c.splits = a.splits;
  c.back_to_back = a.back_to_back;
  c.host_paced = a.host_paced;
  c.reps = a.reps;
  const auto rows = cuda::bench_decode_attention(c, copy / 1e9);
  const double floor_ms = cuda::bench_call_floor_ms(c);
  // The timing's JSON key and its description in the table's title.
  const auto [timing, timing_text] =
      a.back_to_back ? std::pair("back_to_back", "calls back to back (median of 5 runs)")
      : a.host_paced ? std::pair("isolated_host_paced", "each call timed alone, host launch included (median)")
                     : std::pair("isolated", "each call timed alone on a held stream (median)");
  std::printf("decode attention, %d heads (%d KV%s) x %d, %s; copy bandwidth %.1f GB/s; ms per call, %s\n", a.heads,
              kv_heads, kv_heads < a.heads ? (", GQA kernel " + a.gqa_kernel).c_str() : "", a.head_dim,
              be->device().c_str(), copy / 1e9, timing_text);
  std::printf("an empty kernel launched and timed the same way: %.4f ms\n", floor_ms);
  std::printf("%-9s %6s %8s %6s %10s %10s %9s %8s %9s\n", "format", "batch", "context", "splits", "ms", "MB read", "GB/s",
              "of copy", "vs fp16");
  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : rows) {
    const std::string format = r.format + (r.gqa_kernel ? "/gqa" : "");
    std::printf("%-9s %6d %8d %6d %10.4f %10.1f %9.1f %7.1f%% %8.2fx\n", format.c_str(), r.batch, r.context, r.splits,
                r.ms, r.bytes / 1e6, r.gbs, 100 * r.share_of_copy, r.speedup_vs_fp16);
    j.push_back({{"format", r.format}, {"bits", r.bits}, {"batch", r.batch}, {"context", r.context},
                 {"splits", r.splits}, {"ms", r.ms},
                 {"bytes", r.bytes}, {"gbs", r.gbs}, {"share_of_copy", r.share_of_copy},
                 {"speedup_vs_fp16", r.speedup_vs_fp16}, {"gqa_kernel", r.gqa_kernel}});
  }
  write_json(a.json, {{"device", be->device()}, {"copy_bandwidth_gbs", copy / 1e9}, {"heads", a.heads},
                      {"kv_heads", kv_heads}, {"gqa_kernel_mode", a.gqa_kernel}, {"head_dim", a.head_dim}, {"timing", timing}, {"empty_kernel_ms", floor_ms}, {"rows", j}});
#endif
}

struct GemvArgs {
  std::vector<int> rows_per_warp{0, 1, 2, 4, 8};
  std::vector<std::string> grids{"resident", "full"};
  int hidden = 4096, intermediate = 11008, vocab = 32064, qkv_rows = 0;
  int reps = 40, device = 0;
  std::string json;
};

constexpr int kGemvBenchMax = 32768;  // cuda::kGemvMaxK

void run_gemv(const GemvArgs& a) {
  need_cuda("gemv");
  for (int r : a.rows_per_warp)
    if (r != 0 && r != 1 && r != 2 && r != 4 && r != 8)
      throw InputError("--rows-per-warp: each must be 0 (the kernel's choice), 1, 2, 4 or 8, got " + std::to_string(r));
  if (a.hidden % 8 != 0 || a.intermediate % 8 != 0 || a.hidden > a.intermediate)
    throw InputError("--hidden / --intermediate: multiples of 8 with hidden <= intermediate, got " +
                     std::to_string(a.hidden) + " / " + std::to_string(a.intermediate));
  if (a.grids.empty()) throw InputError("--grid: give full, resident or both");
  for (const std::string& g : a.grids)
    if (g != "full" && g != "resident") throw InputError("--grid: each must be full or resident, got \"" + g + "\"");
#ifdef KVLENS_HAVE_CUDA
  static_assert(kGemvBenchMax == cuda::kGemvMaxK, "--hidden / --intermediate allow what the kernel stages");
  auto be = cuda_backend(a.device);
  const double copy = be->copy_bandwidth();
  cuda::GemvBenchConfig c;
  c.device = a.device;
  c.rows_per_warp = a.rows_per_warp;
  c.hidden = a.hidden, c.intermediate = a.intermediate, c.vocab = a.vocab, c.qkv_rows = a.qkv_rows;
  c.max_blocks.clear();
  for (const std::string& g : a.grids) c.max_blocks.push_back(g == "full" ? 0 : cuda::kGemvResident);
  c.reps = a.reps;
  const auto rows = cuda::bench_gemv(c);
  std::printf("one-token products (hidden %d, intermediate %d, q/k/v rows %d, vocab %d; fp16 weights), %s; copy "
              "bandwidth %.1f GB/s\n",
              a.hidden, a.intermediate, a.qkv_rows > 0 ? a.qkv_rows : 3 * a.hidden, a.vocab, be->device().c_str(),
              copy / 1e9);
  std::printf("%-8s %-14s %6s %6s %5s %-8s %4s %9s %9s %8s\n", "product", "input", "N", "K", "rows", "grid", "pdl", "us",
              "GB/s", "of copy");
  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : rows) {
    const char* grid = r.max_blocks == 0 ? "full" : "resident";
    std::printf("%-8s %-14s %6d %6d %5s %-8s %4s %9.2f %9.1f %7.1f%%\n", r.name.c_str(), r.input.c_str(), r.N, r.K,
                r.rows_per_warp ? std::to_string(r.rows_per_warp).c_str() : "auto", grid, r.pdl ? "on" : "off", r.us,
                r.gbs, 100 * r.gbs * 1e9 / copy);
    j.push_back({{"product", r.name}, {"input", r.input}, {"N", r.N}, {"K", r.K}, {"rows_per_warp", r.rows_per_warp},
                 {"grid", grid}, {"pdl", r.pdl}, {"us", r.us}, {"gbs", r.gbs}});
  }
  std::printf("gate/up: a warp takes a gate row and its up row and writes SiLU(gate)*up in fp16 (rows per warp: auto\n"
              "only); down reads that as its x\n");
  write_json(a.json, {{"device", be->device()}, {"copy_bandwidth_gbs", copy / 1e9}, {"rows", j}});
#endif
}

struct PrefillArgs {
  std::vector<int> key_splits{0, 1, 2};
  int vision_tokens = 577, text_tokens = 616, reps = 50, device = 0;
  std::string json;
};

void run_prefill(const PrefillArgs& a) {
  need_cuda("prefill");
  for (int k : a.key_splits)
    if (k < 0 || k > 2) throw InputError("--key-splits: each must be 0 (the kernel's choice), 1 or 2, got " + std::to_string(k));
#ifdef KVLENS_HAVE_CUDA
  auto be = cuda_backend(a.device);
  cuda::PrefillBenchConfig c;
  c.device = a.device;
  c.vision_tokens = a.vision_tokens;
  c.text_tokens = a.text_tokens;
  c.key_splits = a.key_splits;
  c.reps = a.reps;
  const auto rows = cuda::bench_prefill_attention(c);
  std::printf("prefill / vision attention (LLaVA-1.5-7B shapes, fp16 output), %s\n", be->device().c_str());
  std::printf("%-7s %6s %9s %4s %6s %5s %5s %10s %10s %8s %11s\n", "part", "tokens", "heads", "D", "causal", "split",
              "ran", "eager us", "graph us", "TFLOP/s", "layers ms");
  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : rows) {
    const std::string heads = std::to_string(r.heads) + "/" + std::to_string(r.kv_heads);
    std::printf("%-7s %6d %9s %4d %6s %5s %5d %10.2f %10.2f %8.1f %11.3f\n", r.part.c_str(), r.tokens, heads.c_str(),
                r.head_dim, r.causal ? "yes" : "no", r.key_split ? std::to_string(r.key_split).c_str() : "auto",
                r.key_split_used, r.eager_us, r.graph_us, r.tflops, r.graph_us * r.layers / 1e3);
    j.push_back({{"part", r.part}, {"tokens", r.tokens}, {"heads", r.heads}, {"kv_heads", r.kv_heads},
                 {"head_dim", r.head_dim}, {"causal", r.causal}, {"layers", r.layers}, {"key_split", r.key_split},
                 {"key_split_used", r.key_split_used}, {"eager_us", r.eager_us}, {"graph_us", r.graph_us},
                 {"tflops", r.tflops}});
  }
  // One image and prompt: every vision and text layer at the kernel's own choice.
  double total = 0;
  bool have_auto[2] = {false, false};
  for (const auto& r : rows)
    if (r.key_split == 0) {
      total += r.graph_us * r.layers / 1e3;
      have_auto[r.part == "text"] = true;
    }
  if (have_auto[0] && have_auto[1])
    std::printf("all layers (%d vision + %d text), the kernel's choice: %.3f ms (graph)\n", c.vision_layers,
                c.text_layers, total);
  write_json(a.json, {{"device", be->device()}, {"rows", j}});
#endif
}

struct ThroughputArgs {
  std::vector<double> budgets{5, 10, 15, 20, 25, 30};
  std::vector<int> bits{16, 2, 1};
  int visual = 3328, text = 40, steps = 16, device = 0, max_batch = 1024;
  std::string json;
};

struct SessionArgs {
  std::string session, model, image, json, trace;
  std::vector<std::string> edits;
  BackendOptions backend;
};

void run_session(const SessionArgs& a) {
  const Session s = load_session(a.session);
  if (s.methods.empty()) throw InputError(a.session + ": the session has no methods to edit");
  std::vector<SessionEdit> edits;
  for (const std::string& e : a.edits) edits.push_back(parse_session_edit(e, s));
  if (edits.empty()) edits = default_session_edits(s);
  const std::string model = model_dir_of(!a.model.empty() ? a.model : s.model);
  const std::string image = !a.image.empty() ? a.image : !s.image.empty() ? s.image : default_image_for(model);
  start_trace(a.trace);
  const SessionBench b = bench_session(s, model, image, a.backend, edits);
  finish_trace(a.trace);
  std::printf("bench session %s: %zu methods, %d-token prompt, %s backend\n", a.session.c_str(), s.methods.size(),
              b.prompt_tokens, b.backend.c_str());
  std::printf("first run (model, vision, prefill, full cache, every method): %.0f ms\n", b.first_ms);
  std::printf("%-46s %10s %12s   %8s %8s %9s %8s %8s %8s\n", "edit", "caption ms", "all plots ms", "compress",
              "decode", "hand-over", "diagnost", "report", "other");
  std::vector<double> cap, all;
  nlohmann::json rows = nlohmann::json::array();
  for (const EditTiming& t : b.edits) {
    std::printf("%-46s %10.1f %12.1f   %8.1f %8.1f %9.1f %8.1f %8.1f %8.1f\n", t.edit.text(s).c_str(), t.caption_ms,
                t.ready_ms, t.compress_ms, t.decode_ms, t.handover_ms, t.diagnostics_ms, t.report_ms, t.other_ms);
    cap.push_back(t.caption_ms);
    all.push_back(t.ready_ms);
    rows.push_back({{"edit", t.edit.text(s)}, {"method", t.edit.method}, {"param", t.edit.param}, {"value", t.edit.value},
                    {"spec", t.spec}, {"caption_ms", t.caption_ms}, {"ready_ms", t.ready_ms}, {"caption", t.caption},
                    {"compress_ms", t.compress_ms}, {"decode_ms", t.decode_ms}, {"handover_ms", t.handover_ms},
                    {"diagnostics_ms", t.diagnostics_ms}, {"report_ms", t.report_ms}, {"other_ms", t.other_ms}});
  }
  std::printf("%-46s %10.1f %12.1f\n", "median", median(cap), median(all));
  std::printf("(compress, decode, diagnostics, report and other: the caption's time as the worker spent it; hand-over: "
              "of decode, the observers' events handed over after the steps)\n");
  write_json(a.json, {{"session", a.session}, {"model", model}, {"image", image}, {"backend", b.backend},
                      {"prompt_tokens", b.prompt_tokens}, {"first_ms", b.first_ms}, {"edits", rows},
                      {"median_caption_ms", median(cap)}, {"median_ready_ms", median(all)}});
}

void run_throughput(const ThroughputArgs& a) {
  need_cuda("throughput");
  for (int b : a.bits)
    if (b != 16 && (b < 1 || b > 8)) throw InputError("--bits: each must be 16 (fp16) or in [1, 8], got " + std::to_string(b));
  for (double b : a.budgets)
    if (!(b > 0)) throw InputError("--budgets: each must be > 0 GB");
  if (a.visual < 1 || a.text < 0 || a.steps < 1) throw InputError("--visual and --steps must be >= 1, --text >= 0");
#ifdef KVLENS_HAVE_CUDA
  auto be = cuda_backend(a.device);
  cuda::ThroughputConfig c;
  c.device = a.device;
  c.visual = a.visual;
  c.text = a.text;
  c.steps = a.steps;
  c.budgets_gb = a.budgets;
  c.bits = a.bits;
  c.max_batch = a.max_batch;
  const auto rows = cuda::bench_throughput(c);
  std::printf("decode throughput under a KV budget: LLaVA-1.5-7B-shaped decoder (random fp16 weights), %d visual + %d "
              "text tokens, %s\n",
              a.visual, a.text, be->device().c_str());
  std::printf("%-7s %10s %8s %14s %10s %12s %9s\n", "format", "budget GB", "batch", "MB/sequence", "step ms", "tokens/s",
              "vs fp16");
  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : rows) {
    double base = 0;
    for (const auto& f : rows)
      if (f.bits == 16 && f.budget_gb == r.budget_gb) base = f.tokens_per_s;
    const double speed = base > 0 ? r.tokens_per_s / base : 0;
    std::printf("%-7s %10.0f %8d %14.1f %10.3f %12.1f %8.2fx\n", r.format.c_str(), r.budget_gb, r.batch,
                r.kv_bytes_per_sequence / 1e6, r.step_ms, r.tokens_per_s, speed);
    j.push_back({{"format", r.format}, {"bits", r.bits}, {"budget_gb", r.budget_gb}, {"batch", r.batch},
                 {"kv_bytes_per_sequence", r.kv_bytes_per_sequence}, {"step_ms", r.step_ms},
                 {"tokens_per_s", r.tokens_per_s}, {"speedup_vs_fp16", speed}});
  }
  write_json(a.json, {{"device", be->device()}, {"visual_tokens", a.visual}, {"text_tokens", a.text}, {"rows", j}});
#endif
}

// Runs `run` as sub's callback, after refusing the caption bench's (c's) options given before
// it ('kvlens bench --trace T attention'), which the subcommand would ignore, naming the option.
void on_run(const CLI::App* c, CLI::App* sub, std::function<void()> run) {
  sub->callback([c, sub, run = std::move(run)] {
    for (const CLI::Option* o : c->get_options())
      if (o->count() > 0)
        throw InputError(o->get_name() + " is an option of 'kvlens bench' itself, not of 'kvlens bench " +
                         sub->get_name() + "': give that subcommand's own options after its name");
    run();
  });
}

}  // namespace

void add_bench_command(CLI::App& root) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* c = root.add_subcommand("bench", "Speed: caption latency and decode roofline; 'attention', 'gemv', 'prefill' and 'throughput' on CUDA");
  c->require_subcommand(0, 1);
  c->add_option("--model", a->model, kModelHelp);
  add_backend_options(c, a->backend);
  c->add_option("--image", a->image, "Image (default: the embedded sample image)");
  c->add_option("--prompt", a->prompt, "Text in place of {prompt} in the default template")->capture_default_str();
  c->add_option("--method", a->method, "Compression method spec (default: full cache)");
  add_int(c, "--repeat", a->repeat, 1, 10000, "Timed runs after one warm-up");
  add_int(c, "--max-new-tokens", a->max_new_tokens, 1, kMaxNewTokensLimit, "Tokens per caption (no stop at EOS)");
  add_int(c, "--threads", a->threads, 0, 256, "CPU threads for kvlens's loops and matrix products, at most the machine's physical cores (0 = as OMP_NUM_THREADS says; unset: loops on one thread, products on every core); OpenBLAS runs each product's blocks on one thread");
  c->add_option("--json", a->json, "Also write the numbers as JSON here");
  c->add_flag("--profile", a->profile, "CUDA: per-op device times of the last run (steps are not replayed from graphs)");
  add_trace_option(c, a->trace);
  c->add_flag("--unchained", a->unchained,
              "CUDA: launch each decode step only after the previous one's logits are back on the host");

  auto t = std::make_shared<AttnArgs>();
  CLI::App* at = c->add_subcommand("attention", "Decode attention alone (CUDA): fp16 and packed caches vs copy bandwidth");
  add_ints(at, "--contexts", t->contexts, 1, 1 << 24, "Cached rows per sequence");
  add_ints(at, "--batches", t->batches, 1, 4096, "Sequences per call");
  add_ints(at, "--bits", t->bits, 1, 16, "16 = fp16, else b-bit channel-wise codes");
  add_int(at, "--heads", t->heads, 1, 1024, "Query heads");
  add_int(at, "--kv-heads", t->kv_heads, 0, 1024, "KV heads, dividing --heads (0 = as many as --heads; fewer: GQA)");
  at->add_option("--gqa-kernel", t->gqa_kernel,
                 "With GQA and fp16 rows: the kernel that reads a KV head's rows once for all its query heads where "
                 "the decode plan takes it (auto), at every point (on), or never (off: each query head its own blocks)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  add_int(at, "--head-dim", t->head_dim, 8, 256, "Head dimension (a multiple of 8)");
  add_ints(at, "--splits", t->splits, 0, 1024, "Splits of each head's rows (0 = the kernel's choice)");
  add_int(at, "--reps", t->reps, 1, 100000, "Timed calls per point (median), or calls per timing with --back-to-back");
  add_int(at, "--device", t->device, 0, 1024, "CUDA device ordinal");
  at->add_flag("--no-calibration", t->no_calib, "Skip the 2- and 1-bit rows with in-kernel calibration");
  at->add_flag("--back-to-back", t->back_to_back,
               "Time calls in a row (median of 5 runs / --reps) instead of each call alone (events around it)");
  at->add_flag("--host-paced", t->host_paced,
               "Time each call alone on an idle stream (the host's launch latency included) instead of behind a "
               "short spin kernel that holds the stream while the call is enqueued");
  at->add_option("--json", t->json, "Also write the rows as JSON here");
  on_run(c, at, [t] { run_attention(*t); });

  auto gv = std::make_shared<GemvArgs>();
  CLI::App* gm = c->add_subcommand("gemv", "One-token products alone (CUDA): decode-step sizes vs copy bandwidth");
  add_ints(gm, "--rows-per-warp", gv->rows_per_warp, 0, 8, "0 = the kernel's choice, else 1, 2, 4 or 8");
  gm->add_option("--grid", gv->grids,
                 "Blocks of each product: full (a row group a warp) and/or resident (no more blocks than the GPU "
                 "holds at once, each warp taking several groups)")
      ->capture_default_str();
  add_int(gm, "--hidden", gv->hidden, 8, kGemvBenchMax, "Model width: K of q/k/v, o, gate/up and the LM head");
  add_int(gm, "--intermediate", gv->intermediate, 8, kGemvBenchMax, "MLP width: K of the down product");
  add_int(gm, "--vocab", gv->vocab, 1, 1 << 20, "Rows of the LM head");
  add_int(gm, "--qkv-rows", gv->qkv_rows, 0, 1 << 20, "Rows of the q/k/v product (0: 3 x hidden; GQA has fewer)");
  add_int(gm, "--reps", gv->reps, 1, 100000, "Calls per timing (median of 5)");
  add_int(gm, "--device", gv->device, 0, 1024, "CUDA device ordinal");
  gm->add_option("--json", gv->json, "Also write the rows as JSON here");
  on_run(c, gm, [gv] { run_gemv(*gv); });

  auto pf = std::make_shared<PrefillArgs>();
  CLI::App* pr = c->add_subcommand("prefill", "Prefill / vision attention alone (CUDA) at LLaVA-1.5-7B's shapes");
  add_ints(pr, "--key-splits", pf->key_splits, 0, 2, "0 = the kernel's choice, else 1 or 2 warp groups a block");
  add_int(pr, "--vision-tokens", pf->vision_tokens, 1, 1 << 20, "Tokens of the vision tower (16 heads x 64, no mask)");
  add_int(pr, "--text-tokens", pf->text_tokens, 1, 1 << 20, "Prompt tokens of the language model (32 heads x 128, causal)");
  add_int(pr, "--reps", pf->reps, 1, 100000, "Calls per timing (median of 5)");
  add_int(pr, "--device", pf->device, 0, 1024, "CUDA device ordinal");
  pr->add_option("--json", pf->json, "Also write the rows as JSON here");
  on_run(c, pr, [pf] { run_prefill(*pf); });

  auto u = std::make_shared<ThroughputArgs>();
  CLI::App* th = c->add_subcommand("throughput", "CalibQuant Fig. 3 (CUDA): largest batch under a KV budget and tokens/s");
  add_reals(th, "--budgets", u->budgets, 0.001, 1e6, "KV memory budgets in GB");
  add_ints(th, "--bits", u->bits, 1, 16, "16 = fp16, else b-bit channel-wise visual tokens");
  add_int(th, "--visual", u->visual, 1, 1 << 24, "Visual tokens per sequence");
  add_int(th, "--text", u->text, 0, 1 << 24, "Text tokens per sequence (fp16)");
  add_int(th, "--steps", u->steps, 1, 100000, "Decode steps timed per point");
  add_int(th, "--max-batch", u->max_batch, 1, 1 << 20, "Largest batch tried");
  add_int(th, "--device", u->device, 0, 1024, "CUDA device ordinal");
  th->add_option("--json", u->json, "Also write the rows as JSON here");
  on_run(c, th, [u] { run_throughput(*u); });

  auto se = std::make_shared<SessionArgs>();
  CLI::App* ss = c->add_subcommand("session", "The app's loop without a window: each parameter edit of a session timed to its caption and to every plot's data");
  ss->add_option("--session", se->session, "Session JSON (sessions/*.json, or one the app saved)")->required();
  ss->add_option("--edit", se->edits,
                 "An edit METHOD:PARAM=VALUE (METHOD: index from 0 or label), repeatable; default: each method's first "
                 "number parameter moved a tenth of its range");
  ss->add_option("--model", se->model, "Model directory or embedded model's name (default: the session's, else KVLENS_MODEL's, else kvlens-scenes-14m)");
  ss->add_option("--image", se->image, "Image (default: the session's, else the embedded sample image)");
  add_backend_options(ss, se->backend);
  ss->add_option("--json", se->json, "Also write the timings as JSON here");
  add_trace_option(ss, se->trace);
  on_run(c, ss, [se] { run_session(*se); });

  c->callback([a, c] {
    if (c->get_subcommands().empty()) run_bench(*a);
  });
}

}  // namespace kvlens::app
