// Quantize-and-pack on the device: the twins of quant::quantize_block (channel-wise / global and
// token-wise ranges) and zipcache::cst_quantize, producing the same bytes in the same layout
// (row j of codes at byte j·D·bits/8, code c at bits [c·bits, (c+1)·bits), LSB first) and the
// same fp16 scales and zero points, so a cache packed here is read by the same decode kernel;
// and ZipCache's mixed-bit groups as zipcache::quantize_group makes them.
// The arithmetic follows the host step by step: range (min/max, optional shrink), scale =
// half((β − α)/(2^b − 1)), α = half(α), code = clamp(rint((x − α)/scale), 0, 2^b − 1).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/zip_kernels.h"
#include "kernels/cuda/quant_math.cuh"

namespace kvlens::cuda {

namespace {

// Where head blockIdx.y's block starts in each array (HeadStrides).
struct HeadStrides {
  int64_t x = 0, codes = 0, ranges = 0;
};

// Ranges over rows: one block per channel (chan_stride 1) or one block for all (0); one row of
// blocks per head, one layer of rows per range group (group rows each; 0: all n).
// The block's range of every thread's (lo, hi), in thread 0's.
__device__ __forceinline__ void block_range(float& lo, float& hi) {
  __shared__ float slo[32], shi[32];
  lo = -warp_max(-lo);
  hi = warp_max(hi);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  if (l == 0) {
    slo[w] = lo;
    shi[w] = hi;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 1; i < static_cast<int>(blockDim.x >> 5); ++i) {
      lo = fminf(lo, slo[i]);
      hi = fmaxf(hi, shi[i]);
    }
}

__global__ void channel_range_kernel(const __half* x, int n, int D, int bits, int chan_stride, float shrink,
                                     int about_zero, __half* scale, __half* zero, HeadStrides hs, int group) {
  const int ch = blockIdx.x;
  x += blockIdx.y * hs.x;
  scale += blockIdx.y * hs.ranges;
  zero += blockIdx.y * hs.ranges;
  if (group > 0) {  // this block's group of rows, and its ranges after the earlier groups'
    x += static_cast<int64_t>(blockIdx.z) * group * D;
    n = min(group, n - static_cast<int>(blockIdx.z) * group);
    scale += blockIdx.z * (chan_stride ? D : 1);
    zero += blockIdx.z * (chan_stride ? D : 1);
  }
  float lo = INFINITY, hi = -INFINITY;
  const int64_t total = chan_stride ? n : static_cast<int64_t>(n) * D;
  for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
    const float v = __half2float(chan_stride ? x[i * D + ch] : x[i]);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  block_range(lo, hi);
  if (threadIdx.x == 0) {
    affine(lo, hi, bits, shrink, about_zero != 0, scale + ch, zero + ch);
  }
}

// One warp per row: the row's range of x (divided by the CST factors when given).
__global__ void token_range_kernel(const __half* x, int n, int D, int bits, const __half* factor, __half* scale,
                                   __half* zero) {
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= n) return;
  float lo = INFINITY, hi = -INFINITY;
  for (int c = lane; c < D; c += 32) {
    float v = __half2float(x[static_cast<int64_t>(row) * D + c]);
    if (factor) v = __fdiv_rn(v, __half2float(factor[c]));
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  lo = -warp_max(-lo);
  hi = warp_max(hi);
  if (lane == 0) affine(lo, hi, bits, 1.0f, true, scale + row, zero + row);
}

// One thread per (row, 8 channels): 8 codes packed into `bits` bytes.
__global__ void pack_kernel(const __half* x, int n, int D, int bits, int token, int chan_stride, const __half* factor,
                            const __half* scale, const __half* zero, uint8_t* codes, HeadStrides hs, int group) {
  x += blockIdx.y * hs.x;
  scale += blockIdx.y * hs.ranges;
  zero += blockIdx.y * hs.ranges;
  codes += blockIdx.y * hs.codes;
  const int chunks = D / 8;
  const int64_t total = static_cast<int64_t>(n) * chunks;
  for (int64_t i = threadIdx.x + static_cast<int64_t>(blockIdx.x) * blockDim.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(i / chunks), c0 = static_cast<int>(i % chunks) * 8;
    uint64_t w = 0;
    for (int c = 0; c < 8; ++c) {
      float v = __half2float(x[static_cast<int64_t>(row) * D + c0 + c]);
      int r;
      if (token) {
        r = row;
        if (factor) v = __fdiv_rn(v, __half2float(factor[c0 + c]));
      } else {
        const int gi = group > 0 ? row / group : 0;  // the row's range group
        r = chan_stride ? gi * D + c0 + c : gi;
      }
      const uint32_t code = encode(v, __half2float(zero[r]), __half2float(scale[r]), bits);
      w |= static_cast<uint64_t>(code) << (c * bits);
    }
    uint8_t* out = codes + static_cast<int64_t>(row) * (D * bits / 8) + (c0 / 8) * bits;
    put_codes8(out, w, bits);
  }
}

__global__ void cst_factor_kernel(const __half* x, int n, int D, __half* factor) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= D) return;
  float m = 0.0f;
  for (int r = 0; r < n; ++r) m = fmaxf(m, fabsf(__half2float(x[static_cast<int64_t>(r) * D + c])));
  const float f = __half2float(__float2half_rn(sqrtf(m)));
  factor[c] = (f > 0.0f && isfinite(f)) ? __float2half_rn(f) : __float2half_rn(1.0f);
}

void check_shape(int D, int bits) {
  if (D % 8 != 0 || bits < 1 || bits > 8)
    throw InternalError("quantize: head_dim must be a multiple of 8 and bits in [1, 8], got D=" + std::to_string(D) +
                        " bits=" + std::to_string(bits));
}

}  // namespace

void quantize_channel(const __half* x, int n, int D, int bits, int chan_stride, float shrink, bool about_zero,
                      uint8_t* codes, __half* scale, __half* zero, int group, cudaStream_t s) {
  quantize_channel_heads(x, 0, 1, n, D, bits, chan_stride, shrink, about_zero, codes, 0, scale, zero, 0, group, s);
}

void quantize_channel_heads(const __half* x, int64_t x_stride, int heads, int n, int D, int bits, int chan_stride, float shrink,
                            bool about_zero, uint8_t* codes, int64_t code_stride, __half* scale, __half* zero,
                            int64_t range_stride, int group, cudaStream_t s) {
  check_shape(D, bits);
  if (n == 0 || heads == 0) return;
  if (group >= n) group = 0;
  const int groups = group > 0 ? (n + group - 1) / group : 1;
  if (groups > 65535) throw InternalError("quantize: at most 65535 range groups a launch, got " + std::to_string(groups));
  if (heads > 65535) throw InternalError("quantize: at most 65535 heads a launch, got " + std::to_string(heads));
  if (x_stride != 0 && x_stride < static_cast<int64_t>(n) * D)
    throw InternalError("quantize: heads of " + std::to_string(n) + " rows " + std::to_string(x_stride) + " halves apart overlap");
  const HeadStrides hs{x_stride ? x_stride : static_cast<int64_t>(n) * D, code_stride, range_stride};
  channel_range_kernel<<<dim3(chan_stride ? D : 1, heads, groups), 256, 0, s>>>(x, n, D, bits, chan_stride, shrink,
                                                                                about_zero ? 1 : 0, scale, zero, hs, group);
  KV_LAUNCH("channel_range_kernel", std::to_string(heads) + "x" + std::to_string(n) + "x" + std::to_string(D));
  const int64_t total = static_cast<int64_t>(n) * (D / 8);
  pack_kernel<<<dim3(static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 8192)), heads), 256, 0, s>>>(
      x, n, D, bits, 0, chan_stride, nullptr, scale, zero, codes, hs, group);
  KV_LAUNCH("pack_kernel", std::to_string(heads) + "x" + std::to_string(n) + "x" + std::to_string(D));
}

namespace {

// One block a piece: the keys' channel ranges (a thread a channel) and the values' row ranges
// (a warp a row), then every row's codes, 8 channels a thread (pack_kernel's packing).
__global__ void piece_quant_kernel(const GroupPiece* pieces, int D, int bits) {
  const GroupPiece p = pieces[blockIdx.x];
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float lo = INFINITY, hi = -INFINITY;
    for (int r = 0; r < p.n; ++r) {
      const float x = __half2float(p.k[static_cast<int64_t>(r) * D + c]);
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
    affine(lo, hi, bits, 1.0f, false, p.k_scale + c, p.k_zero + c);
  }
  const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < p.n; r += warps) {
    float lo = INFINITY, hi = -INFINITY;
    for (int c = lane; c < D; c += 32) {
      const float x = __half2float(p.v[static_cast<int64_t>(r) * D + c]);
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
    lo = -warp_max(-lo);
    hi = warp_max(hi);
    if (lane == 0) affine(lo, hi, bits, 1.0f, true, p.v_scale + r, p.v_zero + r);
  }
  __syncthreads();
  const int chunks = D / 8;
  for (int i = threadIdx.x; i < 2 * p.n * chunks; i += blockDim.x) {
    const bool value = i >= p.n * chunks;
    const int j = value ? i - p.n * chunks : i;
    const int row = j / chunks, c0 = (j % chunks) * 8;
    const __half* x = (value ? p.v : p.k) + static_cast<int64_t>(row) * D + c0;
    uint64_t w = 0;
    for (int c = 0; c < 8; ++c) {
      const int r = value ? row : c0 + c;
      const __half* sc = value ? p.v_scale : p.k_scale;
      const __half* z = value ? p.v_zero : p.k_zero;
      w |= static_cast<uint64_t>(encode(__half2float(x[c]), __half2float(z[r]), __half2float(sc[r]), bits)) << (c * bits);
    }
    uint8_t* out = (value ? p.v_codes : p.k_codes) + static_cast<int64_t>(row) * (D * bits / 8) + (c0 / 8) * bits;
    put_codes8(out, w, bits);
  }
}

}  // namespace

void quantize_pieces(const GroupPiece* pieces, int n_pieces, int D, int bits, cudaStream_t s) {
  check_shape(D, bits);
  if (n_pieces == 0) return;
  piece_quant_kernel<<<n_pieces, 256, 0, s>>>(pieces, D, bits);
  KV_LAUNCH("piece_quant_kernel", std::to_string(n_pieces) + " pieces x" + std::to_string(D));
}

namespace {

// One block a row: the fp16 row through the Hadamard blocks in fp32 (quant::block_hadamard's
// order), then quantized by warp 0.
__global__ void token_rotated_kernel(const __half* x, int D, int bits, int rotation, uint8_t* codes, __half* scale,
                                     __half* zero) {
  __shared__ float row[kMaxQuantTailD];
  const int64_t r = blockIdx.x;
  for (int c = threadIdx.x; c < D; c += blockDim.x) row[c] = __half2float(x[r * D + c]);
  hadamard_blocks(row, D, rotation);  // (its first barrier follows these writes)
  __syncthreads();
  if (threadIdx.x < 32) quantize_row_warp(row, D, bits, threadIdx.x, scale + r, zero + r, codes + r * (D * bits / 8));
}

}  // namespace

void quantize_token_rotated(const __half* x, int n, int D, int bits, int rotation, uint8_t* codes, __half* scale,
                            __half* zero, cudaStream_t s) {
  check_shape(D, bits);
  if (!quant_tail_ok(D, rotation) || rotation == 0)
    throw InternalError("quantize: Hadamard blocks of " + std::to_string(rotation) + " over rows of " + std::to_string(D));
  if (n == 0) return;
  token_rotated_kernel<<<n, 64, 0, s>>>(x, D, bits, rotation, codes, scale, zero);
  KV_LAUNCH("token_rotated_kernel", std::to_string(n) + "x" + std::to_string(D));
}

void quantize_token(const __half* x, int n, int D, int bits, const __half* factor, uint8_t* codes, __half* scale,
                    __half* zero, cudaStream_t s) {
  check_shape(D, bits);
  if (n == 0) return;
  token_range_kernel<<<(n + 7) / 8, 256, 0, s>>>(x, n, D, bits, factor, scale, zero);
  KV_LAUNCH("token_range_kernel", std::to_string(n) + "x" + std::to_string(D));
  const int64_t total = static_cast<int64_t>(n) * (D / 8);
  pack_kernel<<<static_cast<int>(std::min<int64_t>((total + 255) / 256, 8192)), 256, 0, s>>>(
      x, n, D, bits, 1, 1, factor, scale, zero, codes, HeadStrides{}, 0);
  KV_LAUNCH("pack_kernel", std::to_string(n) + "x" + std::to_string(D));
}

namespace {

// Thread (group b, channel c) gathers channel c's codes of the group's 32 rows into one word, the
// code of row 32b + block_row(i) at bit i (block_row(4g + t) = 16(t >> 1) + 8(t & 1) + g); the
// rows past the last whole group are copied as they are.
__global__ void channel_major_1bit_kernel(const uint8_t* rows, int n, int D, int64_t stride, uint8_t* out) {
  rows += blockIdx.y * stride;
  out += blockIdx.y * stride;
  const int64_t groups = n / 32, row_bytes = D / 8;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < groups * D) {
    const int64_t b = t / D;
    const int c = static_cast<int>(t % D);
    const uint8_t* g = rows + 32 * b * row_bytes + c / 8;
    uint32_t w = 0;
    for (int i = 0; i < 32; ++i) {
      const int r = 16 * ((i >> 1) & 1) + 8 * (i & 1) + (i >> 2);
      w |= static_cast<uint32_t>((g[r * row_bytes] >> (c & 7)) & 1u) << i;
    }
    reinterpret_cast<uint32_t*>(out)[b * D + c] = w;
  }
  const int64_t tail0 = groups * 32 * row_bytes, tail = static_cast<int64_t>(n) * row_bytes - tail0;
  for (int64_t i = t; i < tail; i += static_cast<int64_t>(gridDim.x) * blockDim.x) out[tail0 + i] = rows[tail0 + i];
}

}  // namespace

void channel_major_1bit(const uint8_t* rows, int heads, int n, int D, int64_t stride, uint8_t* out, cudaStream_t s) {
  if (D % 8 != 0 || heads > 65535 || (stride % 4 != 0 && heads > 1))
    throw InternalError("channel_major_1bit: head size " + std::to_string(D) + " (a multiple of 8), " +
                        std::to_string(heads) + " blocks (at most 65535) " + std::to_string(stride) +
                        " bytes apart (a multiple of 4)");
  if (n == 0 || heads == 0) return;
  const int64_t work = std::max<int64_t>(static_cast<int64_t>(n / 32) * D, static_cast<int64_t>(n % 32) * (D / 8));
  channel_major_1bit_kernel<<<dim3(static_cast<unsigned>(std::max<int64_t>((work + 255) / 256, 1)), heads), 256, 0, s>>>(
      rows, n, D, stride, out);
  KV_LAUNCH("channel_major_1bit_kernel", std::to_string(heads) + "x" + std::to_string(n) + "x" + std::to_string(D));
}

namespace {

// ---- ZipCache's mixed-bit groups (ZipQuantArgs) ----
// Keys: channel blockIdx.x's range over block blockIdx.y's rows.
__global__ void zip_key_range_kernel(const __half* x, int D, const ZipBlock* blocks, __half* scale, __half* zero) {
  const ZipBlock b = blocks[blockIdx.y];
  const int ch = blockIdx.x;
  float lo = INFINITY, hi = -INFINITY;
  for (int i = threadIdx.x; i < b.n; i += blockDim.x) {
    const float v = __half2float(x[static_cast<int64_t>(b.row0 + i) * D + ch]);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  block_range(lo, hi);
  if (threadIdx.x == 0) {
    affine(lo, hi, b.bits, 1.0f, true, scale + b.range + ch, zero + b.range + ch);
  }
}

// Keys of blocks of few rows (ZipQuantArgs::max_block_rows, a streamed gap's subsets): one thread a
// (block, channel), its rows in order — the same range, without a block's reduction for a few rows.
__global__ void zip_key_range_rows_kernel(const __half* x, int D, const ZipBlock* blocks, int n_blocks, __half* scale,
                                          __half* zero) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= static_cast<int64_t>(n_blocks) * D) return;
  const ZipBlock b = blocks[t / D];
  const int ch = static_cast<int>(t % D);
  float lo = INFINITY, hi = -INFINITY;
  for (int i = 0; i < b.n; ++i) {
    const float v = __half2float(x[static_cast<int64_t>(b.row0 + i) * D + ch]);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  affine(lo, hi, b.bits, 1.0f, true, scale + b.range + ch, zero + b.range + ch);
}

// Values: CST factors of factor block blockIdx.y, one thread a channel.
__global__ void zip_factor_kernel(const __half* v, int D, const ZipFactorBlock* blocks, __half* factor) {
  const ZipFactorBlock f = blocks[blockIdx.y];
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= D) return;
  float m = 0.0f;
  for (int r = 0; r < f.n; ++r) m = fmaxf(m, fabsf(__half2float(v[static_cast<int64_t>(f.row0 + r) * D + c])));
  const float s = __half2float(__float2half_rn(sqrtf(m)));
  factor[f.at + c] = (s > 0.0f && isfinite(s)) ? __float2half_rn(s) : __float2half_rn(1.0f);
}

// Value token ranges: one warp a slot, over its rows' values divided by their blocks' factors. The
// rows' places (row, block, factors) are looked up a lane a row, 32 rows at once, and handed
// round the warp, so the rows' loads do not wait on one another's lookups (a slot shared by the
// KV heads has a row of each).
__global__ void zip_slot_range_kernel(const __half* v, int D, const ZipBlock* blocks, const int32_t* row_block,
                                      const int32_t* slot_first, const int32_t* slot_rows, int n_slots,
                                      const __half* factor, __half* scale, __half* zero) {
  const int slot = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (slot >= n_slots) return;
  float lo = INFINITY, hi = -INFINITY;
  int bits = 1;  // (a slot's rows are of one subset: their blocks' bits agree)
  const int first = slot_first[slot], last = slot_first[slot + 1];
  for (int k0 = first; k0 < last; k0 += 32) {
    int row = 0, b_bits = 1;
    long long at = 0;
    if (k0 + lane < last) {
      row = slot_rows[k0 + lane];
      const ZipBlock& b = blocks[row_block[row]];
      at = b.factor;
      b_bits = b.bits;
    }
    bits = __shfl_sync(0xffffffffu, b_bits, 0);
    const int m = min(32, last - k0);
#pragma unroll 4
    for (int i = 0; i < m; ++i) {
      const int r = __shfl_sync(0xffffffffu, row, i);
      const __half* f = factor + __shfl_sync(0xffffffffu, at, i);
      for (int c = lane; c < D; c += 32) {
        const float y = __fdiv_rn(__half2float(v[static_cast<int64_t>(r) * D + c]), __half2float(f[c]));
        lo = fminf(lo, y);
        hi = fmaxf(hi, y);
      }
    }
  }
  lo = -warp_max(-lo);
  hi = warp_max(hi);
  if (lane == 0) affine(lo, hi, bits, 1.0f, true, scale + slot, zero + slot);
}

// One thread per (row, 8 channels): the row's 8 key codes (its block's channel ranges) and 8
// value codes (divided by the factors; its slot's range), each packed into `bits` bytes.
__global__ void zip_pack_kernel(ZipQuantArgs a) {
  const int D = a.D, chunks = D / 8;
  const int64_t total = static_cast<int64_t>(a.N) * chunks;
  for (int64_t i = threadIdx.x + static_cast<int64_t>(blockIdx.x) * blockDim.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(i / chunks), c0 = static_cast<int>(i % chunks) * 8;
    const ZipBlock b = a.blocks[a.row_block[row]];
    const int slot = a.row_slot[row];
    const float ts = __half2float(a.t_scale[slot]), tz = __half2float(a.t_zero[slot]);
    const __half* k = a.x + static_cast<int64_t>(row) * D + c0;
    const __half* v = a.x + (static_cast<int64_t>(a.N) + row) * D + c0;
    uint64_t wk = 0, wv = 0;
    for (int c = 0; c < 8; ++c) {
      const int64_t r = b.range + c0 + c;
      const uint32_t ck = encode(__half2float(k[c]), __half2float(a.k_zero[r]), __half2float(a.k_scale[r]), b.bits);
      const float y = __fdiv_rn(__half2float(v[c]), __half2float(a.factor[b.factor + c0 + c]));
      const uint32_t cv = encode(y, tz, ts, b.bits);
      wk |= static_cast<uint64_t>(ck) << (c * b.bits);
      wv |= static_cast<uint64_t>(cv) << (c * b.bits);
    }
    const int64_t at = b.code + static_cast<int64_t>(row - b.row0) * (D * b.bits / 8) + (c0 / 8) * b.bits;
    for (int j = 0; j < b.bits; ++j) {
      a.k_codes[at + j] = static_cast<uint8_t>(wk >> (8 * j));
      a.v_codes[at + j] = static_cast<uint8_t>(wv >> (8 * j));
    }
    if (a.row_scale && c0 == 0) {
      a.row_scale[row] = a.t_scale[slot];
      a.row_zero[row] = a.t_zero[slot];
    }
  }
}

}  // namespace

void zip_quantize(const ZipQuantArgs& a, cudaStream_t s) {
  check_shape(a.D, 1);
  if (a.N == 0) return;
  if (a.n_blocks > 65535 || a.n_factor_blocks > 65535)
    throw InternalError("zip_quantize: at most 65535 blocks a launch, got " + std::to_string(a.n_blocks));
  const std::string what = std::to_string(a.N) + "x" + std::to_string(a.D);
  if (a.max_block_rows > 0 && a.max_block_rows <= kZipFewRows) {
    const int64_t threads = static_cast<int64_t>(a.n_blocks) * a.D;
    zip_key_range_rows_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, s>>>(a.x, a.D, a.blocks, a.n_blocks,
                                                                                           a.k_scale, a.k_zero);
    KV_LAUNCH("zip_key_range_rows_kernel", what);
  } else {
    zip_key_range_kernel<<<dim3(a.D, a.n_blocks), 128, 0, s>>>(a.x, a.D, a.blocks, a.k_scale, a.k_zero);
    KV_LAUNCH("zip_key_range_kernel", what);
  }
  const __half* v = a.x + static_cast<int64_t>(a.N) * a.D;
  zip_factor_kernel<<<dim3((a.D + 127) / 128, a.n_factor_blocks), 128, 0, s>>>(v, a.D, a.factor_blocks, a.factor);
  KV_LAUNCH("zip_factor_kernel", what);
  zip_slot_range_kernel<<<(a.n_slots + 7) / 8, 256, 0, s>>>(v, a.D, a.blocks, a.row_block, a.slot_first, a.slot_rows,
                                                            a.n_slots, a.factor, a.t_scale, a.t_zero);
  KV_LAUNCH("zip_slot_range_kernel", what);
  const int64_t total = static_cast<int64_t>(a.N) * (a.D / 8);
  zip_pack_kernel<<<static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 8192)), 256, 0, s>>>(a);
  KV_LAUNCH("zip_pack_kernel", what);
}

void cst_factors(const __half* x, int n, int D, __half* factor, cudaStream_t s) {
  if (D == 0) return;
  cst_factor_kernel<<<(D + 127) / 128, 128, 0, s>>>(x, n, D, factor);
  KV_LAUNCH("cst_factor_kernel", std::to_string(n) + "x" + std::to_string(D));
}

}  // namespace kvlens::cuda
