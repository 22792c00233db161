// Host-callable launchers of the CUDA kernels, one plain parameter list (or Params struct) per
// kernel. Each launches on the given stream and throws DeviceError when the launch fails. Every
// kernel has its CPU twin in kernels/cpu (or core/policies for the packed formats) and a case
// in tests/kernels/test_ops.cpp.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/backend.h"
#include "kernels/cpu/ops.h"

namespace kvlens::cuda {

// ---- elementwise (elementwise.cu) --------------------------------------------------------------
void rms_norm(const float* x, void* y, Dt ydt, int M, int D, const float* g, float eps, cudaStream_t s);
void layer_norm(const float* x, void* y, Dt ydt, int M, int D, const float* g, const float* b, float eps,
                cudaStream_t s);
void add(float* x, const float* y, int64_t n, cudaStream_t s);
// out[m][n] = act(y[m][n] + bias[n]) (act < 0: none), out of dtype odt.
void bias_act(const float* y, const float* bias, int64_t M, int64_t N, int act, void* out, Dt odt, cudaStream_t s);
// y[m][n] = bias[n] (+ y[m][n] when accumulate).
void add_bias_rows(float* y, const float* bias, int64_t M, int64_t N, bool accumulate, cudaStream_t s);
void gated_act(const float* gu, int64_t M, int64_t I, int act, void* out, Dt odt, cudaStream_t s);
// RoPE ("rotate half") in place on nq heads at column q_col and nk heads at k_col of each of
// the T rows of x (row stride `stride`); inv_freq[D/2] as the CPU computes it. row_of (null:
// every frequency reads pos[t]): frequency i of token t reads pos[row_of[i] · T + t] (sections).
void rope(float* x, int T, int64_t stride, int64_t q_col, int nq, int64_t k_col, int nk, int D,
          const int32_t* pos, const float* inv_freq, const int32_t* row_of, cudaStream_t s);
void embed(const void* table, Dt tdt, int64_t V, int64_t H, const int32_t* ids, int T, float* out,
           cudaStream_t s);
// ids[0] = the first index of the largest of logits[0..n) (NaN never larger; a NaN first value
// kept), pos[0] += 1: the next greedy decode step's input. CPU twin: std::max_element.
void next_token(const float* logits, int n, int32_t* ids, int32_t* pos, cudaStream_t s);
void softmax_rows(float* x, int64_t rows, int n, cudaStream_t s);
// softmax_rows of P [n_heads][na][n] (the same values), then below[h] += the entries j ≤ i of each
// of head h's rows below p · (their maximum over j ≤ i), or equal to 0 with zeros_below, row a
// being query row i = queries[a] (device; null: q0 + a): attention_reduce's counts of a pass, from
// the probabilities in hand.
void softmax_below_rows(float* P, int n_heads, int na, int n, const int* queries, int q0, double p, bool zeros_below,
                        unsigned long long* below, cudaStream_t s);
// slot = min over non-finite x[i] of (i << 32 | bits of x[i]) (atomicMin; UINT64_MAX = all finite).
void first_nonfinite(const float* x, int64_t n, unsigned long long* slot, cudaStream_t s);

// ---- matrix-vector product for one token (gemv.cu) ---------------------------------------------
// y[N] = W[N][K]·x[K] (+ bias) (+ y when accumulate); W f16 or bf16 [N][K], K a multiple of 8 up
// to kGemvMaxK, 16-byte aligned pointers. The input x[K] is, by which pointer is set (one of
// the two):
//   x:     the vector itself (the weights' dtype);
//   h, g:  RMSNorm(h)·g computed inside (h, g fp32 [K]), rounded to the weights' dtype as
//          rms_norm stores it (the decode step's norm and projection in one kernel).
// Paired (h, g and out set; no y, bias or accumulate): W holds 2N rows, the N gate rows then
// the N up rows, and out[n] = act(gate_n)·up_n in the weights' dtype, computed from the two fp32
// sums and rounded as gated_act does (the MLP's gate applied in the gate/up product's epilogue).
// Inconsistent parameters throw InternalError.
constexpr int kGemvMaxK = 32768;  // x is staged in shared memory: 64 KiB at most
constexpr int kGemvResident = -1;
struct GemvParams {
  const void* W = nullptr;
  Dt dt = Dt::F16;
  int N = 0, K = 0;  // paired: N outputs, W holds 2N rows (gate rows, then up rows)
  const void* x = nullptr;
  const float* h = nullptr;
  const float* g = nullptr;
  float eps = 0.0f;
  int act = 0;  // paired: static_cast<int>(Act)
  const float* bias = nullptr;
  float* y = nullptr;
  // Paired: act(gate)·up, N values in the weights' dtype (instead of y).
  void* out = nullptr;
  bool accumulate = false;
  int rows_per_warp = 0;  // 1, 2, 4 or 8; 0 = the kernel's choice for K (paired: always 2)
  // Blocks: kGemvResident = no more than the GPU holds at once; 0 = one row group a warp
  // (blocks past the first wave start as slots free up); n > 0 = at most n. With fewer blocks
  // than groups, each warp takes groups warp, warp + all warps, ..., its loads running on from
  // one group into the next.
  int max_blocks = kGemvResident;
  bool pdl = true;        // programmatic dependent launch (off also with KVLENS_CUDA_PDL=0)
  // Norm input only: the first block records h's first non-finite value here, as
  // first_nonfinite does (the finiteness check of h folded into the product).
  unsigned long long* check = nullptr;
};
bool gemv_supported(Dt dt, int K);
void gemv(const GemvParams& p, cudaStream_t s);

// ---- prefill attention (attention.cu) ---------------------------------------------------------
// out[T][n_heads·D] (dtype odt) from q/k/v in qkv (fp32); tiled with an online softmax.
// key_split: warp groups a block that share each key stage on the tensor-core path (1 or 2;
// 0: chosen from the problem and the device's SM count). Returns the split used (0: the simple
// kernel ran).
int attention_prefill(const float* qkv, const AttnLayout& l, void* out, Dt odt, cudaStream_t s, int key_split = 0);
// The same through the simple kernel (one warp per query row), any D ≤ 256.
void attention_prefill_simple(const float* qkv, const AttnLayout& l, void* out, Dt odt, cudaStream_t s);
// scores[h][i][j] = scale·q_i·k_j (masked = -inf), fp32 from qkv.
void attention_scores(const float* qkv, const AttnLayout& l, float* scores, cudaStream_t s);
// The same for the query rows rows[0..n) (device; null: the rows row0 .. row0 + n − 1) alone,
// written to scores [n_heads][n][T] (row r of a head is query row rows[r]). Each score's dot
// product is summed in ascending channel order.
void attention_scores_rows(const float* qkv, const AttnLayout& l, const int* rows, int row0, int n, float* scores,
                           cudaStream_t s);
// Reductions of causal probabilities over a pass of query rows, P holding those rows alone:
// P [n_heads][nq][T], row a of a head being query row queries[a] (device, ascending; null: the
// rows q0 .. q0 + nq − 1). out [n_heads][T] = Σ_{i ≥ j} P[h][i][j] in double, in ascending i, from
// 0.0 or (go_on) from out's values (a later pass of rows; P's masked entries being 0, it needs no
// row list); sums [rows][cols] += the pooled heatmap's block sums (AttentionReduction::map) of the
// row bins [first_bin, first_bin + n_bins) that hold these rows (attention_reduce.cu; host
// reference: reduce_attention). The counts below a share of the row's maximum come with the
// softmax (softmax_below_rows).
void attention_column_sums(const float* P, int n_heads, int T, int nq, bool go_on, double* out, cudaStream_t s);
void attention_map_sums(const float* P, int n_heads, int T, const int* queries, int q0, int nq, int rows, int cols,
                        int keys, int first_bin, int n_bins, double* sums, cudaStream_t s);
// The exact attention of decode queries (exact_attention.cu; host reference: exact_attention in
// core/exact_attention.h), one block a query head: query head h of q [n_heads][head_dim] over the
// prompt's rows (prompt [T][stride], keys at k_col, values at v_col, KV head g at + g·head_dim)
// and then the n_extra rows xk / xv [n_kv_heads][n_extra][head_dim] of its KV head (xpos < 0:
// padding); scores / probs [n_heads][T + n_extra] (padding -inf / 0), out [n_heads][head_dim] in
// double.
struct ExactArgs {
  const float* prompt;  // [T][stride]
  int64_t stride;
  int64_t k_col, v_col;
  int T;
  const float* q;        // [NH][D]
  const float *xk, *xv;  // [NKV][n_extra][D]
  const int* xpos;       // [NKV][n_extra]
  int n_extra, NH, NKV, D;
  float scale;
  float *scores, *probs;  // [NH][T + n_extra]
  double* out;            // [NH][D]
};
// n queries in one launch (a step's layers): args [n] in device memory, each with n_heads query
// heads of head_dim.
void exact_attention_many(const ExactArgs* args, int n, int n_heads, int head_dim, cudaStream_t s);
// A decode step's scores to the host store's row order and their softmax, as cpu::scores_in_order
// (kernels/cpu/ops.h, the host reference) computes them; one block a query head
// (exact_attention.cu). seg_rows, tail_first (or null) and map are device arrays; probs may be null.
void scores_in_order(const float* scores, int n_heads, int group, int64_t stride, const int32_t* seg_rows, int tail_rows,
                     const int32_t* tail_first, const int32_t* map, int64_t map_stride, float* raw, float* probs,
                     cudaStream_t s);
// LOOK-M's assignment (cosine_assign.cu; host reference: lookm_assign) of many KV heads at
// once. Problem p: its rows rows[row0 .. row0 + n) (device pointers to d values each), its kept
// rows keep[kept0 .. kept0 + K) and evicted rows evicted[ev0 .. ev0 + E) (ascending indices into
// its rows), and its first block tile0 (blocks of cosine_assign_tiles(E) each, problems in
// order). norm[i] = the norm of row i; for evicted row ev0 + i, best = the kept row (an index
// into the problem's rows) of largest cosine similarity sim, in double, ties to the earlier kept
// row. K ≥ 1 for every problem, max_kept the largest K (a problem's kept rows are staged in
// shared memory when they fit).
struct AssignProblem {
  int64_t row0 = 0, kept0 = 0, ev0 = 0, tile0 = 0;
  int n = 0, K = 0, E = 0, pad = 0;
};
int64_t cosine_assign_tiles(int n_evicted);
void cosine_assign(const float* const* rows, int64_t n_rows, int d, const AssignProblem* problems, int n_problems,
                   int64_t n_tiles, int max_kept, const int* keep, const int* evicted, double* norm, int* best,
                   double* sim, cudaStream_t s);
void cosine_assign(const __half* const* rows, int64_t n_rows, int d, const AssignProblem* problems, int n_problems,
                   int64_t n_tiles, int max_kept, const int* keep, const int* evicted, double* norm, int* best,
                   double* sim, cudaStream_t s);
// LOOK-M where the cache is (row_merge.cu), over cosine_assign's problems (a layer's KV head
// each, rows by pointer, fp16), every step on the device:
// - segment_rows: row pointers from runs of contiguous rows: run i is rows [first, first + n)
//   of the flat list, at k + r·d and v + r·d (runs ascending by first, covering n_rows);
// - evicted_rows: evicted[ev0 .. ev0 + E) = the ascending rows of each problem that its kept
//   list does not name (E = n − K);
// - merge_sources (the authors' similarity filter; without it every evicted row contributes
//   itself, and merge_kept takes no sources): src[ev0 + j] = the row that evicted row j's
//   contribution folds in, or −1 for none. Groups of `group` consecutive problems (a layer's KV
//   heads) pass only the indices j whose similarity, averaged over the group's problems that have
//   a j-th evicted row, is ≥ the mean over all of the group's evicted rows (lookm_above_mean, the same double operations in its order); with
//   `prefix`, the f-th passing index takes the f-th evicted row as its source (the authors'
//   average-merge scatter; lookm_contributions). `scratch`: one int an evicted row.
// - merge_kept: every kept row (n_kept = the problems' K summed, kept0 ascending) folds in the
//   evicted rows j assigned to it (best[ev0 + j], a row index) with a source (src, or evicted
//   where src is null), in ascending j, as merge_rows does in double (kind: 1 average,
//   2 pivotal, 3 weighted by sim), rounded to float and then to fp16 into ok / ov [n_kept][d];
//   count[g] = its contributions (a row without any is copied as it is). `scratch`: n_kept +
//   n_evicted ints (each kept row's list of contributions).
struct RowSegment {
  const __half* k = nullptr;
  const __half* v = nullptr;
  int64_t first = 0, n = 0;
};
void segment_rows(const RowSegment* runs, int n_runs, int64_t n_rows, int d, const __half** k, const __half** v,
                  cudaStream_t s);
void evicted_rows(const AssignProblem* problems, int n_problems, const int* keep, int* evicted, cudaStream_t s);
void merge_sources(const AssignProblem* problems, int n_problems, int group, const int* evicted, const double* sim,
                   bool prefix, int* scratch, int* src, cudaStream_t s);
void merge_kept(const __half* const* k, const __half* const* v, const AssignProblem* problems, int n_problems,
                int64_t n_kept, int64_t n_evicted, const int* keep, const int* evicted, const int* src, const int* best,
                const double* sim, int d, int kind, __half* ok, __half* ov, int* count, int* scratch, cudaStream_t s);

// A decode tail of rows quantized per token (the cache's packed decode rows): codes k / v
// [NKV][cap][D·bits/8], ranges [4][NKV][cap] halves (K scales, K zeros, V scales, V zeros),
// positions pos [NKV][cap].
constexpr int kMaxQuantTailD = 256;
// Whether rope_quant_append takes head size D and Hadamard block `rotation` (0: none; else a
// power of two from 2 dividing D).
inline bool quant_tail_ok(int D, int rotation) {
  const bool rot = rotation == 0 || (rotation >= 2 && (rotation & (rotation - 1)) == 0 && D % rotation == 0);
  return D % 8 == 0 && D > 0 && D <= kMaxQuantTailD && rot;
}
struct QuantTail {
  uint8_t* k = nullptr;
  uint8_t* v = nullptr;
  __half* ranges = nullptr;
  int32_t* pos = nullptr;
  int cap = 0, k_bits = 0, v_bits = 0;
  int rotation = 0;  // > 0: the key rows (after fp16 rounding) and the query rotated by Hadamard blocks of this size
};

// Queries a decode keeps (ZipCache's probes, StepQuant::zip): the step appending row r writes its
// rotated query heads to q + slot[r]·nq·D when r < rows and slot[r] >= 0, and its decode
// attention each head's softmax state over every row it read — (max, sum of exp(score − max)),
// scores scaled, as md_out holds them — to md + (slot[r]·nq + head)·2. Row r is the fused token's
// (DecodeParams::fresh_k) or, where the row was appended before the attention, *counter − 1.
struct KeptQueries {
  float* q = nullptr;
  const int32_t* slot = nullptr;
  int rows = 0;
  float* md = nullptr;
  const int32_t* counter = nullptr;
};

// ---- decode attention over a segmented, possibly packed cache (decode_attention.cu) ----------
// Storage of one side (K or V) of a part. Codes: row j starts at byte j·D·bits/8 and code c of a
// row occupies bits [c·bits, (c+1)·bits) of the row, least significant bit first (the layout
// core/compress/quantize.h packs). F16 rows are [n][D] halves.
enum KvFormat : int32_t {
  kF16 = 0,       // fp16 rows
  kChannel = 1,   // codes with fp16 scale/zero per (range group, channel) — or per group when
                  // chan_stride = 0 (one range for the whole group)
  kToken = 2,     // codes with fp16 scale/zero per row; optional fp16 per-channel factor (CST)
  kChannelT = 3,  // values only, 1-bit, ranges as kChannel over the whole part: rows in groups of
                  // 32 stored channel-major — group b's D words, word c holding channel c's codes
                  // of rows 32b + block_row(i) at bit i, block_row(4g + t) = 16(t >> 1) + 8(t & 1) + g
                  // — and the rows past the last whole group as kChannel stores them (the layout
                  // quant::channel_major_1bit builds; the same bytes)
};
struct KvSide {
  int32_t fmt = kF16;
  int32_t bits = 16;
  int32_t group = 0;        // kChannel: rows per range group; kToken with factors: rows per factor
                            // group (0 or >= n: the whole part)
  int32_t chan_stride = 1;  // kChannel: 1 = a range per channel, 0 = one per group
  const void* data = nullptr;
  const __half* scale = nullptr;
  const __half* zero = nullptr;
  const __half* factor = nullptr;  // kToken: x = factor_c·(code·scale_j + zero_j), D factors a group
};
// A run of rows of one KV head in one storage.
struct PartDesc {
  int32_t n = 0;                    // rows (plus *counter when counter is set)
  int32_t visual = 0;               // 1: keys of visual tokens (calibration applies)
  const int32_t* counter = nullptr;  // rows appended during decode
  KvSide k, v;
};
struct DecodeParams {
  int B = 1, NH = 0, NKV = 0, D = 0;
  float scale = 1;
  const float* q = nullptr;   // q[b][h][D] at q + b·q_stride + h·D
  int64_t q_stride = 0;
  const PartDesc* parts = nullptr;  // [B][NKV][max_parts]
  const int32_t* n_parts = nullptr; // [B][NKV]
  int max_parts = 0;
  int splits = 1;
  float* part_o = nullptr;    // scratch [B][NH][splits][D]
  float* part_md = nullptr;   // scratch [B][NH][splits][2]
  void* out = nullptr;        // out[b][h][D] at out + b·out_stride + h·D
  Dt odt = Dt::F32;
  int64_t out_stride = 0;
  // CalibQuant calibration of visual scores (τ1, τ2), with range scratch [B][NH][splits][2].
  int calibrate = 0;
  float tau1 = 0, tau2 = 0;
  float* vis_range = nullptr;
  // With calibration, for visual parts of 1- and 2-bit codes at head size 128 (decode_b1.cuh,
  // decode_i8.cuh): the range pass writes each row's raw score here and the attention pass reads
  // it instead of the keys' codes — [B][NH][vis_stride] floats, a row at its index among its
  // head's rows; a part is served only where its last index + kDecodeScorePad is within
  // vis_stride (elsewhere, or when null, both passes read the keys).
  float* vis_scores = nullptr;
  int64_t vis_stride = 0;
  // Materialized scores: read scores_in[b][h][row] instead of q·k (already transformed), or
  // write raw scores to scores_out; final (max, sum) per (b, h) to md_out.
  const float* scores_in = nullptr;
  float* scores_out = nullptr;
  int64_t scores_stride = 0;  // per (b, h)
  float* md_out = nullptr;
  // When set ([B][NH] ints, zero, reset after use): the last block of each head merges the
  // splits itself, so no second kernel is launched.
  int* sem = nullptr;
  // ([B][NH] ints, zero, reset after use; with sem and more than one split) the bulk-copy fp16
  // kernel's blocks take their stages' rows from their head's counter, so that a block on a
  // multiprocessor that streams faster reads more of the head (decode_bulk.cuh).
  int* claim = nullptr;
  // Largest code width (1, 2 or 4) of channel-wise packed parts whose keys use a lookup table;
  // the launch gives each block decode_lut_bytes(D, lut_bits) of shared memory for it (none at
  // head size 128, where such parts run on tensor cores and others take the general path).
  int lut_bits = 0;
  // 1: every part of every head holds fp16 keys and values (the fp16 kernel may be used).
  int all_f16 = 0;
  // The step's token fused in (fp16 kernel only, B = 1; fresh_k set): q is rotated in the kernel
  // (RoPE at *fresh_pos with inv_freq[D/2]), the token's K row (fp32 at fresh_k + kv head·D,
  // rotated) and V row (fresh_v) join each head's rows as its last row, rounded to fp16 as the
  // cache stores them, and are written to the tail ([NKV][tail_cap][D], positions
  // [NKV][tail_cap]) at row *tail_counter, which the last block to read it advances
  // (tail_done: blocks done reading, zero, reset after use).
  const float* fresh_k = nullptr;
  const float* fresh_v = nullptr;
  const int32_t* fresh_pos = nullptr;
  const float* inv_freq = nullptr;
  __half* tail_k = nullptr;
  __half* tail_v = nullptr;
  int32_t* tail_pos = nullptr;
  int tail_cap = 0;
  int32_t* tail_counter = nullptr;
  int32_t* tail_done = nullptr;
  // 1: the kernel this launch follows on the stream writes none of the cache's rows, row
  // counters or part table (true of the fused token's launch, which follows the q/k/v product,
  // and of attention called in a row); the fp16 kernel then reads them, and loads its first rows,
  // before waiting on that kernel. Else (a launch after kv_append, say) it waits first.
  // 2: the same but for each head's last row (the tail's newest), which that kernel rewrites (a
  // coded tail's row, codec_tail_rows after rope_append): the fp16 kernel reads it after the wait.
  int rows_ready = 0;
  // Code width (2, 4 or 8) when every part of every head holds token-wise codes of that width on
  // both sides (a range per row, no CST factors): the token-wise kernel (decode_qtok.cuh) serves
  // an attention pass without calibration or materialized scores. With the step's token fused
  // in, qtail is the packed tail the token is quantized into (rope_quant_append's arithmetic:
  // RoPE, fp16 rounding, the keys' Hadamard blocks, a range per row), the query rotated by the
  // same blocks in the kernel; tail_pos, tail_cap, tail_counter and tail_done as for fp16 rows.
  int tok_bits = 0;
  QuantTail qtail;
  // Code width (2 or 4) when every part of every head holds fp16 rows or codes of that width
  // with keys a range per channel and group of rows and values a range per row, with or without
  // CST factors (KIVI's, ZipCache's), or kDecodeMixWidths where such parts are of several widths
  // among 1, 2 and 4 (ZipCache's salient and regular subsets): the mixed kernel
  // (decode_qtok.cuh) serves such an attention pass; a fused token is appended as fp16 rows
  // (tail_k, tail_v), and its rotated query heads go to `keep` where it asks for the row.
  int mix_bits = 0;
  KeptQueries keep;
  // 1: every part of every head is fp16 or a packed part of the tensor-core paths (mma_part); at
  // head size 128 a kernel with only those paths is used — with 168 registers instead of 128
  // when b1 is set too.
  int all_mma = 0;
  // 1: some part's values are kChannelT; the launch gives each block shared memory to stage
  // them for the binary tensor-core path (without it such parts take the general path).
  int b1 = 0;
  // 1 (with all_mma and b1): the binary path's kernel of two 128-row sub-tiles a warp and two
  // blocks a multiprocessor (decode_b1_pair says when).
  int b1_pair = 0;
  // 1 (all_f16, head size 128, sm_90): the fp16 kernel whose rows go to shared-memory stages by
  // bulk copies (decode_f16_bulk says when).
  int f16_bulk = 0;
  // 1 (f16_bulk, with claim): stages of kDecodeBulkFineChunkRows rows (decode_launch says when).
  int bulk_fine = 0;
  // 1 (all_f16, NH / NKV in [2, kDecodeGqaMaxRatio], head size 32, 64 or 128): the fp16 kernel
  // whose blocks read a KV head's rows once for all its query heads (decode_gqa.cuh); splits
  // then counts each KV head's blocks (decode_launch says when).
  int f16_gqa = 0;
};
// Head size 128: the code width (1, 2, 4 or 8) of a part the tensor-core paths take, or 0 —
// channel-wise codes on both sides with one range per channel (or one for all) over its n rows,
// aligned to 4·bits bytes (decode_mma.cuh) or, at 1 and 2 bits, to 16 (decode_i8.cuh's copies);
// 1-bit values may be kChannelT when the blocks have their staging memory (`staged`,
// DecodeParams::b1) and both sides are 16-byte aligned (decode_b1.cuh). The host's choice of
// kernel and the kernel's choice of path both ask this.
__host__ __device__ inline int mma_bits(const PartDesc& d, int n, bool staged) {
  const int b = d.k.bits;
  const bool whole = (d.k.group <= 0 || d.k.group >= n) && (d.v.group <= 0 || d.v.group >= n);
  const uintptr_t at = reinterpret_cast<uintptr_t>(d.k.data) | reinterpret_cast<uintptr_t>(d.v.data);
  const bool vt = d.v.fmt == kChannelT && b == 1 && staged && (at & 15) == 0;
  if (d.k.fmt != kChannel || (d.v.fmt != kChannel && !vt) || !whole || d.v.bits != b) return 0;
  if (b != 1 && b != 2 && b != 4 && b != 8) return 0;
  return (at & (b <= 2 ? 15 : 4 * b - 1)) == 0 ? b : 0;  // 1 and 2 bits: cp.async's 16-byte copies
}
// A part the tensor-core kernel takes as it is (DecodeParams::all_mma): fp16 rows of tokens other
// than visual ones, or a packed part of the tensor-core paths (mma_bits) not growing on the device.
inline bool mma_part(const PartDesc& d, bool staged) {
  if (d.k.fmt == kF16 && d.v.fmt == kF16) return !d.visual;
  return mma_bits(d, d.n, staged) != 0 && !d.counter;
}
// Fused split-KV attention (with calibration when asked) and the merge of partial states.
void decode_attention(const DecodeParams& p, cudaStream_t s);
// Raw scaled scores of every row into p.scores_out (no softmax).
void decode_scores(const DecodeParams& p, cudaStream_t s);
// Recorded queries' probabilities summed over a span of key positions (span_attention.cu): for
// query i < n and query head h (KV head h / (n_heads / n_kv_heads): kv), rows r < segs[kv] +
// seen[i] of scores[i][h][·] (`stride` apart), row r's code codes[kv][r] (`stride` a KV head; bit
// 0: a visual row, code >> 1: its index in the span + 1, 0 outside it). With `calibrate`,
// calibquant::calibrate_visual's g(x) (τ1, τ2) on the visual rows; then the softmax (exp in
// float, the sum in double) added by span index into out[i][h][n_span] (zeroed first).
void span_softmax_sums(const float* scores, int64_t stride, const int32_t* codes, const int32_t* segs,
                       const int32_t* seen, int n, int n_heads, int n_kv_heads, bool calibrate, float tau1, float tau2,
                       int n_span, float* out, cudaStream_t s);
// probs[b][h][row] = exp(scores_in − max) / sum from p.md_out (after decode_attention).
void decode_probs(const DecodeParams& p, float* probs, cudaStream_t s);
// The kernel decode attention runs for a cache, as far as decode_splits is concerned: all parts
// fp16 (decode_f16_kernel); head size 128 with only fp16 and tensor-core packed parts, without
// (kMma, 4 blocks a multiprocessor) or with (kB1, 2 blocks of twice the work a warp) the binary
// 1-bit path; or any other (the general kernel, 3 blocks).
// kF16Bulk: the all-fp16 kernel with bulk copies into shared-memory stages (decode_f16_bulk).
enum class DecodePath { kF16, kF16Bulk, kMma, kB1, kGeneral };
// Blocks of decode attention resident a multiprocessor (each kernel's register budget follows):
// the general kernel, the tensor-core-only one, the binary path's in pairs; and the most splits
// of a head's rows.
constexpr int kDecodeMinBlocks = 3, kDecodeMmaMinBlocks = 4, kDecodeB1PairMinBlocks = 2, kDecodeBulkMinBlocks = 2;
constexpr int kDecodeMaxSplits = 1024;
// Floats past a part's last row that DecodeParams::vis_scores must hold (a tile's aligned copy).
constexpr int kDecodeScorePad = 260;
DecodePath decode_path(int D, bool all_f16, bool all_mma, bool b1);
// Blocks per (b, head) for `rows` rows on a device of n_sm multiprocessors; at most one per 64
// rows (and 1024). kGeneral: at least one full wave of 3 blocks a multiprocessor, the last wave
// at least 90 % full where possible. kMma: when every head fits one wave of 4 a multiprocessor,
// the most splits that keep it one wave (short caches: below; fewer, longer blocks pay the
// query's preparation, the partial state and the merge less often: at batch 16 one split a head
// was 3–22 % faster than three on an H100), else the wave rule at 4. kB1: when every head fits
// one wave of 2 a multiprocessor, the most splits that keep it so (short caches: below; batch 1
// from 4096 rows: 8 splits a head; one block a multiprocessor, 4, was 0–3 % faster without
// calibration in one call and 0–2 % slower in another, and 3–10 % slower with it at 16k and 64k
// on H100s: q1 + calibration 0.0226–0.0228 / 0.0478–0.0479 ms against 0.0220–0.0222 /
// 0.0433–0.0438), else the wave rule at 2 with a last wave at least 85 % full (batch 16: one
// split a head, 6–18 % faster than the one-sub-tile kernel's 2 or 3 at 4k–64k rows). kF16
// (head_dim: 4·D bytes of K and V a row): the wave rule at 3, and a block at most
// kDecodeSplitBytes of rows where that would give it more: long fp16 contexts are then read in
// many waves of short blocks, whose last wave's idle share is small.
constexpr int64_t kDecodeSplitBytes = 512 << 10;
// Short packed caches, where a split's fixed work (its prologue, first tile, partial state and
// the head's merge) outweighs the rows it takes off the others. kB1: one split a head up to
// kDecodeB1OneSplitRows rows, then at most one block a multiprocessor up to
// kDecodeB1OneBlockRows. kMma: while a call holds at most kDecodeMmaShortRows rows (heads ×
// rows), half a wave (2 blocks a multiprocessor) of blocks of at least kDecodeMmaShortBlockRows
// rows. Swept on an H100 at 1, 2 and 4 sequences × 32 heads, 616–65536 rows, held (docs/cuda.md,
// run T), µs, the new count against the old:
// - 1-bit at batch 1: 616 rows 11.1 (1 split) against 13.3 (8), 1024 8.9 against 11.1, 2048
//   10.2 against 11.0; with calibration 16.1 / 12.2 / 13.8 against 19.2 / 15.1 / 15.0. At 4096
//   rows 4 splits against 8: 11.0 against 11.5 (15.2 against 15.9); batch 2: 2 against 4, 14.0
//   against 13.7 (17.8 against 17.7); batch 4: 1 against 2, 14.3 against 16.4 (19.4 against
//   20.5). From 8192 rows the full wave (8 at batch 1: 13.3 against 14.2 at 4).
// - 2- and 4-bit at batch 1: 8 splits instead of 16 from 1024 to 8192 rows, 2-bit 10.3 / 11.4 /
//   14.4 / 18.3 against 11.8 / 12.9 / 15.7 / 20.5, 4-bit 11.6 / 14.0 / 17.7 / 27.0 against 14.0 /
//   15.7 / 18.3 / 27.0; at 616 rows 4 splits instead of 10 (2-bit 10.3 against 10.8, 4-bit 10.5
//   against 11.8). From 16384 rows (half a million rows a call) 16 splits stayed the fastest or
//   within 2 % of it.
// - Batch 2 at 616 rows 4 splits instead of 8 (2-bit 11.0 against 12.2, 4-bit 12.7 against
//   14.7), at 4096 rows 4 instead of 8 (2-bit 18.4 against 20.0, 4-bit 27.6 against 26.9);
//   batch 4 at 616 rows 2 instead of 4 (2-bit 13.0 against 13.8, 4-bit 15.2 against 16.3).
constexpr int kDecodeB1OneSplitRows = 2048, kDecodeB1OneBlockRows = 4096;
constexpr int64_t kDecodeMmaShortRows = 1 << 18;
constexpr int kDecodeMmaShortBlockRows = 128;
// kF16Bulk: when every head fits one wave of two blocks a multiprocessor, the most splits that
// keep it one wave (batch 1 × 32 heads: 8, at any context; more were 1–3 % slower at 64k; one
// block a multiprocessor, 4, was 0.3–1.5 % faster held but slower in a row on an H100, ms:
// 4k 0.0304 against 0.0265–0.0267, 16k 0.0954 against 0.0912, 64k 0.3548–0.3550 against
// 0.3538–0.3542), else the wave rule at two, and blocks of at most kDecodeBulkSplitBytes of
// rows where that takes kDecodeBulkMinSplits or more. Sweeps at batch 16 (H100, held, ms): 4k
// 0.3570–0.3585 at one split, 0.3576–0.3583 at 8, 0.373 at 16; 16k 1.3843–1.3848 at 32,
// 1.3876–1.3894 at 16–48, 1.392 at 8, 1.426–1.430 at 64; 64k 5.4914–5.4919 at 128,
// 5.4930–5.4935 at 64, 5.500–5.504 at 32, 5.577 at 48. (H200, an earlier kernel: 4k 0.243 at
// one split, 0.250–0.253 at 2–8; 16k 0.940–0.941 at 8–32; 64k 3.678–3.683 at 8–32, 3.719 at
// one.)
constexpr int64_t kDecodeBulkSplitBytes = 256 << 10;
constexpr int kDecodeBulkMinSplits = 16;
// Rows a head from which an fp16 cache of head size 128 on sm_90 takes the bulk-copy kernel;
// shorter contexts (a captioning run's hundreds of rows) keep the register-staged one, whose
// fixed work a block is shorter.
constexpr int kDecodeBulkRows = 4096;
// The bulk-copy kernel's stages: kDecodeBulkChunkRows rows of K and V each, kDecodeBulkStages in
// flight (96 KiB). With DecodeParams::claim a head's rows go out in chunks of one stage: block s
// takes chunks s, s + splits, … for its first kDecodeBulkStages stages, then claims the next from
// the head's counter, which starts at zero (chunk kDecodeBulkStages · splits).
constexpr int kDecodeBulkChunkRows = 64, kDecodeBulkStages = 3;
// DecodeParams::bulk_fine: blocks that claim rows and average kDecodeBulkFineRows or more take
// stages of kDecodeBulkFineChunkRows rows, kDecodeBulkFineStages in flight (the same 96 KiB), so
// the head's blocks end within half as many rows of each other. Every bulk launch so built, on
// an H100 (held / in a row, ms):
// batch 1 / 64k (8192 rows a block) 0.3509–0.3516 / 0.3438–0.3443 against 0.3528–0.3559 /
// 0.3470 with 64-row stages, 16k (2048) 0.0959–0.0964 / 0.0903–0.0904 against 0.0966–0.0969 /
// 0.0904; but 4k (512) 0.0322 / 0.0268 against 0.0317 / 0.0259–0.0260, and at batch 16 (512
// rows a block) 16k 1.385 against 1.380 and 64k 5.74–5.76 against 5.459. As built (these blocks
// only), against 64-row stages in one call: 64k 0.3512–0.3517 / 0.3444–0.3446 against
// 0.3526–0.3529 / 0.3474–0.3482; 16k level (0.0963–0.0968 / 0.0906 against 0.0963–0.0967 /
// 0.0902–0.0905).
constexpr int kDecodeBulkFineChunkRows = 32, kDecodeBulkFineStages = 6, kDecodeBulkFineRows = 2048;
bool decode_f16_bulk(int D, int rows, bool sm90);
// The GQA kernel (DecodeParams::f16_gqa, decode_gqa.cuh): a block of kDecodeGqaThreads a KV
// head's range of rows and all R = NH / NKV ≤ kDecodeGqaMaxRatio of its query heads on tensor
// cores, the rows copied once into a ring of kDecodeGqaStages stages of kDecodeGqaStageRows K
// and V rows in shared memory (102 KiB at head size 128: kDecodeGqaBlocks blocks a multiprocessor
// of an sm_90 device; sm_86 and sm_89 allow 99 KiB a block, so it is built and taken on sm_90
// devices only). All-fp16 caches of head size 32, 64 or 128 with R ≥ 2 take it, ahead of the
// other fp16 kernels (which read each row R times and spend an fp32 multiply-add a channel,
// head and row), where its blocks get at least kDecodeGqaBlockRows rows, or at batch 2 and more
// from kDecodeGqaBatchRows rows: splits (gqa_splits) by the wave rule over B · NKV heads, at
// least kDecodeGqaMinRows rows a block. At batch 1 and a few thousand rows both kernels take the
// same time alone (the latency of a block's trips to memory), and in a model's decode step the
// step is slower with the GQA kernel (probably as its blocks, 110 KB of shared memory and 160
// registers, leave the next weight product no room to start early): the 7B LLaVA-NeXT-Mistral shape (3,032 rows)
// decoded at 74.0 % of the roofline with it (30 splits), 75.9 % at 16, against 78.0–78.5 %
// without; InternVL3-8B (1,404 rows) 71.5–73.2 % against 78.3–79.5 % (docs/cuda.md, run AJ). H200, bench attention --bits 16 (each call alone, ms,
// the GQA kernel against the others; its splits in brackets):
//   32 query / 8 KV heads × 128, batch 1: 1024 rows 0.0151 (30) against 0.0107; 3032 0.0178 (30)
//     / 0.0169 (16) against 0.0167; 8192 0.0244 against 0.0324; 16k and 64k (before the block-wide
//     merge) 0.0586 and 0.1182 against 0.0674 and 0.2472;
//   batch 4: 1024 0.0169 against 0.0193; 2048 0.0214 against 0.0315; 3032 0.0258 against 0.0428;
//     8192 0.0480 against 0.1289; batch 16 (before the merge): 3032 0.0667 against 0.1345, 64k
//     1.0868 (94 % of the copy bandwidth) against 3.4839;
//   28 / 4 heads, batch 1: 1404 rows 0.0167 (24) against 0.0113; 3032 0.0297 (60) against 0.0160;
//     batch 4: 1024 0.0193 against 0.0202; 2048 0.0226 against 0.0310; 8192 0.0365 against 0.1271.
constexpr int kDecodeGqaThreads = 128, kDecodeGqaStageRows = 64, kDecodeGqaStages = 3, kDecodeGqaBlocks = 2;
constexpr int kDecodeGqaMaxRatio = 8, kDecodeGqaMinRows = 32, kDecodeGqaBlockRows = 512, kDecodeGqaBatchRows = 2048;
// Whether the GQA kernel can take this cache shape (head size, query and KV heads).
bool decode_f16_gqa(int D, int NH, int NKV);
// Blocks of the GQA kernel of head size D a multiprocessor of this device holds (asks the device).
int decode_gqa_occupancy(int D);
int gqa_splits(int B, int NKV, int rows, int n_sm);
int decode_splits(int B, int NH, int rows, int n_sm, DecodePath path = DecodePath::kGeneral, int head_dim = 0);
// Whether a kB1 cache runs the kernel of two 128-row sub-tiles a warp (DecodeParams::b1_pair):
// when its grid fits two blocks a multiprocessor, or its blocks hold kDecodeB1PairRows rows or
// more, or its waves of two blocks a multiprocessor, each counted as 3/4 of a wave of three
// one-sub-tile blocks, take fewer than that kernel's (batch 16 × 32 heads: 2 × 3/4 against 2).
// Swept on an H100 (docs/cuda.md, run Q), 1-bit at batches 2–193 and 576–4096 rows, one split a
// head: pairs were 4–22 % faster from 3072 rows and at batch 16 from 576 rows; at batches 32–193
// below 2048 rows the one-sub-tile kernel was 0–10 % faster, and at 2048 rows the two were
// within 5 % either way (calibration favouring one sub-tile). CalibQuant's Fig. 3 (3388 rows)
// gained 1.4–3.6 % tokens/s in pairs.
constexpr int kDecodeB1PairRows = 3072;
bool decode_b1_pair(int B, int NH, int rows, int splits, int n_sm);
// A cache's decode-attention launch, as DecodeParams takes it: the splits of each head's rows
// (decode_splits for the kernel its flags choose, or `splits` when given), b1_pair and f16_bulk.
struct DecodeLaunch {
  int splits = 1;
  bool b1_pair = false;
  bool f16_bulk = false;
  bool bulk_fine = false;  // f16_bulk with several splits of kDecodeBulkFineRows rows or more on average
  bool f16_gqa = false;    // the GQA kernel (splits then counts a KV head's blocks)
};
// sm90: the device runs sm_90 code (the bulk-copy and GQA kernels). NKV: the KV heads (0: NH, no
// GQA).
DecodeLaunch decode_launch(int B, int NH, int rows, int n_sm, int D, bool all_f16, bool all_mma, bool b1,
                           int splits = 0, bool sm90 = false, int NKV = 0);
// The plan's split count and kernel choices into p (splits, b1_pair, f16_bulk, bulk_fine, f16_gqa).
void set_launch(DecodeParams& p, const DecodeLaunch& l);
int decode_lut_bytes(int D, int lut_bits);
// The fp16 decode kernel takes this head size and part count (all_f16 caches; fresh rows).
bool decode_f16_supported(int D, int max_parts);
// The token-wise kernel (DecodeParams::tok_bits) takes this head size, part count and code width.
bool decode_tok_supported(int D, int max_parts, int bits);
// DecodeParams::mix_bits for parts of several widths, each read per part.
constexpr int kDecodeMixWidths = 0x100;
// The mixed kernel (DecodeParams::mix_bits) takes this head size, part count and code width.
bool decode_mix_supported(int D, int max_parts, int bits);
// The narrower kernels a plain attention pass (no calibration, no materialized scores) may take
// for a cache of these DecodeParams flags: the fp16 kernel, the token-wise one (tok_bits) and
// the mixed one (mix_bits). decode_attention launches by them, and a decode step fuses its token
// only where one of them serves it.
struct PlainKernels {
  bool f16 = false, tok = false, mix = false;
};
PlainKernels decode_plain_kernels(int D, int max_parts, int all_f16, int tok_bits, int mix_bits);

// ---- KV cache (kv_cache.cu) -------------------------------------------------------------------
// Appends T rows (k and v columns of qkv, fp32) as fp16 into per-head arrays k/v [NKV][cap][D]
// at row row0 (+ *counter when counter is not null; the kernel then adds T to *counter), and
// positions into pos [NKV][cap].
void kv_append(const float* qkv, int64_t stride, int64_t k_col, int64_t v_col, int T, int NKV, int D,
               const int32_t* pos_in, __half* k, __half* v, int32_t* pos, int cap, int row0,
               int32_t* counter, cudaStream_t s);
// The same for a batch of sequences (batched decode): row t of qkv is sequence t's new token,
// written at row (row0 + *counter) of that sequence's arrays, which start seq_stride rows of
// [cap][D] further on (k/v at t·NKV·cap·D, pos at t·NKV·cap); *counter advances by one.
void kv_append_batch(const float* qkv, int64_t stride, int64_t k_col, int64_t v_col, int B, int NKV, int D,
                     const int32_t* pos_in, __half* k, __half* v, int32_t* pos, int cap, int row0,
                     int32_t* counter, cudaStream_t s);
// A decode step's RoPE (q and k heads of one token, in place in qkv) and its K/V row appended as
// fp16 at row *counter of k/v [NKV][cap][D] (positions at pos [NKV][cap]); the last block to
// finish advances *counter (done: a zero int the kernel resets). The rotated query goes to `keep`
// too where it asks for the row.
void rope_append(float* qkv, int64_t q_col, int nq, int64_t k_col, int64_t v_col, int nk, int D,
                 const int32_t* pos_in, const float* inv_freq, __half* k, __half* v, int32_t* pos, int cap,
                 int32_t* counter, int32_t* done, cudaStream_t s, const KeptQueries& keep = {});
// rope_append with the row quantized instead: RoPE on q and k in place, then each KV head's key
// and value rounded to fp16 and quantized with one range per row (quant::quantize_block,
// Axis::PerToken, on those fp16 values: the same codes and ranges) at row *counter of t, which the
// last block advances (done: a zero int the kernel resets). With t.rotation, each key row is
// rotated by quant::block_hadamard (the same fp32 operations in the same order) before it is
// quantized, and each query head is rotated in place by the same blocks. D a multiple of 8, at
// most kMaxQuantTailD; bits 1 to 8; rotation a power of two dividing D.
void rope_quant_append(float* qkv, int64_t q_col, int nq, int64_t k_col, int64_t v_col, int nk, int D,
                       const int32_t* pos_in, const float* inv_freq, const QuantTail& t, int32_t* counter, int32_t* done,
                       cudaStream_t s);
// Each of n rows of D floats (row i at x + i·D) through quant::block_hadamard's blocks of
// `rotation` in place, with its fp32 operations in its order: the transform is its own inverse,
// so a query rope_quant_append rotated comes back (within fp32 rounding). One block a row;
// D a multiple of 8, at most kMaxQuantTailD; rotation as rope_quant_append takes it.
void hadamard_rows(float* x, int n, int D, int rotation, cudaStream_t s);
// A row codebook on the device (quant::RowCodec; TurboQuant's): signs [dp], levels
// [2^mse_bits], and with qjl S [d][d] and its transpose St, fp32.
struct CodecDev {
  const float* signs = nullptr;
  const float* levels = nullptr;
  const float* S = nullptr;
  const float* St = nullptr;
  int d = 0, dp = 0, mse_bits = 0, qjl = 0;
  int row_bytes = 0;  // quant::RowCodec::row_code_bytes
};
constexpr int kMaxCodecDp = 256;
// The decode row rope_append just wrote (row *counter − 1 of every KV head of k / v [NKV][cap][D]
// fp16) coded by kc (keys) and vc (values) as quant::RowCodec says, with the host coder's
// operations (turboquant::Codec::encode_row: fp32 butterflies in quant::hadamard's order, fused
// double sums in index order) on the row's fp16 values: the codes to kcodes / vcodes
// [NKV][cap][row_bytes], the fp16 scales to scales [3][NKV][cap] (‖k‖, ‖r‖ of keys with qjl, ‖v‖),
// and the row replaced by its dequantization rounded to fp16. dp at most kMaxCodecDp.
void codec_tail_rows(const CodecDev& kc, const CodecDev& vc, __half* k, __half* v, int NKV, int D, int cap,
                     const int32_t* counter, uint8_t* kcodes, uint8_t* vcodes, __half* scales, cudaStream_t s);
// The same coding of N key rows and N value rows in place: x [2][N][D] fp16 (keys, then values;
// device memory), each row replaced by its dequantization; their codes to kcodes / vcodes
// [N][row_bytes], their fp16 scales to scales [3][N].
void codec_rows(const CodecDev& kc, const CodecDev& vc, int N, int D, __half* x, uint8_t* kcodes, uint8_t* vcodes,
                __half* scales, cudaStream_t s);
// dst row i (D halves) = *src[i] for n rows (src pointers in device memory).
void gather_rows(const __half* const* src, __half* dst, int n, int D, cudaStream_t s);
// One gather of a KV sync: `rows` K rows from src[first + i] and V rows from
// src[first + rows + i] into k and v (k null: none copied, the rows stay where they are), and
// their positions pos_in[pos_first + i] into pos.
struct RowGather {
  int64_t first = 0, rows = 0;
  __half* k = nullptr;
  __half* v = nullptr;
  int32_t* pos = nullptr;
  int64_t pos_first = 0;
};
// Every one of the n gathers of `jobs` (device memory; none longer than max_rows rows) in one
// launch (D halves a row, a multiple of 8; src and pos_in in device memory).
void gather_segments(const RowGather* jobs, int n, int64_t max_rows, const __half* const* src, const int32_t* pos_in,
                     int D, cudaStream_t s);
// Block i of dst (`bytes`, a multiple of 4) = block index[i] of src, for n blocks (index in
// device memory).
void gather_blocks(const void* src, void* dst, int64_t bytes, const int32_t* index, int n, cudaStream_t s);
// ---- quantize-and-pack (quant_pack.cu): the device twins of core/compress/quantize.h ---------
// x[n][D] (fp16 rows) → codes and fp16 scale/zero as quantize_block packs them. Channel axis:
// one range per channel over the n rows (chan_stride 1) or one for all (0) — with group > 0,
// over each group of `group` rows (UniformSpec::group), the groups' ranges one after another;
// token axis: one per row. Ranges shrink by `shrink` about zero or the centre first.
void quantize_channel(const __half* x, int n, int D, int bits, int chan_stride, float shrink, bool about_zero,
                      uint8_t* codes, __half* scale, __half* zero, int group, cudaStream_t s);
// The same for `heads` blocks of n rows each, one launch: head h reads x + h·x_stride (halves;
// 0: n·D, the blocks back to back) and writes codes + h·code_stride (bytes) and scale, zero +
// h·range_stride.
void quantize_channel_heads(const __half* x, int64_t x_stride, int heads, int n, int D, int bits, int chan_stride, float shrink,
                            bool about_zero, uint8_t* codes, int64_t code_stride, __half* scale, __half* zero,
                            int64_t range_stride, int group, cudaStream_t s);
void quantize_token(const __half* x, int n, int D, int bits, const __half* factor, uint8_t* codes,
                    __half* scale, __half* zero, cudaStream_t s);
// Per-token ranges of the rows rotated by the Hadamard blocks of `rotation` channels first
// (UniformSpec::rotation, quant::block_hadamard in fp32): the rotated rows' codes; quant_tail_ok(D,
// rotation), rotation > 0.
void quantize_token_rotated(const __half* x, int n, int D, int bits, int rotation, uint8_t* codes, __half* scale,
                            __half* zero, cudaStream_t s);
// KIVI's pieces (StepQuant::group), many in one launch: piece i's n rows of fp16 keys k[n][D]
// and values v[n][D] quantized with `bits`, keys with a range per channel over the piece
// (quantize_block, Axis::PerChannel: D scales and zeros), values with one per row (PerToken: n
// each), codes packed row by row as quantize_block packs them. Pieces live in device memory.
struct GroupPiece {
  const __half* k = nullptr;
  const __half* v = nullptr;
  int n = 0;
  uint8_t* k_codes = nullptr;
  uint8_t* v_codes = nullptr;
  __half* k_scale = nullptr;  // [D], then zeros at k_zero
  __half* k_zero = nullptr;
  __half* v_scale = nullptr;  // [n]
  __half* v_zero = nullptr;
};
void quantize_pieces(const GroupPiece* pieces, int n_pieces, int D, int bits, cudaStream_t s);
// Arrays laid out one after another in one allocation, each from an `align`-byte boundary (256
// unless said): put(n) gives where n more bytes start; `bytes` is the allocation's size.
struct ArrayLayout {
  int64_t bytes = 0;
  int64_t align = 256;
  int64_t put(int64_t n) {
    const int64_t at = bytes;
    bytes += (n + align - 1) / align * align;
    return at;
  }
};
// 1-bit codes of `heads` blocks of n rows × D channels (D a multiple of 8; block h at rows +
// h·stride bytes, written at out + h·stride) regrouped as quant::channel_major_1bit does: the
// same bytes (kChannelT).
void channel_major_1bit(const uint8_t* rows, int heads, int n, int D, int64_t stride, uint8_t* out, cudaStream_t s);

}  // namespace kvlens::cuda
