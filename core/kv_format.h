// The packed KV format that quantizing methods write and kernels read: b-bit little-endian
// code streams, fp16 scales and zero points, the layouts a backend can decode directly
// (CodeLayout), and the payload that owns a quantized segment's bytes (QuantPayload). It sits
// on the bottom floor so that kernels know the format without knowing any method.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/half.h"
#include "core/kv_store.h"

namespace kvlens::quant {

// ---- fp16 (IEEE binary16, round to nearest even; core/half.h) ------------------------------
using kvlens::from_half;
using kvlens::round_half;
using kvlens::to_half;

inline uint32_t max_code(int bits) { return (1u << bits) - 1u; }

// ---- bit packing ------------------------------------------------------------------------------
// Code i occupies bits [i·b, (i+1)·b) of a little-endian bit stream (bit 0 = LSB of byte 0);
// b ∈ [1, 8]; a stream of n codes takes ceil(n·b/8) bytes.
int64_t packed_size(int64_t count, int bits);
// Appends the packed stream of `count` codes to `out`.
void pack(const uint32_t* codes, int64_t count, int bits, std::vector<uint8_t>& out);
void unpack(const uint8_t* packed, int64_t count, int bits, uint32_t* codes);
uint32_t unpack_one(const uint8_t* packed, int64_t i, int bits);
// 1-bit codes of n rows × d channels (d a multiple of 8) regrouped for the GPU's binary
// tensor-core decode path: each whole group of 32 rows becomes d little-endian 32-bit words,
// word c holding channel c's codes, the code of row 32b + block_row(i) at bit i; rows past the
// last whole group stay as they are. The same number of bytes as the packed rows.
inline int block_row(int bit) { return 16 * ((bit >> 1) & 1) + 8 * (bit & 1) + (bit >> 2); }
std::vector<uint8_t> channel_major_1bit(const uint8_t* rows, int64_t n, int d);
// The packed rows channel_major_1bit regrouped (its inverse).
std::vector<uint8_t> rows_from_channel_major_1bit(const uint8_t* grouped, int64_t n, int d);

// ---- ranges' axes -------------------------------------------------------------------------------
enum class Axis { Global, PerToken, PerChannel };
// "global" | "per-token" | "per-channel"
Axis parse_axis(const std::string& s);
const char* axis_name(Axis a);

// One uniform quantization of a block of rows (quantize_block in core/compress/quantize.h, and
// a backend's twin): b bits, ranges along `axis`, shrunk by `shrink` about zero or the centre.
struct UniformSpec {
  int bits = 4;
  Axis axis = Axis::PerToken;
  float shrink = 1.0f;
  bool shrink_about_zero = true;
  // Channel-wise and global ranges: over each group of `group` consecutive rows (KIVI's key
  // groups), the groups' ranges one after another; 0: over the whole block.
  int group = 0;  // Per-token ranges of rows first rotated by the orthonormal Hadamard transform of blocks of
  // `rotation` channels (block_hadamard; Hadamard-INT4's keys): the codes are of the rotated
  // row, and the block's rows become their dequantization rotated back. 0: none.
  int rotation = 0;
};
// ---- what a quantized segment stores ----------------------------------------------------------
struct QuantBlock {
  std::vector<uint8_t> codes;    // packed codes (and sign bits)
  std::vector<uint16_t> scales;  // fp16 scales (or norms)
  std::vector<uint16_t> zeros;   // fp16 zero points α
  std::vector<uint16_t> meta;    // fp16 extras (per-channel factors)
  std::vector<uint8_t> flags;    // packed per-token flags (mixed precision membership)
  void shrink_to_fit();
  KVBytes allocated() const;  // from capacities: codes, scales, zeros, meta (fp16 meta + flags)
};

// How a payload's blocks are laid out, for a backend that reads the codes directly
// (kernels/cuda packs and reads the same bytes). Kind None: a format only the host decodes.
//   Fp16:     codes hold the rows as fp16 halves, [n][d] per head.
//   Blocks:   K and V each quantize_block'ed with (bits, axis); PerChannel / Global ranges are
//             taken over groups of `group` rows (0 = the whole block), each group packed on its
//             own, so scales hold [groups][d] (PerChannel) or [groups] (Global) values.
//   ZipMixed: one payload for a group of consecutive segments of a layer (ZipCache's
//             quantization group: a layer's prompt, one of its segments, or a streaming gap;
//             shared by the group's segments, its bytes counted on the first). Per head, the
//             group's rows in segment order carry a salient flag (k.flags, 1 bit per row); K
//             codes of the salient rows then of the others, each subset PerChannel at hi_bits /
//             lo_bits (k.scales / zeros: D per non-empty subset, salient first); V codes row by
//             row in the same order, CSTQuant: x = c_j·(code·scale + zero) with the channel
//             factors c in v.meta (D per non-empty subset, salient first; D for both when
//             layer_factors) and one range per row in v.scales / zeros — or, when
//             shared_token_ranges, one per (subset, position) in `tokens` over every head that
//             holds the position in that subset: the salient subset's positions ascending,
//             then the other subset's.
// k_rotation (Blocks): the K codes are of keys rotated by the block-diagonal orthonormal
// Hadamard transform of blocks of k_rotation channels (block_hadamard; Hadamard-INT4), so a
// reader multiplies the query by the same transform; 0: none.
struct CodeLayout {
  enum class Kind : uint8_t { None, Fp16, Blocks, ZipMixed };
  Kind kind = Kind::None;
  int k_bits = 0, v_bits = 0;
  Axis k_axis = Axis::PerToken, v_axis = Axis::PerToken;
  int k_group = 0, v_group = 0;
  int hi_bits = 0, lo_bits = 0;
  bool layer_factors = false, shared_token_ranges = false;
  int k_rotation = 0;
};

// One K block and one V block per KV head.
//
// Arrays a backend made where the rows are (a device) need not cross to the host: the backend
// defers them (defer), and until they land the blocks lack them while allocated() already
// counts them. A host reader of the blocks calls land() first; it brings every deferred array
// in, once, on whichever thread asks first (others wait for it). A copy of the payload lands it
// first and is never deferred itself. shrink_to_fit shrinks the arrays the host holds.
class QuantPayload : public SegmentPayload {
 public:
  explicit QuantPayload(int n_heads) : k(n_heads), v(n_heads) {}
  QuantPayload(const QuantPayload& o);
  QuantPayload& operator=(const QuantPayload& o);
  std::vector<QuantBlock> k, v;
  QuantBlock tokens;  // ZipMixed with shared_token_ranges: the V token ranges (see CodeLayout)
  CodeLayout layout;
  KVBytes allocated() const override;
  void shrink_to_fit();
  // Arrays of `bytes` that `land` writes into this payload's blocks when called; land() checks
  // that the blocks then hold exactly `bytes` more than before (InternalError otherwise).
  void defer(KVBytes bytes, std::function<void()> land);
  bool deferred() const;
  void land() const;

 private:
  struct Deferred;
  std::shared_ptr<Deferred> deferred_;
  KVBytes held() const;  // the blocks' own bytes
};
// s's payload as a QuantPayload with every array on the host (land()); null when it has none.
const QuantPayload* landed(const SegmentPayload* p);

// ZipMixed's V token ranges shared by the KV heads (shared_token_ranges): one slot per (subset,
// position) that any KV head holds in that subset, numbered over the salient subset's positions
// ascending, then the other subset's — the order of QuantPayload::tokens. pos[h][s]: KV head h's
// positions in subset s (1: salient), in the group's order; positions are ≥ 0.
struct ZipSlots {
  std::array<std::vector<int32_t>, 2> at;  // [subset][position] → slot, −1 where no head holds it
  int64_t n = 0, salient = 0;              // slots in all, and of the salient subset (the first ones)
  // Every head holds every position of each subset, in order: head h's k-th row of subset s
  // reads slot (s ? 0 : salient) + k, one table for all heads.
  bool one_table = false;
  int32_t of(int s, int32_t pos) const { return at[static_cast<size_t>(s)][static_cast<size_t>(pos)]; }
};
ZipSlots zip_slots(const std::vector<std::array<std::vector<int32_t>, 2>>& pos);

// ---- a row codebook ---------------------------------------------------------------------------
// One row of d values coded on its own (TurboQuant's codec; core/compress/methods/turboquant.cpp
// makes it and is the host's coder): the row x is rotated, y = H·D·pad(x) (D: the ±1 `signs`,
// H: hadamard() of size dp, the power of two ≥ d), each y_j·√dp/‖x‖ is coded by its nearest
// entry of `levels` (ascending; mse_bits bits a code; none when mse_bits is 0, x_mse = 0), and
// ‖x‖ is kept in fp16. With qjl, the residual r = x − x_mse adds sign(S·r) (S: [d][d], row-major)
// and ‖r‖ in fp16. A row's bytes: the dp codes packed (ceil(dp·mse_bits/8)), then the d sign bits
// (ceil(d/8)); its fp16 scales: ‖x‖, then ‖r‖ with qjl. Its dequantization: x_mse = the first d
// of D·H·(level·‖x‖/√dp), plus √(π/2)·‖r‖/d·Sᵀ·sign(S·r) with qjl.
struct RowCodec {
  int d = 0, dp = 0;
  int mse_bits = 0;
  bool qjl = false;
  std::vector<float> signs;   // [dp]
  std::vector<float> levels;  // [2^mse_bits]
  std::vector<float> S;       // [d][d] with qjl
  int64_t row_code_bytes() const;
  int scales_per_row() const { return qjl ? 2 : 1; }
  bool operator==(const RowCodec& o) const {
    return d == o.d && dp == o.dp && mse_bits == o.mse_bits && qjl == o.qjl && signs == o.signs && levels == o.levels &&
           S == o.S;
  }
};

// ---- rotations -------------------------------------------------------------------------------
// In place, orthonormal Walsh–Hadamard transform (H/√n, its own inverse), n a power of two: the
// butterflies in order of increasing span, then the scale 1/√n, in fp32.
void hadamard(float* x, int n);
// The same transform of each block of `block` values of x[d] (block a power of two dividing d).
void block_hadamard(float* x, int d, int block);
// Hadamard-INT4's block size for head size d: `asked`, or for 0 (auto) 16 halved until it
// divides d.
int hadamard_block(int asked, int d);

}  // namespace kvlens::quant
