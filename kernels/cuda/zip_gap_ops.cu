// ZipCache's streamed gap scored, ranked and planned on the device (kv_zip_gap.cu runs them
// before zip_quantize): zip_gap_saliency (zipcache::gap_saliency's reduction), zip_rank_gap, the
// twin of zipcache::rank_gap, and zip_gap_plan, which lays the ranked rows out as zip_quantize
// reads them. Nothing about a gap's layout depends on its ranking but which rows go where, so the
// blocks (zip_gap_layout) are the same for every gap and the host never waits for the ranking.
// The gaps' store (zip_store_layout) holds every gap's arrays as two parts a KV head, a gap's
// copied there by zip_store_gap.
#include <algorithm>
#include <string>

#include "core/errors.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/zip_kernels.h"

namespace kvlens::cuda {

namespace {

constexpr int kThreads = 256;

// One block per (KV head, layer) over its query heads (outer) and probes (inner): each gap row a
// probe saw scored by a warp (scaled, as the decode scores it), its probability under the probe's
// softmax state from its own step added (in double) by that warp's first lane, which owns the
// row — so each row's sum is in the host's order.
__global__ void __launch_bounds__(kThreads)
    zip_gap_saliency_kernel(const float* __restrict__ q, const float2* __restrict__ md, ZipGapRows rows, int D,
                            float scale, int S, int NH, int NKV, int gap, const int32_t* __restrict__ n_probes,
                            const int32_t* __restrict__ seen, bool accumulated, double* __restrict__ out) {
  const int kh = blockIdx.x, l = blockIdx.y, G = NH / NKV, np = n_probes[l];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kWarps = kThreads / 32;
  double* o = out + (static_cast<int64_t>(l) * NKV + kh) * gap;
  for (int j = threadIdx.x; j < gap; j += kThreads) o[j] = 0.0;
  __syncthreads();
  const __half* K = rows.k[l] + (static_cast<int64_t>(kh) * rows.cap + rows.first) * D;
  for (int h = kh * G; h < (kh + 1) * G; ++h)
    for (int k = 0; k < np; ++k) {
      const int b = l * S + k, n_seen = min(seen[b], gap);
      const float2 st = md[static_cast<int64_t>(b) * NH + h];
      if (!(st.y > 0.0f)) continue;
      const float* qh = q + (static_cast<int64_t>(b) * NH + h) * D;
      for (int j = warp; j < n_seen; j += kWarps) {
        float d = 0.0f;
        for (int c = lane; c < D; c += 32) d = fmaf(qh[c], __half2float(K[static_cast<int64_t>(j) * D + c]), d);
        for (int m = 16; m > 0; m >>= 1) d += __shfl_xor_sync(0xffffffffu, d, m);
        if (lane == 0) o[j] += exp(static_cast<double>(d * scale) - st.x) / st.y;
      }
    }
  if (accumulated) return;
  __syncthreads();
  // Each row's (probe, head) pairs: those that saw it, with a state (as the host counts the pairs
  // whose softmax sum is positive).
  for (int j = threadIdx.x; j < gap; j += kThreads) {
    int c = 0;
    for (int h = kh * G; h < (kh + 1) * G; ++h)
      for (int k = 0; k < np; ++k) {
        const int b = l * S + k;
        c += seen[b] > j && md[static_cast<int64_t>(b) * NH + h].y > 0.0f;
      }
    o[j] = c > 0 ? o[j] / c : 0.0;
  }
}

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

// One warp a run: 16 bytes a lane where the run's ends and both places allow, else a byte.
__global__ void __launch_bounds__(kThreads)
    zip_store_kernel(const ZipStoreRun* __restrict__ runs, int n, const char* __restrict__ result,
                     char* __restrict__ store, int gi) {
  const int r = blockIdx.x * (kThreads / 32) + static_cast<int>(threadIdx.x / 32), lane = threadIdx.x % 32;
  if (r >= n) return;
  const ZipStoreRun x = runs[r];
  const char* from = result + x.src;
  char* to = store + x.dst + static_cast<int64_t>(gi) * x.bytes;
  if (((reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to) | static_cast<uintptr_t>(x.bytes)) & 15) == 0) {
    for (int64_t i = lane; i < x.bytes / 16; i += 32)
      reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
  } else {
    for (int64_t i = lane; i < x.bytes; i += 32) to[i] = from[i];
  }
}

}  // namespace

ZipStoreLayout zip_store_layout(const ZipGapLayout& Z, const ZipGapResult& r, int L, int NKV, int gap, int k, int D,
                                int hi_bits, int lo_bits, bool layer_factors, int gaps) {
  if (gap <= 0 || k < 0 || k > gap || gaps < 0 || static_cast<int64_t>(Z.head_code.size()) != NKV)
    throw InternalError("zip_store_layout: " + std::to_string(gaps) + " gaps of " + std::to_string(gap) + " rows (" +
                        std::to_string(k) + " salient) over blocks of " + std::to_string(Z.head_code.size()) +
                        " KV heads, " + std::to_string(NKV) + " asked");
  ZipStoreLayout S;
  S.gaps = gaps;
  S.n[0] = gap - k;
  S.n[1] = k;
  S.bits[0] = lo_bits;
  S.bits[1] = hi_bits;
  const int64_t fb = (gap + 7) / 8;
  ArrayLayout at{0, 16};  // (the kernels' 16-byte loads of ranges and factors)
  S.sub.resize(static_cast<size_t>(L) * NKV);
  S.flags.resize(static_cast<size_t>(L) * NKV);
  auto run = [&](int64_t src, int64_t dst, int64_t bytes) { S.runs.push_back({src, dst, bytes}); };
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < NKV; ++h) {
      const size_t lh = static_cast<size_t>(l) * NKV + h;
      const int64_t row0 = static_cast<int64_t>(lh) * gap;  // (the head's first row in the gap's arrays)
      const int64_t code0 = l * Z.layer_code + Z.head_code[static_cast<size_t>(h)];
      const int64_t range0 = l * Z.layer_range + Z.head_range[static_cast<size_t>(h)];
      const int64_t factor0 = l * Z.layer_factor + Z.head_factor[static_cast<size_t>(h)];
      const int64_t vs_src = r.out.rs >= 0 ? r.out.rs : r.out.ts, vz_src = r.out.rz >= 0 ? r.out.rz : r.out.tz;
      int64_t code = 0, row = 0, block = 0;  // (within the head, salient subset first)
      for (int s = 1; s >= 0; --s) {
        const int64_t n = S.n[s];
        if (n == 0) continue;
        ZipStoreLayout::Subset& x = S.sub[lh][static_cast<size_t>(s)];
        const int64_t cb = n * D * S.bits[s] / 8;
        x.kc = at.put(gaps * cb);
        run(r.out.kc + code0 + code, x.kc, cb);
        x.vc = at.put(gaps * cb);
        run(r.out.vc + code0 + code, x.vc, cb);
        x.ks = at.put(gaps * D * 2LL);
        run(r.out.ks + (range0 + block * D) * 2, x.ks, D * 2LL);
        x.kz = at.put(gaps * D * 2LL);
        run(r.out.kz + (range0 + block * D) * 2, x.kz, D * 2LL);
        x.vs = at.put(gaps * n * 2);
        run(vs_src + (row0 + row) * 2, x.vs, n * 2);
        x.vz = at.put(gaps * n * 2);
        run(vz_src + (row0 + row) * 2, x.vz, n * 2);
        if (!layer_factors) {
          x.f = at.put(gaps * D * 2LL);
          run(r.out.f + (factor0 + block * D) * 2, x.f, D * 2LL);
        }
        code += cb;
        row += n;
        ++block;
      }
      if (layer_factors) {  // (one array a head, read by both subsets)
        const int64_t f = at.put(gaps * D * 2LL);
        run(r.out.f + factor0 * 2, f, D * 2LL);
        for (ZipStoreLayout::Subset& x : S.sub[lh])
          if (x.kc >= 0) x.f = f;
      }
      S.flags[lh] = at.put(gaps * fb);
      run(r.flags + static_cast<int64_t>(lh) * fb, S.flags[lh], fb);
    }
  for (int l = 0; l < L; ++l) {
    S.pos.push_back(at.put(static_cast<int64_t>(NKV) * gaps * gap * 4));
    S.order.push_back(at.put(static_cast<int64_t>(NKV) * gaps * gap * 4));
    for (int h = 0; h < NKV; ++h) {
      const int64_t src = (static_cast<int64_t>(l) * NKV + h) * gap * 4, dst = static_cast<int64_t>(h) * gaps * gap * 4;
      run(r.pos + src, S.pos.back() + dst, gap * 4LL);
      run(r.order + src, S.order.back() + dst, gap * 4LL);
    }
  }
  S.bytes = at.bytes;
  return S;
}

void zip_store_gap(const ZipStoreRun* runs, int n, const char* result, char* store, int gi, cudaStream_t s) {
  if (n <= 0) return;
  constexpr int per = kThreads / 32;
  zip_store_kernel<<<(n + per - 1) / per, kThreads, 0, s>>>(runs, n, result, store, gi);
  KV_LAUNCH("zip_store_kernel", std::to_string(n) + " runs, gap " + std::to_string(gi));
}

void zip_gap_saliency(const float* q, const float2* md, const ZipGapRows& rows, int D, float scale, int L, int S,
                      int NH, int NKV, int gap, const int32_t* n_probes, const int32_t* seen, bool accumulated,
                      double* out, cudaStream_t s) {
  if (L <= 0 || NKV <= 0 || gap <= 0) return;
  zip_gap_saliency_kernel<<<dim3(NKV, L), kThreads, 0, s>>>(q, md, rows, D, scale, S, NH, NKV, gap, n_probes, seen,
                                                            accumulated, out);
  KV_CUDA(cudaGetLastError(), "zip_gap_saliency launch");
}

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
