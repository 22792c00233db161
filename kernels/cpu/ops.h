// CPU reference ops: plain, readable fp32 loops (rows spread over kvlens's team, core/team.h) and OpenBLAS for GEMM.
// Every CUDA op in kernels/cuda has its twin here; the tests compare them.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace kvlens::cpu {

// y[M,N] = x[M,K] · W[N,K]ᵀ (+ bias[N]); W in the PyTorch nn.Linear layout.
void linear(const float* x, int M, int K, const float* W, int N, const float* bias, float* y);
// y[M,D] = LayerNorm(x) · g + b (biased variance, as torch.nn.LayerNorm).
void layer_norm(const float* x, float* y, int M, int D, const float* g, const float* b, float eps);
// y[M,D] = x / sqrt(mean(x²) + eps) · g (Llama RMSNorm).
void rms_norm(const float* x, float* y, int M, int D, const float* g, float eps);
// In place: x = act(x) on n values.
void activate(float* x, int64_t n, Act act);
// In place: x = x ⊙ y on n values.
void mul(float* x, const float* y, int64_t n);
// In place: x += y on n values.
void add(float* x, const float* y, int64_t n);
// Rotary embedding in the "rotate half" layout: x[T][H][D], position pos[t], inverse
// frequencies inv_freq[D / 2] (core/rope.h); or those of a default rope of base theta.
// Sectioned (row_of given): frequency i of token t takes position pos[row_of[i] * row_stride + t]
// (Rope::row_of).
void rope(float* x, int T, int H, int D, const int32_t* pos, const float* inv_freq, const int* row_of = nullptr,
          int64_t row_stride = 0);
void rope(float* x, int T, int H, int D, const int32_t* pos, float theta);
// In place, numerically stable softmax of each of `rows` rows of length n; entries equal to
// -inf get probability 0.
void softmax_rows(float* x, int64_t rows, int n);
// softmax(x[0..n))[i] as softmax_rows computes it (the same bits), without writing the row.
float softmax_at(const float* x, int n, int i);

// Scaled dot-product attention of one query head against its key/value rows.
//   q[Tq][D], k[Tk][D], v[Tk][D] (row strides q_stride, kv_stride), out[Tq][D] (stride o_stride).
//   Key j is visible to query i when key_pos[j] <= query_pos[i] (pass null to see all keys).
//   scores/probs, when not null, receive the [Tq][Tk] pre-softmax scores (masked = -inf) and
//   probabilities.
struct AttnHeadArgs {
  const float* q; int64_t q_stride;
  const float* k; const float* v; int64_t kv_stride;
  float* out; int64_t o_stride;
  int Tq, Tk, D;
  float scale;
  const int32_t* query_pos = nullptr;
  const int32_t* key_pos = nullptr;
  float* scores = nullptr;
  float* probs = nullptr;
};
void attention_head(const AttnHeadArgs& a);
// Queries i0 .. i0 + n − 1 of attention_head (each block's result is the same whichever blocks
// run, in any order or on any thread): two matrix products over the keys the block sees, the
// scores' softmax between.
void attention_rows(const AttnHeadArgs& a, int i0, int n);
// The query block attention_head and the backends' prefill work in.
constexpr int kAttnRows = 64;
// A decode step's scores in another row order, and their softmax, as a device hands them to the
// host (DecodeTaps): `scores` [n_heads][stride] holds each query head's scores over the rows of
// its KV head (h / group) in the device's order, seg_rows[kv] rows of segments then tail_rows
// rows of the tail less the first tail_first[kv] (quantized into segments of their own: not read;
// tail_first null: none). Row i goes to row r = i < seg_rows[kv] ? map[kv · map_stride + i] : i of raw
// [n_heads][stride], every other entry −inf; with probs, probs[h][r] = float(double(exp(s − max))
// / Σ_i double(exp(s_i − max))) with exp and max in float (0 elsewhere; core/exact_attention.h's
// softmax_double_sum). The twin of the CUDA backend's kernel.
void scores_in_order(const float* scores, int n_heads, int group, int64_t stride, const int32_t* seg_rows,
                     int tail_rows, const int32_t* tail_first, const int32_t* map, int64_t map_stride, float* raw,
                     float* probs);

// Multiply-adds a thread must get before a product (or prefill attention) takes another thread.
constexpr int64_t kGemmMacsPerThread = int64_t{1} << 21;
// The threads cpu::linear gives an M × K by N × K product: one a tile of 128 rows by 128 output
// columns and kGemmMacsPerThread multiply-adds (for one row: 2^16, and at most two), at most
// product_threads() (one inside a team job or an OpenMP team).
int linear_threads(int M, int N, int K);
// The threads a loop over `items` items of `work` units in all is worth: one for each `grain`
// units, at most one an item and the caller's OpenMP setting (OMP_NUM_THREADS, `--threads`), one
// inside a team job or an OpenMP team, at least one. (Threads past
// that cost their hand-off and gain nothing: the embedded model captioned in 125 ms on 16
// threads against 95 on 4 while every loop took the whole team.)
int loop_threads(int64_t items, int64_t work, int64_t grain);
// ... for `heads` attention heads of Tq × Tk × D: a thread for each kGemmMacsPerThread
// multiply-adds of the scores, as a product's thread gets. (With 2^17 the 4-layer model's prefill
// attention took all 16 threads of a 16-core host for about 2^19 multiply-adds each; the 14m's
// still takes 16.)
inline int head_threads(int heads, int Tq, int Tk, int D) {
  return loop_threads(heads, static_cast<int64_t>(heads) * Tq * Tk * D, kGemmMacsPerThread);
}

}  // namespace kvlens::cpu
