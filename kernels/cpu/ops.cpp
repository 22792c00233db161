#include "kernels/cpu/ops.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/exact_attention.h"
#include "core/parallel.h"
#include "core/team.h"
#include "core/rope.h"

namespace kvlens::cpu {

// Values a loop gives each thread: below that a thread's start-up costs more than it saves.
constexpr int64_t kParallelMin = 1 << 15;

int loop_threads(int64_t items, int64_t work, int64_t grain) {
  const int64_t team = omp_in_parallel() || in_team() ? 1 : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min({team, items, work / std::max<int64_t>(grain, 1)})));
}

// Matrix products: OpenBLAS runs each call on one thread, whatever OPENBLAS_NUM_THREADS says, and
// kvlens spreads a product over its own resident team (core/team.h; product_threads: every core,
// or OMP_NUM_THREADS / `--threads` where set; sized by the product). With both libraries
// threading (products then on an OpenMP team), OpenMP's workers spun on the cores that
// OpenBLAS's threads waited for after every loop: the embedded model captioned in 570 ms with 16 threads of each against 141 ms with
// one, on 16 cores. A product is always the same OpenBLAS calls, one per tile of kGemmRows rows
// by kGemmCols output columns, whatever the thread count (which only says how many run at once),
// so its result does not depend on the threads. (Columns alone left a prompt's 256-wide
// products, the 14m's o and down, on two threads: its decoder prefill stopped gaining at four.)
constexpr int kGemmRows = 128;
constexpr int kGemmCols = 128;
// A thread's share of a product is kGemmMacsPerThread (ops.h); for one row (a decode step, bound
// by reading the weights) less, 256 KB of fp32 weights, and at most two threads: on the 16-core
// GPU host the 14m model decoded at 2.2-2.4 ms a token with two, against 3.1-3.6 ms with up to 16
// (the 4-layer model: 0.52-0.68 against 0.90-1.13 ms).
constexpr int64_t kGemvMacsPerThread = int64_t{1} << 16;
constexpr int64_t kGemvMaxThreads = 2;

namespace {
// body(i) for every i in [0, n), in runs of rows, on the threads loop_threads gives `work` units.
template <class Body>
void each(int64_t n, int64_t work, Body&& body) {
  team_each(n, loop_threads(n, work, kParallelMin), body, 0);
}

int col_blocks(int N) { return (N + kGemmCols - 1) / kGemmCols; }
int64_t gemm_tiles(int M, int N) { return static_cast<int64_t>((M + kGemmRows - 1) / kGemmRows) * col_blocks(N); }
}  // namespace

int linear_threads(int M, int N, int K) {
  const int64_t blocks = gemm_tiles(M, N), macs = static_cast<int64_t>(M) * N * K;
  const int64_t per_thread = M == 1 ? kGemvMacsPerThread : kGemmMacsPerThread;
  int64_t team = omp_in_parallel() || in_team() ? 1 : product_threads();
  if (M == 1) team = std::min(team, kGemvMaxThreads);
  return static_cast<int>(std::max<int64_t>(1, std::min({team, blocks, macs / per_thread})));
}

namespace {
// OpenBLAS on one thread, once, before its first call (see kGemmCols).
void blas_on_one_thread() {
  // (An OpenBLAS built on OpenMP also sets the calling thread's OpenMP team to one: kept as it was.)
  static const bool once = [] {
    const int loops = omp_get_max_threads();
    openblas_set_num_threads(1);
    omp_set_num_threads(loops);
    return true;
  }();
  (void)once;
}
}  // namespace

void linear(const float* x, int M, int K, const float* W, int N, const float* bias, float* y) {
  blas_on_one_thread();
  if (bias) {
    for (int m = 0; m < M; ++m) std::copy(bias, bias + N, y + static_cast<int64_t>(m) * N);
  }
  const float beta = bias ? 1.0f : 0.0f;
  const int blocks = static_cast<int>(gemm_tiles(M, N)), cols = col_blocks(N);
  auto block = [&](int b) {
    const int n0 = (b % cols) * kGemmCols, n = std::min(N - n0, kGemmCols);
    const int m0 = (b / cols) * kGemmRows, m = std::min(M - m0, kGemmRows);
    if (M == 1) {  // one row (a decode step): OpenBLAS's matrix-vector kernel reads W at twice the speed
      cblas_sgemv(CblasRowMajor, CblasNoTrans, n, K, 1.0f, W + static_cast<int64_t>(n0) * K, K, x, 1, beta, y + n0, 1);
      return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, K, 1.0f, x + static_cast<int64_t>(m0) * K, K,
                W + static_cast<int64_t>(n0) * K, K, beta, y + static_cast<int64_t>(m0) * N + n0, N);
  };
  team_each(blocks, linear_threads(M, N, K), [&](int64_t b) { block(static_cast<int>(b)); });
}

void layer_norm(const float* x, float* y, int M, int D, const float* g, const float* b, float eps) {
  each(M, static_cast<int64_t>(M) * D, [&](int64_t m) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    double mean = 0.0;
    for (int i = 0; i < D; ++i) mean += xr[i];
    mean /= D;
    double var = 0.0;
    for (int i = 0; i < D; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= D;
    const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
    for (int i = 0; i < D; ++i)
      yr[i] = (xr[i] - static_cast<float>(mean)) * inv * g[i] + (b ? b[i] : 0.0f);
  });
}

void rms_norm(const float* x, float* y, int M, int D, const float* g, float eps) {
  each(M, static_cast<int64_t>(M) * D, [&](int64_t m) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    double ss = 0.0;
    for (int i = 0; i < D; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / D + eps));
    for (int i = 0; i < D; ++i) yr[i] = g[i] * (xr[i] * inv);
  });
}

void activate(float* x, int64_t n, Act act) {
  each(n, n, [&](int64_t i) {
    const float v = x[i];
    switch (act) {
      case Act::Gelu: x[i] = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f)); break;
      case Act::GeluTanh:
        x[i] = 0.5f * v * (1.0f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
        break;
      case Act::QuickGelu: x[i] = v / (1.0f + std::exp(-1.702f * v)); break;
      case Act::Silu: x[i] = v / (1.0f + std::exp(-v)); break;
      case Act::Relu: x[i] = v > 0.0f ? v : 0.0f; break;
    }
  });
}

void mul(float* x, const float* y, int64_t n) {
  each(n, n, [&](int64_t i) { x[i] *= y[i]; });
}

void add(float* x, const float* y, int64_t n) {
  each(n, n, [&](int64_t i) { x[i] += y[i]; });
}

void rope(float* x, int T, int H, int D, const int32_t* pos, float theta) {
  rope(x, T, H, D, pos, Rope(theta).inv_freq(D).data());
}

void rope(float* x, int T, int H, int D, const int32_t* pos, const float* inv_freq, const int* row_of,
          int64_t row_stride) {
  const int half = D / 2;
  each(T, static_cast<int64_t>(T) * H * D, [&](int64_t t) {
    for (int i = 0; i < half; ++i) {
      const int32_t p = row_of ? pos[row_of[i] * row_stride + t] : pos[t];
      const float ang = static_cast<float>(p) * static_cast<float>(inv_freq[i]);
      const float c = std::cos(ang), s = std::sin(ang);
      for (int h = 0; h < H; ++h) {
        float* r = x + (static_cast<int64_t>(t) * H + h) * D;
        const float a = r[i], b = r[i + half];
        r[i] = a * c - b * s;
        r[i + half] = b * c + a * s;
      }
    }
  });
}

namespace {
// A row's largest value and 1 / Σ exp(x_j − max) (summed in fp64, rounded to float).
std::pair<float, float> softmax_scale(const float* row, int n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n; ++j) mx = std::max(mx, row[j]);
  if (!std::isfinite(mx)) return {mx, 0.0f};
  double sum = 0.0;
  for (int j = 0; j < n; ++j) sum += std::exp(row[j] - mx);
  return {mx, static_cast<float>(1.0 / sum)};
}
}  // namespace

void softmax_rows(float* x, int64_t rows, int n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * n;
    const auto [mx, inv] = softmax_scale(row, n);
    if (!std::isfinite(mx)) {
      std::fill(row, row + n, 0.0f);
      continue;
    }
    for (int j = 0; j < n; ++j) row[j] = std::exp(row[j] - mx) * inv;
  }
}

float softmax_at(const float* x, int n, int i) {
  const auto [mx, inv] = softmax_scale(x, n);
  return std::isfinite(mx) ? std::exp(x[i] - mx) * inv : 0.0f;
}

void scores_in_order(const float* scores, int n_heads, int group, int64_t stride, const int32_t* seg_rows,
                     int tail_rows, const int32_t* tail_first, const int32_t* map, int64_t map_stride, float* raw,
                     float* probs) {
  std::vector<float> p;
  for (int h = 0; h < n_heads; ++h) {
    const int kv = h / group, n = seg_rows[kv] + tail_rows - (tail_first ? tail_first[kv] : 0);
    const float* in = scores + static_cast<int64_t>(h) * stride;
    float* r = raw + static_cast<int64_t>(h) * stride;
    std::fill(r, r + stride, -std::numeric_limits<float>::infinity());
    auto at = [&](int i) { return i < seg_rows[kv] ? map[static_cast<int64_t>(kv) * map_stride + i] : i; };
    for (int i = 0; i < n; ++i) r[at(i)] = in[i];
    if (!probs) continue;
    float* o = probs + static_cast<int64_t>(h) * stride;
    std::fill(o, o + stride, 0.0f);
    p.resize(static_cast<size_t>(n));
    softmax_double_sum(in, n, p.data());
    for (int i = 0; i < n; ++i) o[at(i)] = p[static_cast<size_t>(i)];
  }
}

void attention_rows(const AttnHeadArgs& a, int i0, int n) {
  blas_on_one_thread();
  const float ninf = -std::numeric_limits<float>::infinity();
  const bool masked = a.key_pos && a.query_pos;
  // The keys the block can see end at kend: with the key positions ascending (a prompt's), those
  // up to the block's last query position; else every key, masked one by one below.
  int kend = a.Tk;
  if (masked && std::is_sorted(a.key_pos, a.key_pos + a.Tk)) {
    const int32_t qmax = *std::max_element(a.query_pos + i0, a.query_pos + i0 + n);
    kend = static_cast<int>(std::upper_bound(a.key_pos, a.key_pos + a.Tk, qmax) - a.key_pos);
  }
  std::vector<float> local;
  float* S = a.scores ? a.scores + static_cast<int64_t>(i0) * a.Tk : nullptr;
  if (!S) {
    local.resize(static_cast<size_t>(n) * a.Tk);
    S = local.data();
  }
  // Scores: one product of the block's queries with the visible keys, scaled.
  if (kend > 0)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, kend, a.D, a.scale, a.q + static_cast<int64_t>(i0) * a.q_stride,
                static_cast<int>(a.q_stride), a.k, static_cast<int>(a.kv_stride), 0.0f, S, a.Tk);
  for (int r = 0; r < n; ++r) {
    float* Sr = S + static_cast<int64_t>(r) * a.Tk;
    if (masked)
      for (int j = 0; j < kend; ++j)
        if (a.key_pos[j] > a.query_pos[i0 + r]) Sr[j] = ninf;
    std::fill(Sr + kend, Sr + a.Tk, ninf);
  }
  float* P = a.probs ? a.probs + static_cast<int64_t>(i0) * a.Tk : a.scores ? nullptr : S;  // in place unless kept
  std::vector<float> plocal;
  if (!P) {
    plocal.resize(static_cast<size_t>(n) * a.Tk);
    P = plocal.data();
  }
  // (The softmax of the visible columns alone has the bits of the whole row's: the hidden ones'
  // exp is 0.)
  for (int r = 0; r < n; ++r) {
    const float* Sr = S + static_cast<int64_t>(r) * a.Tk;
    float* Pr = P + static_cast<int64_t>(r) * a.Tk;
    if (Pr != Sr) std::copy(Sr, Sr + kend, Pr);
    softmax_rows(Pr, 1, kend);
    std::fill(Pr + kend, Pr + a.Tk, 0.0f);
  }
  // Outputs: one product of the probabilities with the visible values.
  if (kend > 0) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, a.D, kend, 1.0f, P, a.Tk, a.v,
                static_cast<int>(a.kv_stride), 0.0f, a.out + static_cast<int64_t>(i0) * a.o_stride,
                static_cast<int>(a.o_stride));
  } else {
    for (int r = 0; r < n; ++r) {
      float* o = a.out + static_cast<int64_t>(i0 + r) * a.o_stride;
      std::fill(o, o + a.D, 0.0f);
    }
  }
}

void attention_head(const AttnHeadArgs& a) {
  for (int i0 = 0; i0 < a.Tq; i0 += kAttnRows) attention_rows(a, i0, std::min(kAttnRows, a.Tq - i0));
}

}  // namespace kvlens::cpu
