// 1-bit channel-wise parts of decode attention on the binary tensor-core path (head size 128;
// included by decode_attention.cu after decode_i8.cuh, whose integer path takes the rows past a
// part's last whole group of 32).
//
// Layout (KvFormat kChannelT, kernels.h): keys as core/compress/quantize.h packs them (row j's
// 128 codes in 4 words, channel 32w + i at bit i of word w); values in groups of 32 rows stored
// channel-major — group b's 128 words, word c holding channel c's codes of the group's rows, row
// 32b + block_row(i) at bit i, block_row(4g + t) = 16(t >> 1) + 8(t & 1) + g — and the rows past
// the last whole group row-major (quant::channel_major_1bit builds it; same bytes).
//
// Staging: a 128-row tile's codes are contiguous (2 KiB of keys, 2 KiB of values); each warp
// keeps the next kB1Stages − 1 of its tiles in flight into its shared-memory stages with cp.async
// while it computes this one, so nothing in flight occupies registers (DecodeParams::b1 gives the
// blocks kB1StageBytes).
// Keys: S = K·U on `mma.m16n8k128.b1` (AND + POPC), A = the codes exactly as they lie (lane (g, t)
// takes word t of rows g and g+8 of a 16-row tile), B = bit planes of U = round(σ·q⊙scale), a
// 24-bit two's-complement integer (σ a power of two that puts max |q⊙scale| at 2^22; CalibQuant's
// post-scaling), built once per part by the block (one channel a thread, a ballot a plane).
// Three mma (planes 0–7, 8–15, 16–23) give a popcount per row and plane; each lane weighs its
// planes by 2^plane (−2^23 for the sign plane) in integer arithmetic, and three shuffles per two
// tiles sum a quad's planes, leaving every lane one row's exact Σ U_c·code_c — row
// 32c' + block_row(lane) of the tile pair c' — which 1/σ and q·zero turn into the score.
// Softmax: one maximum per 128 rows and warp (g(x) applied first on calibrated parts); the weight
// p = exp(s − m) becomes the 16-bit integer P = round(65535·p), used for both the values'
// product and the part's sum, so each row's weight is the same in both.
// Values: O^T = V^T·P on the same instruction. A = the channel-major words (lane (g, t) takes
// the 16 words of channels 16g..16g+15 of group t, stored with their 16-byte chunks rotated by t
// so the four lanes of a quad hit different banks); B = bit planes of P, built by two 32×32 bit
// transposes across the warp (each lane's four P in two words, five shuffle stages each), which
// leave plane m of group t in the lane the fragment wants after one more shuffle. Two mma per 16
// channels (planes 0–7 and 8–15) accumulate popcounts in the mma's integer accumulators for as
// long as the running maximum stays; when it moves, and at the end, each lane weighs its planes'
// counts by 2^plane into fp32 sums, which the move's factor rescales. At the end of the part
// scale_c·Σ P·code + zero_c·Σ P (÷ 65535) joins the warp's state as in decode_mma.cuh.
// Per 128 rows and warp: 24 + 16 mma and about 510 other instructions in an H100 profile at batch
// 1 / 64k (4.3 a row, against about 14 on the fp16-operand path), ~110 of them issuing the tile's
// copies before their addresses were made fixed offsets; decode_kernel<16, 2> takes 168
// registers, with 72 bytes spilled (ptxas -v; 28 before the fixed offsets and the one-instruction
// maximum, which were faster nonetheless). That loop is bound by its own latency (12 warps a
// multiprocessor, half an eligible warp a scheduler): a fifth of the samples wait for the tile's
// copy, the rest for the shuffles and mma of the scores, the maximum and the bit transposes.
// Forcing 128 registers (four blocks a multiprocessor) spills more and was 30–40 % slower.
// Where the grid fits two blocks a multiprocessor (batch 1) or the blocks are long (4096 rows or
// more: decode_b1_pair), decode_kernel<16, 3> takes two 128-row sub-tiles an iteration (PAIR = 2:
// 8 KiB a stage, one maximum and one flush test for both) under 238 registers without spills:
// 6 % faster at batch 1 / 64k (13 % with calibration), 7–17 % at batch 16 / 4k–64k with one
// split a head; three stages were no faster.
#pragma once

namespace kvlens::cuda::b1_path {

// d += popcount(A AND B) (16 × 8 × 128 bits); bmma starts from zero.
__device__ __forceinline__ void bmma_acc(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
  asm volatile("mma.sync.aligned.m16n8k128.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a0), "r"(a1), "r"(b));
}
__device__ __forceinline__ void bmma(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
  d[0] = d[1] = d[2] = d[3] = 0;
  bmma_acc(d, a0, a1, b);
}

// Lane L holds row L of a 32×32 bit matrix; returns column `lane` (bit i = bit lane of lane i's
// row). Stage j swaps the off-diagonal j×j blocks: a rotation by j (or 32 − j) and one select.
__device__ __forceinline__ uint32_t transpose32(uint32_t x, int lane) {
#pragma unroll
  for (int s = 0; s < 5; ++s) {
    const int j = 16 >> s;
    constexpr uint32_t kLow[5] = {0x0000ffffu, 0x00ff00ffu, 0x0f0f0f0fu, 0x33333333u, 0x55555555u};
    const bool up = (lane & j) == 0;
    const uint32_t m = up ? kLow[s] : ~kLow[s];
    const uint32_t y = __shfl_xor_sync(0xffffffffu, x, j);
    const uint32_t r = __funnelshift_l(y, y, up ? j : 32 - j);
    x = (x & m) | (r & ~m);
  }
  return x;
}

// The end of a part: a quad's planes summed, channels handed to lanes 0..15 (8 each) and the
// part's state (scale_c·Σ P·code + zero_c·Σ P, ÷ 65535; vsz: the part's value scales and zeros by
// channel) merged into theirs.
__device__ __forceinline__ void merge_part(const float (&vsz)[2][128], float (&acc)[8][2], float dsum, float mw,
                                           State& st_io) {
  const int lane = threadIdx.x & 31;
  // The quad's planes summed: lane (g, 0) holds channels 16g + 2u + h in acc[u][h].
#pragma unroll
  for (int u = 0; u < 8; ++u)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      acc[u][h] += __shfl_xor_sync(0xffffffffu, acc[u][h], 1);
      acc[u][h] += __shfl_xor_sync(0xffffffffu, acc[u][h], 2);
    }
  const float psum = warp_sum(dsum) * (1.0f / 65535.0f);
  // Lane li of 0..15 takes channels 8li..8li+7 from lane 4(li >> 1).
  const int src = 4 * ((lane & 15) >> 1), odd = lane & 1;
  float raw[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float v0 = __shfl_sync(0xffffffffu, acc[k >> 1][k & 1], src);
    const float v1 = __shfl_sync(0xffffffffu, acc[4 + (k >> 1)][k & 1], src);
    raw[k] = (odd ? v1 : v0) * (1.0f / 65535.0f);
  }
  if (lane >= 16 || mw == -INFINITY) return;
  float o[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int c = 8 * lane + k;
    o[k] = vsz[0][c] * raw[k] + vsz[1][c] * psum;
  }
  join_part(st_io, mw, psum, o);
}

// Rows [a, e) of a kChannelT part (e at most its last whole group's end) for this warp: warp w of
// nw takes the 128·PAIR-row tiles w, w + nw, ... counted from a rounded down to a group. RANGE:
// min / max of the scores into lo / hi only; otherwise the part's softmax state is merged into
// st_io of lanes 0..15 (8 channels a lane). qs: the block's scaled query in shared memory.
// PAIR = 2: two 128-row sub-tiles an iteration, their chains of scores, maximum, transposes and
// value products independent until they meet in the accumulators, so one warp keeps twice the
// work in flight (the kernel then runs two blocks a multiprocessor, with up to 255 registers).
// vsc (the part's row 0 in DecodeParams::vis_scores, or null): RANGE writes each row's raw
// score there; SCORES (attention with calibration) reads them instead of the keys: a tile's
// scores are copied into the stage's key chunks (from the 16-byte boundary at or before its
// first row's, so one more chunk) and the key codes are neither copied nor multiplied.
template <bool RANGE, int PAIR, bool SCORES = false>
__device__ __noinline__ void packed_b1(const PartDesc& P, int a, int e, const float* qs, int warp, int nw, bool cal,
                                       float cal_t, float cal_g, float tau1, State& st_io, float& lo, float& hi,
                                       uint4* stage, float* vsc) {
  static_assert(!(RANGE && SCORES), "the range pass computes the scores");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, t0 = t & 1, t1 = t >> 1;
  const uint32_t* K = static_cast<const uint32_t*>(P.k.data);
  const uint4* V = static_cast<const uint4*>(P.v.data);
  const int kst = P.k.chan_stride;

  const int a32 = a & ~31;
  constexpr int TR = 128 * PAIR;  // rows a tile
  const int tiles = (e - a32 + TR - 1) / TR;
  // A tile's codes are contiguous: TR key rows of 16 bytes, and TR / 32 value groups of 512 bytes.
  // They are copied to this warp's kB1Stages shared-memory stages with cp.async, kB1Stages − 1
  // tiles ahead, so those copies are in flight while this tile is computed without holding
  // registers. Every iteration commits one group (empty past the last tile), so waiting for all
  // but the newest kB1Stages − 1 groups is waiting for this tile.
  // Rows past e are not copied (their stale bytes are masked: score −inf, weight 0).
  constexpr int SZ = (RANGE ? 128 : 256) * PAIR;  // a stage's 16-byte chunks
  uint4* const buf = stage + warp * (kB1Stages * SZ);
  // Tile i's key chunk c is chunk a32 + TR·i + c of the keys, and its value group's chunk c chunk
  // a32 + TR·i + c of the values (a group of 32 rows is 32 chunks): this lane's chunks lane + 32k
  // are at fixed offsets from two pointers that advance TR chunks a tile, and land at fixed
  // offsets in the stage (values' chunk q of group k at TR + 32k + (q ^ (k mod 4))).
  const uint4* const ksrc = reinterpret_cast<const uint4*>(K) + a32 + lane;
  const uint4* const vsrc = V + a32 + lane;
  // SCORES: tile i's scores start `soff` floats into chunk 0 of the copy from ssrc + TR·i / 4.
  const int soff = SCORES ? static_cast<int>((reinterpret_cast<uintptr_t>(vsc + a32) & 15) >> 2) : 0;
  const uint4* const ssrc = SCORES ? reinterpret_cast<const uint4*>(vsc + a32 - soff) : nullptr;
  const uint32_t sbase = smem_addr(buf);
  auto vdst = [&](int k) { return 16u * static_cast<uint32_t>(TR + 32 * k + (lane ^ (k & 3))); };
  auto issue = [&](int i, int sg) {
    if (i < tiles) {
      const int r0 = a32 + TR * i;
      const uint32_t sk = sbase + 16u * static_cast<uint32_t>(sg * SZ);
      const uint4* kp = ksrc + TR * static_cast<int64_t>(i);
      const uint4* vp = vsrc + TR * static_cast<int64_t>(i);
      if constexpr (SCORES) {
        // TR / 4 + 1 chunks of scores (past e: stale, masked; kDecodeScorePad keeps them in bounds).
        const uint4* sp = ssrc + (TR / 4) * static_cast<int64_t>(i);
#pragma unroll
        for (int k = 0; k < PAIR; ++k) cp_async16(sk + 16u * (lane + 32 * k), sp + lane + 32 * k);
        if (lane == 0) cp_async16(sk + 16u * (TR / 4), sp + TR / 4);
#pragma unroll
        for (int k = 0; k < 4 * PAIR; ++k)
          if (r0 + 32 * k < e) cp_async16(sk + vdst(k), vp + 32 * k);
      } else if (r0 + TR <= e) {  // a whole tile: no row checks
#pragma unroll
        for (int k = 0; k < 4 * PAIR; ++k) cp_async16(sk + 16u * (lane + 32 * k), kp + 32 * k);
        if constexpr (!RANGE) {
#pragma unroll
          for (int k = 0; k < 4 * PAIR; ++k) cp_async16(sk + vdst(k), vp + 32 * k);
        }
      } else {
#pragma unroll
        for (int k = 0; k < 4 * PAIR; ++k)
          if (r0 + lane + 32 * k < e) cp_async16(sk + 16u * (lane + 32 * k), kp + 32 * k);
        if constexpr (!RANGE) {
#pragma unroll
          for (int k = 0; k < 4 * PAIR; ++k)
            if (r0 + 32 * k < e) cp_async16(sk + vdst(k), vp + 32 * k);
        }
      }
    }
    cp_async_commit();
  };

  // Channel c's key and value ranges (thread c of the block) are read first: issued behind the
  // first tiles' copies they queued behind every multiprocessor's, and their wait was a tenth of
  // the kernel's samples at batch 16 / 4k (an H100 profile). The first tiles' copies follow at
  // once, so that their trip to memory overlaps the query's preparation below.
  const int c = threadIdx.x;
  const __half k_scale = P.k.scale[c * kst], k_zero = P.k.zero[c * kst];
  __half v_scale = __ushort_as_half(0), v_zero = __ushort_as_half(0);
  if constexpr (!RANGE) {
    v_scale = P.v.scale[c * P.v.chan_stride];
    v_zero = P.v.zero[c * P.v.chan_stride];
  }
#pragma unroll
  for (int k = 0; k + 1 < kB1Stages; ++k) issue(warp + k * nw, k);

  // The block's 128 threads take a channel each (every warp of the block runs this part): q·zero
  // and the largest |q⊙scale|, which sets σ, reduced over the block; then each warp's ballots
  // give the 24 planes of U over its 32 channels, and lane (g, t) takes planes g, 8 + g and
  // 16 + g of channels 32t..32t+31 as the keys' B operand (bit i: channel 32t + i).
  __shared__ float sh_red[2][4];
  __shared__ uint32_t sh_planes[4][24];
  const float u = qs[c] * __half2float(k_scale);
  // The values' scale and zero of channel c (used at the part's end) are kept in shared memory
  // once every warp is past the previous part's end.
  __shared__ float sh_vsz[2][128];
  const float vsz[2] = {__half2float(v_scale), __half2float(v_zero)};
  const float qa_w = warp_sum(qs[c] * __half2float(k_zero)), umax_w = warp_max(fabsf(u));
  if (lane == 0) sh_red[0][warp] = qa_w, sh_red[1][warp] = umax_w;
  __syncthreads();
  if constexpr (!RANGE) sh_vsz[0][c] = vsz[0], sh_vsz[1][c] = vsz[1];
  const float qa = sh_red[0][0] + sh_red[0][1] + sh_red[0][2] + sh_red[0][3];
  const float umax = fmaxf(fmaxf(sh_red[1][0], sh_red[1][1]), fmaxf(sh_red[1][2], sh_red[1][3]));
  int ex = 0;
  frexpf(umax, &ex);  // umax < 2^ex
  const float sigma = umax > 0.0f ? ldexpf(1.0f, 22 - ex) : 1.0f;
  const float kfac = 1.0f / sigma;
  {
    const uint32_t U = static_cast<uint32_t>(__float2int_rn(u * sigma));
    uint32_t mine = 0u;
#pragma unroll
    for (int pl = 0; pl < 24; ++pl) {
      const uint32_t w = __ballot_sync(0xffffffffu, (U >> pl) & 1u);
      if (lane == pl) mine = w;
    }
    if (lane < 24) sh_planes[warp][lane] = mine;
  }
  __syncthreads();
  const uint32_t bq[3] = {sh_planes[t][g], sh_planes[t][8 + g], sh_planes[t][16 + g]};
  // This lane's plane weights: column 2t + x of group j is plane 8j + 2t + x.
  int wk[3][2];
#pragma unroll
  for (int j = 0; j < 3; ++j)
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int pl = 8 * j + 2 * t + x;
      wk[j][x] = pl == 23 ? -(1 << 23) : (1 << pl);
    }

  // Values: per-plane popcounts accumulate in the mma's integer accumulators (D[u][j]: channels
  // 16g + 2u (+1), planes 8j + 2t (+1)) while the running maximum holds; when it moves, and at
  // the end, they are weighed by 2^plane into this lane's fp32 partial sums acc[u][h].
  float acc[8][2];
  int D[8][2][4];
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    acc[u][0] = acc[u][1] = 0.0f;
#pragma unroll
    for (int j = 0; j < 2; ++j) D[u][j][0] = D[u][j][1] = D[u][j][2] = D[u][j][3] = 0;
  }
  const float f4t = static_cast<float>(1 << (2 * t));  // 2^(plane of column 2t)
  auto flush = [&](float alpha) {
#pragma unroll
    for (int u = 0; u < 8; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float x = fmaf(2.0f, static_cast<float>(D[u][0][2 * h + 1]), static_cast<float>(D[u][0][2 * h])) +
                        256.0f * fmaf(2.0f, static_cast<float>(D[u][1][2 * h + 1]), static_cast<float>(D[u][1][2 * h]));
        acc[u][h] = fmaf(x, f4t, acc[u][h]) * alpha;
        D[u][0][2 * h] = D[u][0][2 * h + 1] = D[u][1][2 * h] = D[u][1][2 * h + 1] = 0;
      }
  };
  float mw = -INFINITY, dsum = 0.0f;  // dsum in units of P
  float lo_ = lo, hi_ = hi;

  for (int i = warp, sg = 0; i < tiles; i += nw, sg = sg + 1 == kB1Stages ? 0 : sg + 1) {
    // The stage of the tile kB1Stages − 1 ahead is the one the previous iteration read.
    issue(i + (kB1Stages - 1) * nw, sg == 0 ? kB1Stages - 1 : sg - 1);
    cp_async_wait<kB1Stages - 1>();
    __syncwarp();
    const uint32_t* sk = reinterpret_cast<const uint32_t*>(buf + sg * SZ);
    const int r0 = a32 + TR * i;
    float s[PAIR][4];
    if constexpr (SCORES) {
      const float* ss = reinterpret_cast<const float*>(sk) + soff;
#pragma unroll
      for (int pr = 0; pr < PAIR; ++pr)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int x = 128 * pr + 32 * c + 16 * t1 + 8 * t0 + g;
          s[pr][c] = r0 + x >= a && r0 + x < e ? ss[x] : -INFINITY;
        }
    }
#pragma unroll
    for (int pr = 0; pr < PAIR && !SCORES; ++pr) {
      uint32_t kw[8][2];
#pragma unroll
      for (int x = 0; x < 8; ++x)
#pragma unroll
        for (int h = 0; h < 2; ++h) kw[x][h] = sk[4 * (128 * pr + 16 * x + g + 8 * h) + t];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        int v[2][2];  // [tile 2c + par][row g + 8h]
#pragma unroll
        for (int par = 0; par < 2; ++par) {
          int d[3][4];
#pragma unroll
          for (int j = 0; j < 3; ++j) bmma(d[j], kw[2 * c + par][0], kw[2 * c + par][1], bq[j]);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            int x = 0;
#pragma unroll
            for (int j = 0; j < 3; ++j) x += d[j][2 * h] * wk[j][0] + d[j][2 * h + 1] * wk[j][1];
            v[par][h] = x;
          }
        }
        // Sum the quad's planes: keep row half t0 of both tiles, then tile t1.
        int ka = t0 ? v[0][1] : v[0][0], sa = t0 ? v[0][0] : v[0][1];
        int kb = t0 ? v[1][1] : v[1][0], sb = t0 ? v[1][0] : v[1][1];
        ka += __shfl_xor_sync(0xffffffffu, sa, 1);
        kb += __shfl_xor_sync(0xffffffffu, sb, 1);
        int kk = t1 ? kb : ka;
        kk += __shfl_xor_sync(0xffffffffu, t1 ? ka : kb, 2);
        const int r = r0 + 128 * pr + 32 * c + 16 * t1 + 8 * t0 + g;
        s[pr][c] = r >= a && r < e ? fmaf(static_cast<float>(kk), kfac, qa) : -INFINITY;
      }
    }
    if constexpr (RANGE) {
      widen_range<4 * PAIR>(&s[0][0], lo_, hi_);
      if (vsc) {
#pragma unroll
        for (int pr = 0; pr < PAIR; ++pr)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int r = r0 + 128 * pr + 32 * c + 16 * t1 + 8 * t0 + g;
            if (r >= a && r < e) vsc[r] = s[pr][c];
          }
      }
    } else {
      const float mx = warp_max_redux(calibrated_max<4 * PAIR>(&s[0][0], mw, cal, cal_t, cal_g, tau1));
      if (mx > mw) {  // the same in every lane
        const float alpha = __expf(mw - mx);
        dsum *= alpha;
        flush(alpha);
        mw = mx;
      }
#pragma unroll
      for (int pr = 0; pr < PAIR; ++pr) {
        uint32_t pq[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float p = s[pr][c] == -INFINITY ? 0.0f : fminf(__expf(s[pr][c] - mw), 1.0f);
          pq[c] = __float2uint_rn(p * 65535.0f);
          dsum += static_cast<float>(pq[c]);
        }
        // Bit planes of P: after the transposes lane M holds plane M & 15 of group 2·(which) + (M >> 4).
        const uint32_t y1 = transpose32(pq[0] | (pq[1] << 16), lane);
        const uint32_t y2 = transpose32(pq[2] | (pq[3] << 16), lane);
        uint32_t bp[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int src = 16 * t0 + 8 * j + g;  // plane 8j + g of group t
          const uint32_t z1 = __shfl_sync(0xffffffffu, y1, src), z2 = __shfl_sync(0xffffffffu, y2, src);
          bp[j] = t1 ? z2 : z1;
        }
        // Channels 16g..16g+15 of group 4·pr + t; chunk q of group k sits at TR + 32k + (q ^ t) (no
        // bank conflicts).
        const uint4* sv = reinterpret_cast<const uint4*>(sk) + TR + 32 * (4 * pr + t) + 4 * g;
        const uint4 vw[4] = {sv[0 ^ t], sv[1 ^ t], sv[2 ^ t], sv[3 ^ t]};
        const uint32_t* vwl = reinterpret_cast<const uint32_t*>(vw);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          bmma_acc(D[u][0], vwl[2 * u], vwl[2 * u + 1], bp[0]);  // rows: channels 16g + 2u (+1)
          bmma_acc(D[u][1], vwl[2 * u], vwl[2 * u + 1], bp[1]);
        }
      }
    }
    __syncwarp();  // every lane has read this stage before it is refilled
  }
  if constexpr (RANGE) {
    lo = lo_;
    hi = hi_;
  } else {
    flush(1.0f);
    merge_part(sh_vsz, acc, dsum, mw, st_io);
  }
}

}  // namespace kvlens::cuda::b1_path
