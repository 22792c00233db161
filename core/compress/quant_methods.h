// The quantization methods, one file each (core/compress/<name>.cpp), plus the formulas of
// each that tests and diagnostics reuse.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <random>
#include <utility>
#include <vector>

#include "core/compress/method.h"
#include "core/compress/quantize.h"
#include "core/compress/policy.h"

namespace kvlens {

MethodSpec full_method();           // reference: rows as the cache stores them (fp16 / fp32)
MethodSpec uniform_method();        // uniform b-bit, global / per-token / per-channel ranges
MethodSpec kivi_method();           // KIVI: K per-channel in token groups, V per-token, dense window
MethodSpec calibquant_method();     // CalibQuant: channel-wise visual K/V + score calibration
MethodSpec zipcache_method();       // ZipCache: saliency-driven mixed precision
MethodSpec turboquant_method();     // TurboQuant: randomized Hadamard + Lloyd-Max (+ QJL)
MethodSpec hadamard_int4_method();  // block-diagonal Hadamard keys, per-token INT4

// ---- CalibQuant (core/compress/methods/calibquant.cpp) ----
namespace calibquant {
// Eq. 7: g(x) = (δ − γ + τ1 − τ2)/(δ − γ)·(x − γ) + γ − τ1, mapping [γ, δ] onto [γ − τ1, δ − τ2].
// When δ = γ every x maps to γ − τ1 (the lower end of the target range).
float calibrate(float x, float gamma, float delta, float tau1, float tau2);
// Applies g to the scores of one query over the keys whose kind is Visual; γ, δ are the min and
// max of those scores. Other keys are left untouched.
void calibrate_visual(float* scores, const SegmentKind* kinds, int n, float tau1, float tau2);
// Post-scaling (Eq. 6) on channel-wise codes: n rows of d codes packed as one row-major stream,
// with fp16 per-channel scale[d] = (β − α)/(2^b − 1) and zero alpha[d]:
//   out[j] = (q ⊙ scale)·k_dis_j + q·α
void post_scaled_scores(const float* q, int d, const uint8_t* codes, int n, int bits,
                        const uint16_t* scale, const uint16_t* alpha, float* out);
// The same for values: out[c] = scale_c · Σ_j w_j v_dis_jc + α_c · Σ_j w_j, out[d].
void post_scaled_values(const float* w, int n, const uint8_t* codes, int d, int bits,
                        const uint16_t* scale, const uint16_t* alpha, float* out);
}  // namespace calibquant

// ---- ZipCache (core/compress/methods/zipcache.cpp) ----
namespace zipcache {
enum class Saliency { Normalized, Accumulated };
enum class Probe { All, Random, Special, Recent, RandomRecent };
// Saliency of the T tokens from the attention rows of the probe queries of one head:
// A[T][T] row-major causal probabilities, probes = query indices.
//   accumulated: p_i = Σ_{k ∈ probes} A_{k,i}                      (Eq. 7 over probes, H2O/MiKV)
//   normalized:  p̃_i = Σ_{k ∈ probes} A_{k,i} / nnz_i              (Eq. 8)
// nnz_i = number of probes k ≥ i (those the causal mask lets see token i); a token no probe
// sees gets 0.
std::vector<double> saliency(const float* A, int T, const std::vector<int>& probes, Saliency s);
// The same from the column sums over the probe rows, sums[i] = Σ_{k ∈ probes, k ≥ i} A[k][i]
// (AttentionReduction::column_sums of one head).
std::vector<double> saliency_from_sums(const double* sums, int T, const std::vector<int>& probes, Saliency s);
// Probe query indices (ascending, unique) among T prompt tokens. recent: the last
// max(1, round(recent_ratio·T)); random: max(1, round(random_ratio·T)) drawn without
// replacement (seeded) from all tokens, or from the non-recent ones for random+recent;
// special: the first token, tokens with id 0/1/2 (unk/BOS/EOS), the tokens just before and
// just after each run of visual tokens, and the last token (kvlens sees no token pieces, so
// punctuation cannot be recognised); all: every token.
std::vector<int> select_probes(Probe strategy, int T, const std::vector<SegmentKind>* kinds,
                               const std::vector<int>* ids, double recent_ratio,
                               double random_ratio, uint64_t seed);
// The salient flags of n rows (Algorithm 2's Split): the top round(ratio·n) scores, ties to the
// earlier row.
std::vector<char> top_flags(const std::vector<double>& score, double ratio);
// A streamed gap's salient flags [KV head][row] from its rows' saliency sal[KV head · gap + row]:
// each KV head's top_flags, or (`shared`) every head the top_flags of the heads' sum. The host's
// streaming ranks so; the device's twin is zip_rank_gap (StepZip::ratio, shared_ranking).
std::vector<std::vector<char>> rank_gap(const double* sal, int n_kv_heads, int gap, double ratio, bool shared);
// Algorithm 3's probes among one layer's decode tokens: a token is a probe when it is among the
// last round(recent·gap) of its gap, or with probability `random` — one draw a token from
// mt19937_64 seeded by `seed` and the layer, so that a device's schedule, made ahead, is the
// host's.
class ProbeStream {
 public:
  ProbeStream(uint64_t seed, int layer, int gap, double recent, double random);
  // Whether the next token, at `index` within its gap, is a probe.
  bool next(int index);

 private:
  std::mt19937_64 rng_;
  int gap_, n_recent_;
  double random_;
};
// The saliency of a streamed gap's rows (Algorithm 3) from its probes' raw scaled scores: for
// probe k < n_probes and head h < heads, scores + k·probe_stride + h·stride holds its scores over
// the rows older than the gap (`before` of them) then the gap's rows in order, of which it saw
// the first seen[k]. Each (probe, head)'s softmax over the rows it saw (exp and sums in double),
// summed for each gap row j < gap over the pairs that saw it (heads outer, probes inner); then
// accumulated (p_j, Eq. 7) or divided by the number of those pairs (p̃_j, Eq. 8; 0 where none).
// The host's streaming reduces so; the device's (zip_gap_saliency) too, its softmax sums (fp32)
// those each probe's decode step computed over the same rows.
std::vector<double> gap_saliency(const float* scores, int64_t probe_stride, int64_t stride, int n_probes, int heads,
                                 int before, const int* seen, int gap, Saliency s);
// The channel factors of CSTQuant (Eq. 6): c_i = sqrt(max_t |x_ti|) over the n rows of x[n][d],
// rounded to fp16; 1 where a channel is all zero (or not finite).
std::vector<float> channel_factors(const float* x, int n, int d);
// Channel-separable token-wise quantization (Algorithm 1) of x[n][d] in place: x/c quantized
// per token with b bits, multiplied back by c. c = channel_factors(x) unless `factors` (d
// values, already fp16) are given. Appends row-aligned codes and per-token fp16 scale/zero to
// `out`, and the d factors c (meta) when it computed them.
void cst_quantize(float* x, int n, int d, int bits, quant::QuantBlock& out, const float* factors = nullptr);

// One quantization group (quant::CodeLayout::ZipMixed): consecutive dense segments of a layer
// (`group`, their indices) sharing one payload. flags[segment][KV head][row] = salient.
using Flags = std::vector<std::vector<std::vector<char>>>;
struct GroupSpec {
  int hi = 4, lo = 2;              // k_h, k_l
  bool head_token_ranges = false;  // value_token_range=head (else one range per subset and position)
  bool layer_factors = false;      // channel_scales=layer (else per subset)
};
// The group's salient flags into p.k[h].flags (1 bit a row, the group's rows of head h in
// order), each row's bits (hi / lo) into HeadRows::bits, and the layout's choices into p.layout.
void mark_group(LayerKV& layer, const std::vector<size_t>& group, const Flags& flags, const GroupSpec& spec,
                quant::QuantPayload& p);
// Quantizes the group's host rows (Algorithm 2): keys ChannelQuant per KV head and subset,
// values CSTQuant; the rows become their dequantization, and the codes, ranges and factors are
// appended to p as CodeLayout::ZipMixed lays them out. (The device's twin:
// Backend::zip_quantize_rows.)
void quantize_group(LayerKV& layer, const std::vector<size_t>& group, const Flags& flags, int head_dim,
                    const GroupSpec& spec, quant::QuantPayload& p);
// Installs p on the group's segments: storage label, the payload shared, its bytes counted on
// the first segment, every segment's int32 positions.
void install_group(LayerKV& layer, const std::vector<size_t>& group, const GroupSpec& spec,
                   const std::shared_ptr<quant::QuantPayload>& p);
}  // namespace zipcache

// ---- TurboQuant (core/compress/methods/turboquant.cpp) ----
namespace turboquant {
// One codec for rows of length d (quant::RowCodec, the format): a randomized Hadamard rotation
// y = H·D·pad(x) (D: seeded ±1 signs, H orthonormal of size dp = next power of two ≥ d), a
// Lloyd-Max codebook of the rotated coordinate scaled to N(0, 1) (y_j·√dp/‖x‖), and for keys
// with QJL a seeded Gaussian S[d][d] for the 1-bit residual sketch.
struct Codec : quant::RowCodec {
  void rotate(const float* x, float* y) const;    // y[dp] = H·D·pad(x)
  void unrotate(const float* y, float* x) const;  // x[d] = first d of D·H·y
  // Quantizes one row: appends its row-aligned codes (and sign bits) and fp16 norm (and ‖r‖)
  // to `out`; writes the dequantized row to xhat[d]. The double sums are fused multiply-adds in
  // index order, so a device that does the same operations gets the same codes and rows.
  void encode_row(const float* x, quant::QuantBlock& out, float* xhat) const;
};
Codec make_codec(int d, int mse_bits, bool qjl, uint64_t seed);
}  // namespace turboquant

}  // namespace kvlens
