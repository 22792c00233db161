// ZipCache's device kernels (quant_pack.cu: the group quantizer and CST factors; zip_gap_ops.cu:
// a streamed gap's saliency, ranking, plan and layout, and its arrays copied into the gaps' store),
// each the twin of a zipcache:: host function, tested in tests/kernels/test_zip_gap_ops.cpp,
// test_zip_quant.cpp and test_decode_ops.cpp.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

// Where each layer's decode rows are: its tail's keys and values [NKV][cap][D] and positions
// [NKV][cap] (device arrays of L pointers each), the gap at tail row `first`.
struct ZipGapRows {
  const __half* const* k = nullptr;
  const __half* const* v = nullptr;
  const int32_t* const* pos = nullptr;
  int cap = 0, first = 0;
};
// ZipCache's streamed-gap saliency (zipcache::gap_saliency's reduction, the softmax sums taken
// from the steps) for every layer's KV heads at once, from what each probe's own decode step
// left: probe k < n_probes[l] of layer l (query b = l·S + k) saw seen[b] of the gap's rows; its
// rotated query heads are q [L·S][NH][D] and its softmax states md [L·S][NH] (max, sum of
// exp(score − max), over every row it read; KeptQueries). Each probe's scores over the gap's rows
// it saw (at `scale`, its step's; `rows` from tail row `first`) are computed here. A pair whose
// state no step wrote (NaN) counts as one that saw nothing. out [L][NKV][gap] (double).
void zip_gap_saliency(const float* q, const float2* md, const ZipGapRows& rows, int D, float scale, int L, int S,
                      int NH, int NKV, int gap, const int32_t* n_probes, const int32_t* seen, bool accumulated,
                      double* out, cudaStream_t s);
// ZipCache's gap ranking (zipcache::rank_gap, the same flags) for every layer's KV heads at once:
// of sal [L][NKV][gap], KV head h of layer l's k rows of highest saliency (ties to the earlier
// row), or with `shared` the k of highest saliency summed over the layer's KV heads in head order.
// key [L][NKV][gap] (scratch: the key ranked), salient [L][NKV][gap] (1: salient), order
// [L][NKV][gap] (each head's salient rows ascending, then the others ascending: the rows as a
// ZipMixed group holds them) and flags [L][NKV][(gap + 7) / 8] (1 bit a row, quant::pack's order).
void zip_rank_gap(const double* sal, int L, int NKV, int gap, int k, bool shared, double* key, uint8_t* salient,
                  int32_t* order, uint8_t* flags, cudaStream_t s);
// A ranked gap laid out as zip_quantize reads it, every layer's: row r = (l·NKV + h)·gap + i is
// KV head h's i-th row in `order` (zip_rank_gap's); src [2N] the rows' keys then values (for
// gather_rows, N = L·NKV·gap); pos_out [L][NKV][gap] the gap's positions in their own order. V
// token ranges a row each (shared_ranges false: slot r), or shared by the heads' rows of a subset
// and position (slot 2·gap·l + j for salient row j, 2·gap·l + gap + j for the others; L·2·gap
// slots, some empty): row_slot [N], slot_first [slots + 1], slot_rows [N].
void zip_gap_plan(const ZipGapRows& rows, int L, int NKV, int gap, int k, int D, bool shared_ranges,
                  const int32_t* order, const uint8_t* salient, const __half** src, int32_t* row_slot,
                  int32_t* slot_first, int32_t* slot_rows, int32_t* pos_out, cudaStream_t s);

// ZipCache's CST factors c_j = half(sqrt(max_t |x_tj|)) (1 where 0 or not finite).
void cst_factors(const __half* x, int n, int D, __half* factor, cudaStream_t s);
// ZipCache's mixed-bit group (quant::CodeLayout::ZipMixed) quantized as zipcache::quantize_group
// does on the host, from fp16 rows x: keys [N][D], then values [N][D]. The rows come in blocks,
// one per KV head and subset (salient first), each with its bits, where its codes start in the K
// and V code arrays (row r of the block at code + r·D·bits/8, the host's packing), where its D
// channel ranges start in k_scale / k_zero, and where its D CST factors are in `factor`. Each
// factor block's rows (a head's subset, or all its rows) give D factors, half(sqrt(max |v|)).
// Each value row reads its token range from slot row_slot[row]; slot s's range spans the rows
// slot_rows[slot_first[s] .. slot_first[s + 1]) (one row a slot: a range per row; the rows of
// one subset and position over the heads: ZipCache's shared token ranges). With row_scale /
// row_zero, each row's slot range is copied there too.
struct ZipBlock {
  int32_t row0 = 0, n = 0, bits = 0;
  int64_t code = 0, range = 0, factor = 0;  // bytes into the code arrays; halves into k_scale and `factor`
};
struct ZipFactorBlock {
  int32_t row0 = 0, n = 0;
  int64_t at = 0;  // halves into `factor`
};
struct ZipQuantArgs {
  const __half* x = nullptr;
  int N = 0, D = 0;
  const ZipBlock* blocks = nullptr;  // device arrays from here on
  int n_blocks = 0;
  const ZipFactorBlock* factor_blocks = nullptr;
  int n_factor_blocks = 0;
  const int32_t *row_block = nullptr, *row_slot = nullptr;  // [N]
  const int32_t *slot_first = nullptr, *slot_rows = nullptr;
  int n_slots = 0;
  // The most rows any block holds, where known (0: not known). Blocks of at most kZipFewRows rows
  // (a streamed gap's) take their key ranges a thread a channel instead of a block a channel.
  int max_block_rows = 0;
  uint8_t *k_codes = nullptr, *v_codes = nullptr;
  __half *k_scale = nullptr, *k_zero = nullptr, *factor = nullptr, *t_scale = nullptr, *t_zero = nullptr;
  __half *row_scale = nullptr, *row_zero = nullptr;
};
constexpr int kZipFewRows = 64;
void zip_quantize(const ZipQuantArgs& a, cudaStream_t s);
// zip_quantize's outputs laid out in one allocation after what `at` holds already: K and V codes
// (`code` bytes each), key scales and zeros (`range` halves each), CST factors (`factor` halves),
// slot scales and zeros (`slots` halves each) and, with copy_rows > 0, each row's copy of its
// slot's scale and zero (copy_rows halves each; else rs = rz = -1). Byte offsets.
struct ZipOutputs {
  int64_t kc = 0, vc = 0, ks = 0, kz = 0, f = 0, ts = 0, tz = 0, rs = -1, rz = -1;
  ZipOutputs(ArrayLayout& at, int64_t code, int64_t range, int64_t factor, int64_t slots, int64_t copy_rows) {
    kc = at.put(code);
    vc = at.put(code);
    ks = at.put(range * 2);
    kz = at.put(range * 2);
    f = at.put(factor * 2);
    ts = at.put(slots * 2);
    tz = at.put(slots * 2);
    if (copy_rows > 0) {
      rs = at.put(copy_rows * 2);
      rz = at.put(copy_rows * 2);
    }
  }
  // a's output arrays in the allocation at `base`.
  void point(ZipQuantArgs& a, char* base) const {
    a.k_codes = reinterpret_cast<uint8_t*>(base + kc);
    a.v_codes = reinterpret_cast<uint8_t*>(base + vc);
    a.k_scale = reinterpret_cast<__half*>(base + ks);
    a.k_zero = reinterpret_cast<__half*>(base + kz);
    a.factor = reinterpret_cast<__half*>(base + f);
    a.t_scale = reinterpret_cast<__half*>(base + ts);
    a.t_zero = reinterpret_cast<__half*>(base + tz);
    a.row_scale = rs >= 0 ? reinterpret_cast<__half*>(base + rs) : nullptr;
    a.row_zero = rz >= 0 ? reinterpret_cast<__half*>(base + rz) : nullptr;
  }
};
// The blocks of zip_gap_plan's rows (k salient at hi_bits, gap − k at lo_bits in every KV head),
// the same for every gap: zip_quantize's blocks, factor blocks and row blocks; the code bytes,
// range halves and factor halves in all and per layer, and each KV head's offsets within its layer.
struct ZipGapLayout {
  std::vector<ZipBlock> blocks;
  std::vector<ZipFactorBlock> factor_blocks;
  std::vector<int32_t> row_block;
  int64_t code = 0, range = 0, factor = 0;
  int64_t layer_code = 0, layer_range = 0, layer_factor = 0;
  std::vector<int64_t> head_code, head_range, head_factor;
};
ZipGapLayout zip_gap_layout(int L, int NKV, int gap, int k, int D, int hi_bits, int lo_bits, bool layer_factors);
// Where a streamed gap's arrays lie in the result allocation kv_zip_gap.cu quantizes it into:
// zip_quantize's outputs (`out`; V token ranges read from its per-row copies where the heads
// share slots, else from the slots, a row each) and the flags [L][NKV][(gap + 7) / 8], positions
// and row order [L][NKV][gap] (int32) beside them. Byte offsets.
struct ZipGapResult {
  ZipOutputs out;
  int64_t flags = 0, pos = 0, order = 0;
};
// A run of bytes copied from a gap's result allocation into the gaps' store: `bytes` from byte
// `src` of the result to byte dst + gi·bytes of the store, for gap gi (each gap's copy right
// after the one before).
struct ZipStoreRun {
  int64_t src = 0, dst = 0, bytes = 0;
};
// The gaps' store: one allocation holding, for every gap the reserved decode rows have room for
// (`gaps`), every layer's gap arrays where the decode reads them as two parts a KV head — each
// subset s (1 salient, 0 the others; n_s rows a gap) with its K and V codes [gaps][n_s][D·bits/8],
// K scales and zeros [gaps][D] (a range group a gap), V token ranges [gaps][n_s] and CST factors
// [gaps][D] (with layer factors one array a head, both subsets reading it) — then each KV head's
// salient flags [gaps][(gap + 7) / 8] and, a layer's in one array each, the positions and row
// orders [NKV][gaps][gap]. Every array at a 16-byte boundary; byte offsets. `runs` copy gap gi's
// arrays (ZipGapResult) into it (zip_store_gap).
struct ZipStoreLayout {
  struct Subset {
    int64_t kc = -1, vc = -1, ks = -1, kz = -1, vs = -1, vz = -1, f = -1;  // (-1: the subset is empty)
  };
  std::vector<std::array<Subset, 2>> sub;  // [l·NKV + h][s]
  std::vector<int64_t> flags;              // [l·NKV + h]
  std::vector<int64_t> pos, order;         // [l]
  std::vector<ZipStoreRun> runs;
  int64_t bytes = 0;
  int gaps = 0, n[2] = {0, 0}, bits[2] = {0, 0};
};
ZipStoreLayout zip_store_layout(const ZipGapLayout& Z, const ZipGapResult& r, int L, int NKV, int gap, int k, int D,
                                int hi_bits, int lo_bits, bool layer_factors, int gaps);
// Gap gi's arrays copied from `result` into `store` by the n runs (device memory), one launch.
void zip_store_gap(const ZipStoreRun* runs, int n, const char* result, char* store, int gi, cudaStream_t s);

}  // namespace kvlens::cuda
