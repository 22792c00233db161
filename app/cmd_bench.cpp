// kvlens bench: caption latency on this machine (vision, prefill, per-token decode), median of
// repeated runs, with the full cache or under a method.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>

#include "app/commands.h"
#include "app/defaults.h"
#include "app/options.h"
#include "core/session.h"
#include "core/errors.h"
#include "core/method.h"
#include "models/llava.h"

namespace kvlens::app {

namespace {

struct BenchArgs {
  std::string model, image, method;
  int repeat = 5, max_new_tokens = 32, threads = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void run_bench(const BenchArgs& a) {
  if (a.threads > 0) {
    omp_set_num_threads(a.threads);
    openblas_set_num_threads(a.threads);
  }
  if (!a.method.empty()) parse_method_spec(a.method);
  const LlavaModel model = LlavaModel::load(a.model.empty() ? default_model_dir() : a.model);
  const RGBImage img = load_image(a.image.empty() ? default_image() : a.image);
  std::vector<double> vision, prefill, compress, per_token, total;
  int tokens = 0;
  long long bytes = 0;
  for (int i = 0; i < a.repeat + 1; ++i) {  // the first run warms caches and thread pools
    std::unique_ptr<KVPolicy> policy = a.method.empty() ? nullptr : make_policy(a.method);
    const bool keep = policy && policy->needs_prefill_attention();
    const PrefillState st = model.prefill(img, kDefaultPrompt, kDefaultTemplate, keep);
    GenerateOptions g;
    g.max_new_tokens = a.max_new_tokens;
    const DecodeResult r = model.decode(st, policy.get(), g);
    if (i == 0) continue;
    const int steps = std::max(1, static_cast<int>(r.generated_ids.size()) - 1);
    vision.push_back(st.vision_ms);
    prefill.push_back(st.prefill_ms);
    compress.push_back(r.compress_ms);
    per_token.push_back(r.decode_ms / steps);
    total.push_back(st.vision_ms + st.prefill_ms + r.compress_ms + r.decode_ms);
    tokens = static_cast<int>(r.generated_ids.size());
    bytes = r.bytes_after_prefill.total();
  }
  std::printf("model %s\nthreads %d, %d runs, %d tokens, KV bytes after prefill %lld\n", model.dir().c_str(),
              omp_get_max_threads(), a.repeat, tokens, bytes);
  std::printf("%-22s %10s\n", "stage (median)", "ms");
  std::printf("%-22s %10.2f\n", "vision", median(vision));
  std::printf("%-22s %10.2f\n", "prefill", median(prefill));
  std::printf("%-22s %10.2f\n", "compress", median(compress));
  std::printf("%-22s %10.3f\n", "decode per token", median(per_token));
  std::printf("%-22s %10.2f\n", "caption total", median(total));
}

}  // namespace

void add_bench_command(CLI::App& root) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* c = root.add_subcommand("bench", "Caption latency: vision, prefill, per-token decode (median of runs)");
  c->add_option("--model", a->model, "Model directory (default: the embedded model)");
  c->add_option("--image", a->image, "Image (default: the embedded sample image)");
  c->add_option("--method", a->method, "Compression method spec (default: full cache)");
  add_int(c, "--repeat", a->repeat, 1, 10000, "Timed runs after one warm-up");
  add_int(c, "--max-new-tokens", a->max_new_tokens, 1, kMaxNewTokensLimit, "Most tokens per caption");
  add_int(c, "--threads", a->threads, 0, 256, "CPU threads for kvlens loops and OpenBLAS (0 = OMP_NUM_THREADS, else 1, and OpenBLAS's default)");
  c->callback([a] { run_bench(*a); });
}

}  // namespace kvlens::app
