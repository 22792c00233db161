// The research path's device ops (kernels/cuda/research_ops.cu and the kernels it launches)
// against their host references on fresh random inputs: reductions of a layer's prefill
// attention, LOOK-M's assignment by cosine similarity, and the exact attention of a decode
// query from a prefill's capture. The CPU backend has none of these ops and answers false.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <thread>

#include "core/compress/evict_methods.h"
#include "core/errors.h"
#include "core/exact_attention.h"
#include "tests/op_harness.h"

using namespace kvlens;
using namespace kvlens::testing;

namespace {

// q, k and v of T tokens side by side in one row, causal, scale 1/√D.
AttnLayout qkv_layout(int T, int n_heads, int n_kv_heads, int D) {
  AttnLayout l;
  l.T = T;
  l.n_heads = n_heads;
  l.n_kv_heads = n_kv_heads;
  l.head_dim = D;
  l.row_stride = static_cast<int64_t>(n_heads + 2 * n_kv_heads) * D;
  l.q_col = 0;
  l.k_col = static_cast<int64_t>(n_heads) * D;
  l.v_col = static_cast<int64_t>(n_heads + n_kv_heads) * D;
  l.causal = true;
  l.scale = 1.0f / std::sqrt(static_cast<float>(D));
  return l;
}

}  // namespace

// The device's attention reductions against the host reference on the device's own
// probabilities: column sums (double, ascending rows), counts and pooled maps (double sums in
// the reference's order) equal bit for bit, for ranges, scattered rows, one row and none, p = 0
// / 0.01 / 1 with and without zeros counted; all T rows take two passes of the device's 512. The CPU
// backend has no such op (its callers reduce the probabilities it hands over).
TEST(Ops, AttentionReductions) {
  const AttnLayout l = qkv_layout(603, 4, 2, 64);
  const int T = l.T, H = l.n_heads;
  const auto qkv = randn(static_cast<size_t>(T) * l.row_stride, 2.5f);
  {
    Buffer X = make(*op_backends().cpu, "qkv", {T, l.row_stride}, Dt::F32, qkv);
    AttentionReduction r;
    r.queries = {0};
    std::vector<double> s(static_cast<size_t>(H) * T);
    r.column_sums = s.data();
    EXPECT_FALSE(op_backends().cpu->attention_reduce(X, l, r));
  }
  KVLENS_NEED_GPU();
  Backend& gpu = *op_backends().gpu;
  Buffer X = make(gpu, "qkv", {T, l.row_stride}, Dt::F32, qkv);
  Buffer O = poisoned(gpu, "o", {T, static_cast<int64_t>(H) * l.head_dim}, Dt::F32);
  std::vector<float> P(static_cast<size_t>(H) * T * T);
  gpu.attention(X, l, O, nullptr, P.data());
  std::mt19937_64 rng(7);
  std::vector<int> scattered;
  for (int i = 0; i < T; ++i)
    if (rng() % 3 == 0) scattered.push_back(i);
  for (const std::vector<int>& q : {AttentionReduction::range(0, T, T), AttentionReduction::range(T - 32, T, T),
                                    scattered, std::vector<int>{T / 2}, std::vector<int>{}})
    for (double p : {0.0, 0.01, 1.0})
      for (bool z : {false, true}) {
        std::vector<double> sums(static_cast<size_t>(H) * T, -1.0), want(sums.size(), -2.0);
        std::vector<int64_t> below(H, -1), want_below(H, -2);
        // A pooled map with it: uneven blocks over a key axis past the prompt.
        const int rows = std::min<int>(17, std::max<size_t>(q.size(), 1)), cols = 23, keys = T + 3;
        std::vector<float> map(static_cast<size_t>(rows) * cols, -1.0f), want_map(map.size(), -2.0f);
        AttentionReduction r, ref;
        r.queries = ref.queries = q;
        r.p = ref.p = p;
        r.zeros_below = ref.zeros_below = z;
        r.column_sums = sums.data();
        r.below = below.data();
        ref.column_sums = want.data();
        ref.below = want_below.data();
        r.map = map.data();
        ref.map = want_map.data();
        r.map_rows = ref.map_rows = rows;
        r.map_cols = ref.map_cols = cols;
        r.map_keys = ref.map_keys = keys;
        ASSERT_TRUE(gpu.attention_reduce(X, l, r));
        reduce_attention(P.data(), H, T, ref);
        EXPECT_TRUE(sums == want) << "column sums, rows " << r.key();
        EXPECT_EQ(below, want_below) << "entries below, rows " << r.key();
        EXPECT_TRUE(map == want_map) << "pooled map, rows " << r.key();
      }
  AttentionReduction bad;
  bad.queries = {5, 5};
  std::vector<int64_t> b(H);
  bad.below = b.data();
  EXPECT_THROW(gpu.attention_reduce(X, l, bad), InternalError);
  // Rows longer than the softmax holds in registers (4,096 keys): read from memory at each step,
  // the same probabilities and counts.
  const AttnLayout ll = qkv_layout(4100, 2, 1, 32);
  const int TL = ll.T, HL = ll.n_heads;
  Buffer XL = make(gpu, "qkv long", {TL, ll.row_stride}, Dt::F32, randn(static_cast<size_t>(TL) * ll.row_stride, 2.5f));
  Buffer OL = poisoned(gpu, "o long", {TL, static_cast<int64_t>(HL) * ll.head_dim}, Dt::F32);
  std::vector<float> PL(static_cast<size_t>(HL) * TL * TL);
  gpu.attention(XL, ll, OL, nullptr, PL.data());
  for (const std::vector<int>& q : {AttentionReduction::range(0, TL, TL), AttentionReduction::range(TL - 3, TL, TL)}) {
    std::vector<double> sums(static_cast<size_t>(HL) * TL, -1.0), want(sums.size(), -2.0);
    std::vector<int64_t> below(HL, -1), want_below(HL, -2);
    AttentionReduction r, ref;
    r.queries = ref.queries = q;
    r.p = ref.p = 0.01;
    r.column_sums = sums.data();
    r.below = below.data();
    ref.column_sums = want.data();
    ref.below = want_below.data();
    ASSERT_TRUE(gpu.attention_reduce(XL, ll, r));
    reduce_attention(PL.data(), HL, TL, ref);
    EXPECT_TRUE(sums == want) << "column sums of long rows, rows " << r.key();
    EXPECT_EQ(below, want_below) << "entries below of long rows, rows " << r.key();
  }
}

// LOOK-M's assignment on the device against the host's (lookm_assign without a backend): the
// same evicted rows, kept rows and similarities bit for bit, on random keys with exact
// duplicates (ties between kept rows), zero rows (similarity 0), negative similarities only,
// one kept row and none evicted, kept rows staged in shared memory and too many for it, one
// head at a time and a layer's heads at once. The CPU backend has no such op and answers false.
TEST(Ops, LookMAssignmentOnTheDevice) {
  std::vector<std::vector<RowAssignment>> none;
  const std::vector<float> k1 = randn(24, 1.0f);
  const std::vector<int> keep1{0};
  EXPECT_FALSE(op_backends().cpu->cosine_assign(8, {&k1}, {&keep1}, none));
  KVLENS_NEED_GPU();
  Backend& gpu = *op_backends().gpu;
  std::mt19937_64 rng(5);
  struct Case { int n, d; double keep_share; };
  // (1000 rows of 128 with half kept: more kept fp32 rows than shared memory holds, so the
  // kernel reads them where they are)
  for (const Case& c : {Case{300, 128, 0.2}, Case{97, 24, 0.5}, Case{40, 64, 0.0}, Case{33, 32, 1.0}, Case{1000, 128, 0.5}}) {
    std::vector<float> k = randn(static_cast<size_t>(c.n) * c.d, 1.0f);
    for (int i = 5; i < c.n; i += 11)  // a copy of an earlier row: ties
      std::copy_n(k.begin() + static_cast<ptrdiff_t>(i - 5) * c.d, c.d, k.begin() + static_cast<ptrdiff_t>(i) * c.d);
    for (int i = 7; i < c.n; i += 29) std::fill_n(k.begin() + static_cast<ptrdiff_t>(i) * c.d, c.d, 0.0f);
    std::vector<int> keep;
    for (int i = 0; i < c.n; ++i)
      if (static_cast<double>(rng() % 1000) < c.keep_share * 1000) keep.push_back(i);
    if (keep.empty()) keep.push_back(c.n / 2);  // one kept row
    const std::vector<LookMAssignment> host = lookm_assign(c.d, keep, k), dev = lookm_assign(c.d, keep, k, &gpu);
    const std::string what = "n=" + std::to_string(c.n) + " d=" + std::to_string(c.d) + " kept " + std::to_string(keep.size());
    ASSERT_EQ(dev.size(), host.size()) << what;
    EXPECT_EQ(static_cast<int>(host.size()), c.n - static_cast<int>(keep.size())) << what;
    for (size_t i = 0; i < host.size(); ++i) {
      EXPECT_EQ(dev[i].e, host[i].e) << what << " row " << i;
      EXPECT_EQ(dev[i].c, host[i].c) << what << " row " << host[i].e;
      EXPECT_EQ(dev[i].s, host[i].s) << what << " row " << host[i].e;
    }
    // Every evicted row the negation of the first kept row: equal similarities in every row.
    std::vector<float> neg = k;
    for (int e = 0; e < c.n; ++e)
      if (!std::binary_search(keep.begin(), keep.end(), e))
        for (int t = 0; t < c.d; ++t) neg[static_cast<size_t>(e) * c.d + t] = -neg[static_cast<size_t>(keep[0]) * c.d + t];
    const std::vector<LookMAssignment> hn = lookm_assign(c.d, keep, neg), dn = lookm_assign(c.d, keep, neg, &gpu);
    ASSERT_EQ(dn.size(), hn.size());
    for (size_t i = 0; i < hn.size(); ++i) EXPECT_TRUE(dn[i].c == hn[i].c && dn[i].s == hn[i].s) << what << " negated " << i;
  }
  // A layer's heads at once (one copy each way): heads of different row counts, a head with
  // nothing evicted and one with no kept row (it assigns nothing), each equal to the host's.
  std::vector<std::vector<float>> ks;
  std::vector<std::vector<int>> keeps;
  for (int h = 0; h < 5; ++h) {
    const int n = 50 + 31 * h;
    ks.push_back(randn(static_cast<size_t>(n) * 64, 1.0f));
    std::vector<int> kp;
    for (int i = 0; i < n; ++i)
      if (h == 3 || (h != 4 && rng() % 4 == 0)) kp.push_back(i);
    if (kp.empty() && h != 4) kp.push_back(0);
    keeps.push_back(kp);
  }
  const auto host = lookm_assign_heads(64, keeps, ks), dev = lookm_assign_heads(64, keeps, ks, &gpu);
  ASSERT_EQ(dev.size(), host.size());
  EXPECT_TRUE(host[3].empty());
  EXPECT_TRUE(host[4].empty());
  for (size_t h = 0; h < host.size(); ++h) {
    ASSERT_EQ(dev[h].size(), host[h].size()) << "head " << h;
    for (size_t i = 0; i < host[h].size(); ++i)
      EXPECT_TRUE(dev[h][i].e == host[h][i].e && dev[h][i].c == host[h][i].c && dev[h][i].s == host[h][i].s)
          << "head " << h << " row " << host[h][i].e;
  }
}

// The exact attention of a decode query on the device (from a prefill's qkv and extra rows)
// against the host reference exact_attention, on random inputs: GQA with extra rows of unequal
// counts per KV head (padding), no extra rows, and a long prompt. Derived tolerances, with
// u = 2⁻²⁴: a score is a D-term float dot product summed in another order (and with or
// without fused multiply-adds) on each side, so it may differ by 2·(D + 1)·u·scale·Σ|q·k|;
// a probability by its own share of three such errors (its score, the row's maximum, the sum)
// plus 8u (the two exp implementations and roundings); an output component by the sum of its
// terms' probability errors times |v| plus u of each term (the float product).
TEST(Ops, ExactDecodeAttention) {
  struct Case { int T, NH, NKV, D; std::vector<int> extra; float mag; };
  const double u = std::ldexp(1.0, -24);
  for (const Case& c : {Case{150, 8, 2, 64, {3, 1}, 2.5f}, Case{37, 4, 4, 128, {}, 1.0f},
                        Case{1100, 4, 1, 128, {2}, 4.0f}}) {
    const AttnLayout pl = qkv_layout(c.T, c.NH, c.NKV, c.D), l1 = qkv_layout(1, c.NH, c.NKV, c.D);
    const std::vector<float> qkv = randn(static_cast<size_t>(c.T) * pl.row_stride, c.mag);
    const std::vector<float> row = randn(static_cast<size_t>(pl.row_stride), c.mag);
    ExtraRows extra;
    for (int n : c.extra) extra.n = std::max(extra.n, n);
    extra.k = randn(static_cast<size_t>(c.NKV) * extra.n * c.D, c.mag);
    extra.v = randn(extra.k.size(), c.mag);
    extra.pos.assign(static_cast<size_t>(c.NKV) * extra.n, -1);
    for (int h = 0; h < static_cast<int>(c.extra.size()); ++h)
      for (int i = 0; i < c.extra[h]; ++i) extra.pos[static_cast<size_t>(h) * extra.n + i] = c.T + i;
    PromptRows prompt;
    prompt.T = c.T;
    prompt.k.assign(c.NKV, std::vector<const float*>(c.T));
    prompt.v = prompt.k;
    for (int h = 0; h < c.NKV; ++h)
      for (int t = 0; t < c.T; ++t) {
        prompt.k[h][t] = qkv.data() + static_cast<size_t>(t) * pl.row_stride + pl.k_col + h * c.D;
        prompt.v[h][t] = qkv.data() + static_cast<size_t>(t) * pl.row_stride + pl.v_col + h * c.D;
      }
    const ExactAttention ref = exact_attention(row.data(), c.NH, c.D, pl.scale, prompt, extra);
    const std::string what = "T=" + std::to_string(c.T) + " heads " + std::to_string(c.NH) + "/" +
                             std::to_string(c.NKV) + " D=" + std::to_string(c.D) + " extra " + std::to_string(extra.n);
    {
      Buffer P = make(*op_backends().cpu, "prompt_qkv", {c.T, pl.row_stride}, Dt::F32, qkv);
      Buffer Q = make(*op_backends().cpu, "qkv1", {1, pl.row_stride}, Dt::F32, row);
      ExactAttention x;
      EXPECT_FALSE(op_backends().cpu->exact_decode_attention(Q, l1, P, pl, extra, x)) << what;
    }
    KVLENS_NEED_GPU();
    Backend& gpu = *op_backends().gpu;
    Buffer P = make(gpu, "prompt_qkv", {c.T, pl.row_stride}, Dt::F32, qkv);
    Buffer Q = make(gpu, "qkv1", {1, pl.row_stride}, Dt::F32, row);
    ExactAttention x;
    ASSERT_TRUE(gpu.exact_decode_attention(Q, l1, P, pl, extra, x)) << what;
    ASSERT_EQ(x.n, ref.n) << what;
    EXPECT_EQ(x.pos, ref.pos) << what;
    const int n = ref.n, G = c.NH / c.NKV;
    for (int hd = 0; hd < c.NH; ++hd) {
      const int h = hd / G;
      std::vector<double> bs(n, 0.0);
      double worst = 0;
      for (int j = 0; j < n; ++j) {
        const int32_t pos = ref.pos[static_cast<size_t>(h) * n + j];
        if (pos < 0) continue;
        const float* k = j < c.T ? prompt.k[h][j] : extra.k.data() + (static_cast<size_t>(h) * extra.n + j - c.T) * c.D;
        double mag = 0;
        for (int d = 0; d < c.D; ++d) mag += std::abs(double(row[static_cast<size_t>(hd) * c.D + d]) * k[d]);
        bs[j] = 2.0 * (c.D + 1) * u * pl.scale * mag + 1e-30;
        worst = std::max(worst, bs[j]);
      }
      const size_t at = static_cast<size_t>(hd) * n;
      std::vector<double> bp(n);
      for (int j = 0; j < n; ++j) bp[j] = ref.probs[at + j] * (3 * worst + 8 * u) + 1e-30;
      for (int j = 0; j < n; ++j) {
        if (ref.pos[static_cast<size_t>(h) * n + j] < 0) {
          EXPECT_EQ(x.scores[at + j], -std::numeric_limits<float>::infinity()) << what << " padding score";
          EXPECT_EQ(x.probs[at + j], 0.0f) << what << " padding probability";
          continue;
        }
        EXPECT_LE(std::abs(double(x.scores[at + j]) - ref.scores[at + j]), bs[j]) << what << " head " << hd << " key " << j;
        EXPECT_LE(std::abs(double(x.probs[at + j]) - ref.probs[at + j]), bp[j]) << what << " head " << hd << " key " << j;
      }
      for (int d = 0; d < c.D; ++d) {
        double bound = 1e-12;
        for (int j = 0; j < n; ++j) {
          if (ref.pos[static_cast<size_t>(h) * n + j] < 0) continue;
          const float* v = j < c.T ? prompt.v[h][j] : extra.v.data() + (static_cast<size_t>(h) * extra.n + j - c.T) * c.D;
          bound += (bp[j] + u * ref.probs[at + j]) * std::abs(double(v[d]));
        }
        EXPECT_LE(std::abs(x.out[static_cast<size_t>(hd) * c.D + d] - ref.out[static_cast<size_t>(hd) * c.D + d]), bound)
            << what << " head " << hd << " output " << d;
      }
    }
  }
}

// The exact attention of a step's every layer at once (one launch, one copy back): each layer's
// result equals, bit for bit, what exact_decode_attention gives for that layer alone (the same
// kernel on the same values; that op is checked against the host reference above), on three
// layers of one prompt length with different captures, queries and extra rows (none, uneven
// per KV head, two). The CPU backend has no such op.
TEST(Ops, ExactDecodeAttentionOfEveryLayerAtOnce) {
  const int T = 97, NH = 8, NKV = 2, D = 64, L = 3;
  const AttnLayout pl = qkv_layout(T, NH, NKV, D), l1 = qkv_layout(1, NH, NKV, D);
  const std::vector<std::vector<int>> counts{{}, {3, 1}, {2, 2}};
  std::vector<std::vector<float>> prompt(L);
  std::vector<ExtraRows> extras(L);
  for (int i = 0; i < L; ++i) {
    prompt[i] = randn(static_cast<size_t>(T) * pl.row_stride, 2.0f);
    ExtraRows& e = extras[i];
    for (int n : counts[i]) e.n = std::max(e.n, n);
    e.k = randn(static_cast<size_t>(NKV) * e.n * D, 2.0f);
    e.v = randn(e.k.size(), 2.0f);
    e.pos.assign(static_cast<size_t>(NKV) * e.n, -1);
    for (int h = 0; h < static_cast<int>(counts[i].size()); ++h)
      for (int r = 0; r < counts[i][h]; ++r) e.pos[static_cast<size_t>(h) * e.n + r] = T + r;
  }
  const std::vector<float> rows = randn(static_cast<size_t>(L) * pl.row_stride, 2.0f);
  {
    Backend& cpu = *op_backends().cpu;
    std::vector<Buffer> P;
    std::vector<const Buffer*> pp;
    for (int i = 0; i < L; ++i) P.push_back(make(cpu, "prompt_qkv", {T, pl.row_stride}, Dt::F32, prompt[i]));
    for (const Buffer& b : P) pp.push_back(&b);
    Buffer Q = make(cpu, "qkv_layers", {L, pl.row_stride}, Dt::F32, rows);
    std::vector<ExactAttention> x;
    EXPECT_FALSE(cpu.exact_decode_attention_layers(Q, l1, pp, pl, extras, x));
  }
  KVLENS_NEED_GPU();
  Backend& gpu = *op_backends().gpu;
  std::vector<Buffer> P;
  std::vector<const Buffer*> pp;
  for (int i = 0; i < L; ++i) P.push_back(make(gpu, "prompt_qkv", {T, pl.row_stride}, Dt::F32, prompt[i]));
  for (const Buffer& b : P) pp.push_back(&b);
  Buffer Q = make(gpu, "qkv_layers", {L, pl.row_stride}, Dt::F32, rows);
  std::vector<ExactAttention> all;
  ASSERT_TRUE(gpu.exact_decode_attention_layers(Q, l1, pp, pl, extras, all));
  ASSERT_EQ(static_cast<int>(all.size()), L);
  for (int i = 0; i < L; ++i) {
    ExactAttention one;
    ASSERT_TRUE(gpu.exact_decode_attention(Q.row_view(i, 1), l1, P[i], pl, extras[i], one));
    EXPECT_EQ(all[i].n, T + extras[i].n) << "layer " << i;
    EXPECT_EQ(all[i].n, one.n) << "layer " << i;
    EXPECT_EQ(all[i].pos, one.pos) << "layer " << i;
    EXPECT_EQ(all[i].scores, one.scores) << "layer " << i;
    EXPECT_EQ(all[i].probs, one.probs) << "layer " << i;
    EXPECT_EQ(all[i].out, one.out) << "layer " << i;
  }
}

#ifdef KVLENS_HAVE_CUDA
#include "core/half.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"

// LOOK-M's merge kernels (row_merge.cu, what Backend::kv_lookm_merge launches) against the host
// references on fresh random fp16 rows, two layers of three KV heads with unequal row counts (one
// with hundreds of evicted rows, so that the kernels scan them in many chunks),
// each head's rows in two runs stored out of order: the row pointers (segment_rows) and evicted
// rows (evicted_rows) equal the host's lists; the sources (merge_sources) equal
// lookm_contributions' for the authors' filter with and without prefix sources, on similarities
// drawn from few values (ties with the mean); and every merged row and count (merge_kept) equals
// merge_rows' on those contributions bit for bit, for each rule, with kept rows that take many
// contributions and some that take none (copied as they are), a row of ±65504 and one of
// subnormals.
TEST(Ops, LookMMergeKernels) {
  KVLENS_NEED_GPU();
  using cuda::AssignProblem;
  using cuda::cosine_assign_tiles;
  using cuda::RowSegment;
  Backend& be = *op_backends().gpu;
  std::mt19937_64 r(rng()());
  auto bytes_buffer = [&](const void* src, int64_t bytes, const char* name) {
    std::vector<int32_t> words(static_cast<size_t>((bytes + 3) / 4) + 1, 0);
    std::memcpy(words.data(), src, static_cast<size_t>(bytes));
    return make_ids(be, name, words);
  };
  auto ints_back = [&](const Buffer& b, int64_t n) {
    std::vector<int32_t> all(static_cast<size_t>(b.numel()));
    be.download(b, all.data());
    return std::vector<int>(all.begin(), all.begin() + n);
  };
  const int G = 2, H = 3;  // layers, KV heads each
  for (const int d : {128, 64, 40, 200}) {
    SCOPED_TRACE("d=" + std::to_string(d));
    // Each problem's rows, kept rows, evicted rows and assignments on the host.
    std::vector<std::vector<float>> k(G * H), v(G * H);
    std::vector<std::vector<int>> keep(G * H), ev(G * H);
    std::vector<std::vector<RowAssignment>> a(G * H);
    std::vector<AssignProblem> P;
    int64_t N = 0, NE = 0, NK = 0, tiles = 0;
    for (int x = 0; x < G * H; ++x) {
      const int n = x == 0 ? 700 : 60 + static_cast<int>(r() % 120);  // (one head of more evicted rows than a block's threads)
      k[x] = rounded(Dt::F16, randn(static_cast<size_t>(n) * d, 3.0f));
      v[x] = rounded(Dt::F16, randn(k[x].size(), 0.5f));
      for (int t = 0; t < d; ++t) {
        k[x][static_cast<size_t>(5) * d + t] = (t % 2 ? 65504.0f : -65504.0f);
        v[x][static_cast<size_t>(6) * d + t] = round_half(static_cast<float>(t) * std::ldexp(1.0f, -24));
      }
      for (int i = 0; i < n; ++i)
        if (i % 4 == 1 || i == 7 || r() % 9 == 0) keep[x].push_back(i);
      const std::vector<double> sims{-0.5, 0.0, 0.25, 0.5, 1.0};
      for (int e = 0; e < n; ++e) {
        if (std::binary_search(keep[x].begin(), keep[x].end(), e)) continue;
        ev[x].push_back(e);
        // (the last kept row is never chosen: it takes no contribution)
        const size_t c = e < 40 ? r() % 3 : r() % (keep[x].size() - 1);
        a[x].push_back({e, keep[x][c], sims[r() % sims.size()]});
      }
      AssignProblem p;
      p.row0 = N, p.kept0 = NK, p.ev0 = NE, p.tile0 = tiles, p.n = n, p.K = static_cast<int>(keep[x].size());
      p.E = n - p.K;
      N += n, NK += p.K, NE += p.E, tiles += cosine_assign_tiles(p.E);
      P.push_back(p);
    }
    // The rows in memory: each problem's second run before its first.
    std::vector<float> mk, mv;
    std::vector<RowSegment> runs;
    std::vector<std::pair<int64_t, int64_t>> places;  // (flat first row, memory row) of each run
    for (int x = 0; x < G * H; ++x) {
      const int n = P[x].n, cut = 1 + static_cast<int>(r() % (n - 1));
      for (const auto& [f, m] : {std::pair<int, int>{cut, n - cut}, std::pair<int, int>{0, cut}}) {
        places.push_back({P[x].row0 + f, static_cast<int64_t>(mk.size()) / d});
        mk.insert(mk.end(), k[x].begin() + static_cast<ptrdiff_t>(f) * d, k[x].begin() + static_cast<ptrdiff_t>(f + m) * d);
        mv.insert(mv.end(), v[x].begin() + static_cast<ptrdiff_t>(f) * d, v[x].begin() + static_cast<ptrdiff_t>(f + m) * d);
        runs.push_back({nullptr, nullptr, P[x].row0 + f, m});
      }
    }
    Buffer MK = make(be, "rows k", {N, d}, Dt::F16, mk), MV = make(be, "rows v", {N, d}, Dt::F16, mv);
    for (size_t i = 0; i < runs.size(); ++i) {
      runs[i].k = MK.as<__half>() + places[i].second * d;
      runs[i].v = MV.as<__half>() + places[i].second * d;
    }
    std::sort(runs.begin(), runs.end(), [](const RowSegment& x, const RowSegment& y) { return x.first < y.first; });
    std::vector<int> keep_all, best, ev_all;
    std::vector<double> sim;
    for (int x = 0; x < G * H; ++x) {
      keep_all.insert(keep_all.end(), keep[x].begin(), keep[x].end());
      ev_all.insert(ev_all.end(), ev[x].begin(), ev[x].end());
      for (const RowAssignment& y : a[x]) best.push_back(y.c), sim.push_back(y.s);
    }
    Buffer DP = bytes_buffer(P.data(), static_cast<int64_t>(P.size() * sizeof(AssignProblem)), "problems");
    Buffer DR = bytes_buffer(runs.data(), static_cast<int64_t>(runs.size() * sizeof(RowSegment)), "runs");
    Buffer DK = bytes_buffer(keep_all.data(), NK * 4, "keep"), DB = bytes_buffer(best.data(), NE * 4, "best");
    Buffer DS = bytes_buffer(sim.data(), NE * 8, "similarities");
    Buffer PTR = be.alloc("row pointers", {4 * N}, Dt::I32), EV = poisoned(be, "evicted", {NE}, Dt::I32);
    Buffer SRC = poisoned(be, "sources", {NE}, Dt::I32), SCR = be.alloc("scratch", {NE}, Dt::I32);
    be.synchronize();
    const auto* dp = static_cast<const AssignProblem*>(DP.data);
    auto** rk = static_cast<const __half**>(PTR.data);
    const __half** rv = rk + N;
    cuda::segment_rows(static_cast<const RowSegment*>(DR.data), static_cast<int>(runs.size()), N, d, rk, rv, nullptr);
    cuda::evicted_rows(dp, G * H, static_cast<const int*>(DK.data), static_cast<int*>(EV.data), nullptr);
    cudaDeviceSynchronize();
    std::vector<int64_t> ptrs(static_cast<size_t>(2 * N));
    be.download(PTR, reinterpret_cast<int32_t*>(ptrs.data()));  // (the first 2N pointers fill 4N words)
    for (int64_t i = 0; i < N; ++i) {
      const auto run = std::upper_bound(runs.begin(), runs.end(), i, [](int64_t x, const RowSegment& s) { return x < s.first; }) - 1;
      ASSERT_EQ(ptrs[static_cast<size_t>(i)], reinterpret_cast<int64_t>(run->k + (i - run->first) * d)) << "K row " << i;
      ASSERT_EQ(ptrs[static_cast<size_t>(N + i)], reinterpret_cast<int64_t>(run->v + (i - run->first) * d)) << "V row " << i;
    }
    EXPECT_EQ(ints_back(EV, NE), ev_all);
    for (MergeKind kind : {MergeKind::Average, MergeKind::Pivotal, MergeKind::Weighted})
      for (int f = 0; f < 3; ++f) {
        LookMMergeSpec spec;
        spec.kind = kind;
        spec.above_mean = f > 0;
        spec.prefix_sources = f == 2;
        const std::string what = std::string(merge_kind_name(kind)) + (f == 0 ? "" : f == 1 ? " above_mean" : " above_mean prefix");
        // The host: each layer's contributions, then the merge of each head's rows.
        std::vector<int> want_src;
        std::vector<std::vector<float>> hk = k, hv = v;
        std::vector<std::vector<int>> count(G * H);
        int contributions = 0;
        for (int g = 0; g < G; ++g) {
          const std::vector<std::vector<RowAssignment>> layer(a.begin() + g * H, a.begin() + (g + 1) * H);
          const auto contrib = lookm_contributions(layer, spec);
          std::vector<std::vector<double>> s(H);
          for (int h = 0; h < H; ++h)
            for (const RowAssignment& y : layer[h]) s[h].push_back(y.s);
          const std::vector<char> pass = spec.above_mean ? lookm_above_mean(s) : std::vector<char>(N, 1);
          for (int h = 0; h < H; ++h) {
            size_t next = 0;
            for (size_t j = 0; j < layer[h].size(); ++j) want_src.push_back(pass[j] ? contrib[h].at(next++).e : -1);
            EXPECT_EQ(next, contrib[h].size()) << what;
            contributions += static_cast<int>(contrib[h].size());
            merge_rows(kind, d, contrib[h], hk[g * H + h], hv[g * H + h], count[g * H + h]);
          }
        }
        EXPECT_GT(contributions, NE / 4) << what;
        EXPECT_LT(contributions, f == 0 ? NE + 1 : NE) << what << ": the filter passes some rows, not all";
        if (spec.above_mean) {
          cuda::merge_sources(dp, G * H, H, static_cast<const int*>(EV.data), static_cast<const double*>(DS.data),
                              spec.prefix_sources && kind == MergeKind::Average, static_cast<int*>(SCR.data),
                              static_cast<int*>(SRC.data), nullptr);
          cudaDeviceSynchronize();
          ASSERT_EQ(ints_back(SRC, NE), want_src) << what;
        }
        Buffer OK = poisoned(be, "ok", {NK, d}, Dt::F16), OV = poisoned(be, "ov", {NK, d}, Dt::F16);
        Buffer CNT = poisoned(be, "counts", {NK}, Dt::I32), LISTS = poisoned(be, "lists", {NK + NE}, Dt::I32);
        be.synchronize();
        cuda::merge_kept(rk, rv, dp, G * H, NK, NE, static_cast<const int*>(DK.data), static_cast<const int*>(EV.data),
                         spec.above_mean ? static_cast<const int*>(SRC.data) : nullptr, static_cast<const int*>(DB.data),
                         static_cast<const double*>(DS.data), d, static_cast<int>(kind), OK.as<__half>(), OV.as<__half>(),
                         static_cast<int*>(CNT.data), static_cast<int*>(LISTS.data), nullptr);
        cudaDeviceSynchronize();
        const std::vector<float> gk = read(be, OK), gv = read(be, OV);
        const std::vector<int> gc = ints_back(CNT, NK);
        int merged = 0;
        for (int x = 0; x < G * H; ++x)
          for (int j = 0; j < P[x].K; ++j) {
            const int c = keep[x][static_cast<size_t>(j)];
            const int64_t gi = P[x].kept0 + j;
            ASSERT_EQ(gc[static_cast<size_t>(gi)], count[x][static_cast<size_t>(c)]) << what << " problem " << x << " row " << c;
            if (gc[static_cast<size_t>(gi)] == 0) {
              for (int t = 0; t < d; ++t) {
                const size_t o = static_cast<size_t>(gi * d + t), h = static_cast<size_t>(c) * d + t;
                ASSERT_EQ(gk[o], k[x][h]) << what << ": problem " << x << " K row " << c << " without contributions, ch " << t;
                ASSERT_EQ(gv[o], v[x][h]) << what << ": problem " << x << " V row " << c << " without contributions, ch " << t;
              }
              continue;
            }
            ++merged;
            for (int t = 0; t < d; ++t) {
              const size_t o = static_cast<size_t>(gi * d + t), h = static_cast<size_t>(c) * d + t;
              ASSERT_EQ(gk[o], round_half(hk[x][h])) << what << " problem " << x << " K row " << c << " ch " << t;
              ASSERT_EQ(gv[o], round_half(hv[x][h])) << what << " problem " << x << " V row " << c << " ch " << t;
            }
          }
        EXPECT_GT(merged, 4 * G * H) << what;
        EXPECT_LT(merged, NK) << what << ": some kept rows take nothing";
      }
  }
}

// Results queued to land later (Context::land_later) come back whole whichever buffer they cross.
// Many small ones (odd sizes: each batch pads them) fill several batches of kLandChunk, each
// copied through the two page-locked ring buffers while the one before lands, without touching
// the staging buffer. One larger than a batch goes alone through the staging buffer, between
// small ones: the first time through pageable memory (that size is not pinned for a result asked
// for once), the second time the page-locked buffer grows to it. A landing that throws does not
// stop the others: every other result lands, the queue is emptied, and the first error comes
// back. Fresh random bytes every round.
TEST(Ops, LandingsComeBackThroughTheRingAndTheStagingBuffer) {
  KVLENS_NEED_GPU();
  const auto made = std::make_shared<cuda::Context>(0);  // (a context hands out references to itself)
  cuda::Context& ctx = *made;
  std::mt19937 rng(std::random_device{}());
  // Queues results of `sizes` bytes and lands them; landing `throws_at` (−1: none) throws.
  auto round = [&](const std::vector<int64_t>& sizes, const std::string& what, int throws_at = -1) {
    const size_t n = sizes.size();
    std::vector<std::vector<uint8_t>> sent(n), got(n);
    for (size_t i = 0; i < n; ++i) {
      std::vector<uint8_t>& x = sent[i];
      x.resize(static_cast<size_t>(sizes[i]));
      for (uint8_t& b : x) b = static_cast<uint8_t>(rng());
      const std::shared_ptr<void> dev = ctx.alloc(sizes[i], what);
      ctx.upload(dev.get(), x.data(), sizes[i], what);
      std::vector<uint8_t>* to = &got[i];
      const size_t size = x.size();
      const bool fail = static_cast<int>(i) == throws_at;
      ctx.land_later(dev, sizes[i], [to, size, fail](const char* host) {
        if (fail) throw InputError("landing refused on purpose");
        to->assign(reinterpret_cast<const uint8_t*>(host), reinterpret_cast<const uint8_t*>(host) + size);
      });
    }
    if (throws_at < 0) {
      ctx.land_all(what);
    } else {
      EXPECT_THROW(ctx.land_all(what), InputError) << what;
    }
    EXPECT_TRUE(ctx.landings.empty()) << what;
    for (size_t i = 0; i < n; ++i) {
      if (static_cast<int>(i) != throws_at) {
        EXPECT_EQ(got[i], sent[i]) << what << " landing " << i;
      }
    }
  };
  const int64_t chunk = cuda::Context::kLandChunk;
  std::vector<int64_t> small;
  for (int i = 0; i < 45; ++i) small.push_back((1 << 20) + 3 * i);  // 45 MiB: three batches (ring 0 twice)
  round(small, "small results over several batches");
  EXPECT_EQ(ctx.staging_largest, 0) << "batches within a chunk went through the staging buffer";
  const std::vector<int64_t> mixed{5000, chunk + 77, 4001, 3};
  round(mixed, "one larger than a batch, first time");
  EXPECT_LT(ctx.staging_bytes, chunk) << "the page-locked buffer grew for a size asked for once";
  round(mixed, "one larger than a batch, again");
  EXPECT_GE(ctx.staging_bytes, chunk + 77) << "the page-locked buffer did not grow for a size asked for again";
  round(small, "a landing that throws", 20);
}

// The upload room (Context::upload_room): pieces asked for from several threads at once are
// 16-byte aligned, lie within one of the two landing buffers, never overlap and never exceed
// them (then null); a piece larger than a buffer is refused. Bytes written into them and uploaded
// without a wait arrive whole. land_all gives the room back — with no landing to wait for, and
// with some — and the next piece starts at the first buffer again. Fresh random bytes.
TEST(Ops, UploadRoomHandsOutPageLockedPiecesUntilTheNextLanding) {
  KVLENS_NEED_GPU();
  const auto made = std::make_shared<cuda::Context>(0);
  cuda::Context& ctx = *made;
  const int64_t chunk = cuda::Context::kLandChunk;
  const char* ring0 = static_cast<const char*>(ctx.land_ring[0].get());
  const char* ring1 = static_cast<const char*>(ctx.land_ring[1].get());
  EXPECT_EQ(ctx.upload_room(chunk + 1), nullptr) << "a piece larger than a landing buffer";
  std::mt19937 rng(std::random_device{}());
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    // 8 threads ask for pieces of 1–3 MiB and odd sizes until the room is full.
    struct Piece {
      char* at;
      int64_t bytes;
    };
    std::vector<std::vector<Piece>> got(8);
    std::vector<std::thread> ts;
    for (int t = 0; t < 8; ++t)
      ts.emplace_back([&, t, seed = rng()] {
        std::mt19937 r(seed);
        for (;;) {
          const int64_t b = (int64_t{1} << 20) + static_cast<int64_t>(r() % (2u << 20)) + 1 + 2 * t;
          char* p = ctx.upload_room(b);
          if (!p) break;
          got[static_cast<size_t>(t)].push_back({p, b});
        }
      });
    for (std::thread& t : ts) t.join();
    std::vector<Piece> all;
    for (const auto& g : got) all.insert(all.end(), g.begin(), g.end());
    ASSERT_GE(all.size(), 8u);
    std::sort(all.begin(), all.end(), [](const Piece& a, const Piece& b) { return a.at < b.at; });
    int64_t used = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      const Piece& p = all[i];
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p.at) % 16, 0u);
      const bool in0 = p.at >= ring0 && p.at + p.bytes <= ring0 + chunk, in1 = p.at >= ring1 && p.at + p.bytes <= ring1 + chunk;
      EXPECT_TRUE(in0 || in1) << "piece " << i << " outside the landing buffers";
      if (i > 0) {
        EXPECT_LE(all[i - 1].at + all[i - 1].bytes, p.at) << "pieces " << i - 1 << " and " << i << " overlap";
      }
      used += p.bytes;
    }
    EXPECT_LE(used, 2 * chunk);
    EXPECT_GT(used, 2 * chunk - 2 * ((int64_t{3} << 20) + 16) - 16 * static_cast<int64_t>(all.size())) << "the room was not filled";
    // Each piece's bytes uploaded without a wait, then read back after the landing.
    std::vector<std::shared_ptr<void>> dev;
    std::vector<std::vector<char>> sent;
    for (const Piece& p : all) {
      std::vector<char> x(static_cast<size_t>(p.bytes));
      for (char& c : x) c = static_cast<char>(rng());
      std::memcpy(p.at, x.data(), x.size());
      dev.push_back(ctx.alloc(p.bytes, "upload room piece"));
      ctx.upload(dev.back().get(), p.at, p.bytes, "upload room piece");
      sent.push_back(std::move(x));
    }
    std::vector<char> landed;
    if (round == 1) {  // (a landing to wait for)
      ctx.land_later(dev.front(), 64, [&](const char* h) { landed.assign(h, h + 64); });
    }
    ctx.land_all("upload room");
    if (round == 1) {
      EXPECT_TRUE(std::equal(landed.begin(), landed.end(), sent.front().begin()));
    }
    for (size_t i = 0; i < all.size(); ++i) {
      std::vector<char> back(sent[i].size());
      ctx.download(back.data(), dev[i].get(), static_cast<int64_t>(back.size()), "upload room piece");
      ASSERT_EQ(back, sent[i]) << "piece " << i;
    }
    char* again = ctx.upload_room(100);
    EXPECT_EQ(again, ring0) << "the room was not given back by land_all";
    ctx.land_all("upload room, given back");
  }
}
#endif
