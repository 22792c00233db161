// ZipCache's streamed gap ranked and planned on the device (kv_zip_gap.cu runs them between the
// gap's saliency and zip_quantize): zip_rank_gap, the twin of zipcache::rank_gap, and
// zip_gap_plan, which lays the ranked rows out as zip_quantize reads them. Nothing about a gap's
// layout depends on its ranking but which rows go where, so the blocks (zip_gap_layout) are the
// same for every gap and the host never waits for the ranking.
#include <algorithm>
#include <string>

#include "core/errors.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/zip_kernels.h"

namespace kvlens::cuda {

namespace {

constexpr int kThreads = 256;

// One block per (KV head, layer): the head's ranking key (its saliency, or every head's summed in
// head order), each row's rank in descending key order with ties to the earlier row (salient: rank
// < k, as many as k), then each row's place among its subset and the packed flags.
__global__ void __launch_bounds__(kThreads)
    zip_rank_gap_kernel(const double* __restrict__ sal, int NKV, int gap, int k, bool shared, double* __restrict__ key,
                        uint8_t* __restrict__ salient, int32_t* __restrict__ order, uint8_t* __restrict__ flags) {
  const int h = blockIdx.x, l = blockIdx.y;
  const int64_t at = (static_cast<int64_t>(l) * NKV + h) * gap;
  double* s = key + at;
  uint8_t* f = salient + at;
  for (int j = threadIdx.x; j < gap; j += blockDim.x) {
    double x = 0.0;
    if (shared) {
      for (int g = 0; g < NKV; ++g) x += sal[(static_cast<int64_t>(l) * NKV + g) * gap + j];
    } else {
      x = sal[at + j];
    }
    s[j] = x;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < gap; j += blockDim.x) {
    const double x = s[j];
    int rank = 0;
    for (int i = 0; i < gap && rank < k; ++i) {
      const double y = s[i];
      rank += (y > x || (y == x && i < j)) ? 1 : 0;
    }
    f[j] = rank < k ? 1 : 0;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < gap; j += blockDim.x) {
    const uint8_t mine = f[j];
    int before = 0;
    for (int i = 0; i < j; ++i) before += f[i] == mine ? 1 : 0;
    order[at + (mine ? before : k + before)] = j;
  }
  const int fb = (gap + 7) / 8;
  for (int b = threadIdx.x; b < fb; b += blockDim.x) {
    uint32_t w = 0;
    for (int i = 0; i < 8 && 8 * b + i < gap; ++i) w |= static_cast<uint32_t>(f[8 * b + i]) << i;
    flags[(static_cast<int64_t>(l) * NKV + h) * fb + b] = static_cast<uint8_t>(w);
  }
}

// One block per layer: each row's source (its head's tail row), slot and place in its slot's list,
// and the gap's positions in the rows' own order. Slots shared by the heads: (salient, j) at
// 2·gap·l + j, (other, j) at 2·gap·l + gap + j, each listing its heads' rows in head order.
__global__ void __launch_bounds__(kThreads)
    zip_gap_plan_kernel(ZipGapRows rows, int NKV, int gap, int k, int D, bool shared_ranges,
                        const int32_t* __restrict__ order, const uint8_t* __restrict__ salient, const __half** src,
                        int32_t* __restrict__ row_slot, int32_t* __restrict__ slot_first,
                        int32_t* __restrict__ slot_rows, int32_t* __restrict__ pos_out) {
  __shared__ int scan[kThreads];
  __shared__ int carry;
  const int l = blockIdx.x, L = gridDim.x;
  const int64_t per = static_cast<int64_t>(NKV) * gap, r0 = l * per, N = per * L;
  const __half* K = rows.k[l];
  const __half* V = rows.v[l];
  const int32_t* P = rows.pos[l];
  for (int64_t x = threadIdx.x; x < per; x += blockDim.x) {
    const int h = static_cast<int>(x / gap), i = static_cast<int>(x % gap);
    const int64_t tail_row = static_cast<int64_t>(h) * rows.cap + rows.first;
    const int j = order[r0 + x];
    src[r0 + x] = K + (tail_row + j) * D;
    src[N + r0 + x] = V + (tail_row + j) * D;
    pos_out[r0 + x] = P[tail_row + i];
    if (!shared_ranges) {
      row_slot[r0 + x] = static_cast<int32_t>(r0 + x);
      slot_first[r0 + x] = static_cast<int32_t>(r0 + x);
      slot_rows[r0 + x] = static_cast<int32_t>(r0 + x);
    }
  }
  if (!shared_ranges) {
    if (l == L - 1 && threadIdx.x == 0) slot_first[N] = static_cast<int32_t>(N);
    return;
  }
  const uint8_t* F = salient + r0;
  const int64_t s0 = static_cast<int64_t>(l) * 2 * gap;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  // The salient slots' first rows by a running sum of each position's salient heads; the other
  // subset's follow all of them (NKV·k rows), position j after j·NKV rows less the salient ones.
  for (int base = 0; base < gap; base += blockDim.x) {
    const int j = base + threadIdx.x;
    int c1 = 0;
    for (int h = 0; j < gap && h < NKV; ++h) c1 += F[static_cast<int64_t>(h) * gap + j];
    scan[threadIdx.x] = c1;
    __syncthreads();
    for (int o = 1; o < blockDim.x; o <<= 1) {
      const int add = threadIdx.x >= o ? scan[threadIdx.x - o] : 0;
      __syncthreads();
      scan[threadIdx.x] += add;
      __syncthreads();
    }
    const int p1 = carry + scan[threadIdx.x] - c1;
    if (j < gap) {
      slot_first[s0 + j] = static_cast<int32_t>(r0 + p1);
      slot_first[s0 + gap + j] = static_cast<int32_t>(r0 + static_cast<int64_t>(NKV) * k + static_cast<int64_t>(j) * NKV - p1);
    }
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) carry += scan[threadIdx.x];
    __syncthreads();
  }
  for (int64_t x = threadIdx.x; x < per; x += blockDim.x) {
    const int h = static_cast<int>(x / gap), i = static_cast<int>(x % gap);
    const int j = order[r0 + x];
    const uint8_t s = i < k ? 1 : 0;
    int in_slot = 0;
    for (int g = 0; g < h; ++g) in_slot += F[static_cast<int64_t>(g) * gap + j] == s ? 1 : 0;
    const int64_t slot = s0 + (s ? j : gap + j);
    row_slot[r0 + x] = static_cast<int32_t>(slot);
    slot_rows[slot_first[slot] + in_slot] = static_cast<int32_t>(r0 + x);
  }
  if (l == L - 1 && threadIdx.x == 0) slot_first[static_cast<int64_t>(L) * 2 * gap] = static_cast<int32_t>(N);
}

}  // namespace

void zip_rank_gap(const double* sal, int L, int NKV, int gap, int k, bool shared, double* key, uint8_t* salient,
                  int32_t* order, uint8_t* flags, cudaStream_t s) {
  if (L <= 0 || NKV <= 0 || gap <= 0) return;
  if (k < 0 || k > gap || L > 65535 || NKV > 65535)
    throw InternalError("zip_rank_gap: " + std::to_string(k) + " salient rows of " + std::to_string(gap) + ", " +
                        std::to_string(L) + " layers and " + std::to_string(NKV) + " KV heads (at most 65535 each)");
  zip_rank_gap_kernel<<<dim3(NKV, L), kThreads, 0, s>>>(sal, NKV, gap, k, shared, key, salient, order, flags);
  KV_LAUNCH("zip_rank_gap_kernel", std::to_string(L) + "x" + std::to_string(NKV) + "x" + std::to_string(gap));
}

void zip_gap_plan(const ZipGapRows& rows, int L, int NKV, int gap, int k, int D, bool shared_ranges,
                  const int32_t* order, const uint8_t* salient, const __half** src, int32_t* row_slot,
                  int32_t* slot_first, int32_t* slot_rows, int32_t* pos_out, cudaStream_t s) {
  if (L <= 0 || NKV <= 0 || gap <= 0) return;
  if (static_cast<int64_t>(L) * NKV * gap * 2 >= (int64_t{1} << 31) || k < 0 || k > gap)
    throw InternalError("zip_gap_plan: " + std::to_string(L) + " layers of " + std::to_string(NKV) + " KV heads' " +
                        std::to_string(gap) + "-row gaps (" + std::to_string(k) + " salient)");
  zip_gap_plan_kernel<<<L, kThreads, 0, s>>>(rows, NKV, gap, k, D, shared_ranges, order, salient, src, row_slot,
                                             slot_first, slot_rows, pos_out);
  KV_LAUNCH("zip_gap_plan_kernel", std::to_string(L) + "x" + std::to_string(NKV) + "x" + std::to_string(gap));
}

ZipGapLayout zip_gap_layout(int L, int NKV, int gap, int k, int D, int hi_bits, int lo_bits, bool layer_factors) {
  ZipGapLayout z;
  const int n[2] = {gap - k, k}, bits[2] = {lo_bits, hi_bits};
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < NKV; ++h) {
      const int32_t first = (l * NKV + h) * gap;
      if (l == 0) {
        z.head_code.push_back(z.code);
        z.head_range.push_back(z.range);
        z.head_factor.push_back(z.factor);
      }
      int32_t row = first;
      for (int s = 1; s >= 0; --s) {
        if (n[s] == 0) continue;
        ZipBlock b;
        b.row0 = row;
        b.n = n[s];
        b.bits = bits[s];
        b.code = z.code;
        b.range = z.range;
        b.factor = z.factor;
        if (!layer_factors) {
          z.factor_blocks.push_back({b.row0, b.n, z.factor});
          z.factor += D;
        }
        z.row_block.insert(z.row_block.end(), static_cast<size_t>(b.n), static_cast<int32_t>(z.blocks.size()));
        z.code += static_cast<int64_t>(b.n) * D * b.bits / 8;
        z.range += D;
        row += b.n;
        z.blocks.push_back(b);
      }
      if (layer_factors) {
        z.factor_blocks.push_back({first, gap, z.factor});
        z.factor += D;
      }
    }
  if (L > 0) {
    z.layer_code = z.code / L;
    z.layer_range = z.range / L;
    z.layer_factor = z.factor / L;
  }
  return z;
}

}  // namespace kvlens::cuda
