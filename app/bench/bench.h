// GPU benchmarks behind `kvlens bench attention`, `gemv`, `prefill` and `throughput`: the
// shipped kernels (decode attention over fp16 and packed caches, the decode step's matrix
// products, norms, RoPE and cache appends, prefill attention) timed with CUDA events on
// synthetic caches, weights and activations.
#pragma once
#include <string>
#include <vector>

namespace kvlens::cuda {

// Decode attention alone: one query per head against `context` cached rows, for a batch of
// sequences; bits 16 = fp16 rows, else channel-wise b-bit codes for K and V (CalibQuant's
// layout and post-scaling), `calibrate` adds the two-pass in-kernel calibration.
struct AttnBenchConfig {
  int device = 0;
  int heads = 32, head_dim = 128;
  int kv_heads = 0;         // KV heads (0: as many as query heads); fewer: GQA
  // With GQA and fp16 rows, the kernel that reads a KV head's rows once for all its query heads
  // (decode_gqa.cuh): "auto" where decode_launch takes it, "on" at every fp16 point (the caller
  // checks that the kernel takes the shape, and the device is sm_90), "off" never.
  std::string gqa_kernel = "auto";
  std::vector<int> contexts{4096, 16384, 65536};
  std::vector<int> batches{1, 16};
  std::vector<int> bits{16, 4, 2, 1};
  bool calibrated = true;  // also time the 2- and 1-bit formats among `bits` with in-kernel calibration
  std::vector<int> splits{0};  // splits of each head's rows; 0 = decode_splits' choice
  // Time per call: the median of `reps` calls each timed alone by events around it, or, back to
  // back, of `reps` calls in a row (median of 5 runs ÷ reps; each call reads another copy of the
  // cache). Alone, the stream is first held by a short spin kernel while the events and the call
  // are enqueued behind it, so the time is the device's (launch, kernel, merge) and not paced by
  // the host's enqueueing; host_paced leaves the stream idle instead (the host's launch latency
  // is then timed too).
  bool back_to_back = false;
  bool host_paced = false;
  int reps = 30;
};
struct AttnBenchRow {
  std::string format;  // "fp16", "q4", "q2", "q1", "q2+calib", "q1+calib"
  int bits = 16, batch = 1, context = 0, splits = 0;
  double ms = 0;              // median per call
  double bytes = 0;           // the kernel must read (K, V, ranges, queries) and write (outputs)
  double gbs = 0;             // bytes / time, GB/s
  double share_of_copy = 0;   // gbs / copy bandwidth
  double speedup_vs_fp16 = 0;
  bool gqa_kernel = false;    // the point ran the GQA kernel
};
std::vector<AttnBenchRow> bench_decode_attention(const AttnBenchConfig& c, double copy_gbs);
// An empty one-block kernel launched and timed as bench_decode_attention times a call: the part of
// a call's time that no kernel can avoid on this device and timing (launch, events).
double bench_call_floor_ms(const AttnBenchConfig& c);

// CalibQuant's Fig. 3: a LLaVA-1.5-7B-shaped decoder (random fp16 weights) decoding a batch of
// sequences of `visual` visual tokens (fp16, or channel-wise b-bit) plus `text` fp16 text
// tokens; for each KV memory budget the largest batch that fits, and its tokens per second.
struct ThroughputConfig {
  int device = 0;
  int layers = 32, hidden = 4096, heads = 32, kv_heads = 32, head_dim = 128, intermediate = 11008, vocab = 32064;
  int visual = 3328, text = 40;
  int steps = 16;  // decode steps timed per point (after a warm-up and a captured step)
  std::vector<double> budgets_gb{5, 10, 15, 20, 25, 30};
  std::vector<int> bits{16, 2, 1};
  int max_batch = 1024;
};
struct ThroughputRow {
  std::string format;
  int bits = 16;
  double budget_gb = 0;
  int batch = 0;
  double kv_bytes_per_sequence = 0;
  double step_ms = 0;
  double tokens_per_s = 0;
};
std::vector<ThroughputRow> bench_throughput(const ThroughputConfig& c);

// The decode step's one-token products alone (gemv.cu) at a LLaVA-1.5-7B-shaped decoder's sizes,
// random fp16 weights rotated among copies larger than L2: each shape as the step runs it (q/k/v
// with the RMSNorm folded in, the output projection plain, gate/up with the RMSNorm folded in and
// SiLU(gate)·up written in fp16 from paired rows, the down projection plain on that fp16 vector,
// the LM head with the RMSNorm folded in) for each rows-per-warp choice (0 = the kernel's own;
// the paired gate/up product only its own), launched back to back as in a replayed step; the
// kernel's own choice also without programmatic dependent launch.
struct GemvBenchConfig {
  int device = 0;
  int hidden = 4096, intermediate = 11008, vocab = 32064;
  int qkv_rows = 0;  // rows of the q/k/v product; 0 = 3·hidden (no GQA)
  std::vector<int> rows_per_warp{0, 1, 2, 4, 8};
  std::vector<int> max_blocks{0};  // GemvParams::max_blocks values to time
  int reps = 40;  // calls per timing (median of 5 timings)
};
struct GemvBenchRow {
  std::string name, input;  // "q/k/v", ...; "x" or "rmsnorm(h)"
  int N = 0, K = 0, rows_per_warp = 0, max_blocks = 0;
  bool pdl = true;
  double us = 0;   // per call
  double gbs = 0;  // weight bytes / time
};
std::vector<GemvBenchRow> bench_gemv(const GemvBenchConfig& c);

// Prefill / vision attention alone (attention.cu: K/V staging and the tensor-core kernel, fp16
// output) at LLaVA-1.5-7B's shapes: the vision tower (577 tokens, 16 heads × 64, no mask, 24
// layers) and the language model's prompt (616 tokens, 32 heads × 128, causal, 32 layers), for
// each key split (0 = the kernel's choice). Per call: calls issued back to back ("eager", host
// overhead included where the GPU outruns it) and replayed from a captured graph (device time).
struct PrefillBenchConfig {
  int device = 0;
  int vision_tokens = 577, vision_heads = 16, vision_dim = 64, vision_layers = 24;
  int text_tokens = 616, text_heads = 32, text_kv_heads = 32, text_dim = 128, text_layers = 32;
  std::vector<int> key_splits{0, 1, 2};
  int reps = 50;  // calls per timing (median of 5)
};
struct PrefillBenchRow {
  std::string part;  // "vision", "text"
  int tokens = 0, heads = 0, kv_heads = 0, head_dim = 0, layers = 0;
  bool causal = false;
  int key_split = 0;       // asked for (0 = the kernel's choice)
  int key_split_used = 0;  // what ran
  double eager_us = 0, graph_us = 0;  // per call
  double tflops = 0;                  // useful flops (QKᵀ and PV, unmasked pairs) / graph time
};
std::vector<PrefillBenchRow> bench_prefill_attention(const PrefillBenchConfig& c);

}  // namespace kvlens::cuda
