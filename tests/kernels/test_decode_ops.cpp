// The KV cache ops on every backend: prompt rows appended, a compression method applied on the
// host store (on CUDA then mirrored to the device: compaction by gather, packed codes uploaded
// as they are), decode rows appended, and decode attention compared — the fused kernel over fp16
// and packed parts (1/2/3/4/8-bit, channel-wise with and without groups, token-wise, ZipCache
// mixed with CST factors), in-kernel calibration, and the materialized scores/probabilities
// path — with the device's bytes checked against the bytes reported.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>

#include "core/compress/method.h"
#include "core/kv_format.h"
#include "core/compress/quant_methods.h"
#include "core/compress/policy.h"
#include "core/observer.h"
#include "tests/op_harness.h"
#include "tests/held_attention.h"
#include "tests/layout_check.h"
#include "tests/decode_ops_case.h"

using namespace kvlens;
using namespace kvlens::testing;

namespace {

struct Side {
  Backend* be = nullptr;
  KVStore store;
  std::unique_ptr<DeviceKV> dev;
  std::unique_ptr<KVPolicy> policy;
  SeqKV kv() { return SeqKV{&store, dev.get(), true}; }
};

std::vector<PrefillContext> contexts(const DecodeCase& c, const std::vector<float>& q, const std::vector<float>& probs,
                                     const std::vector<float>& scores, const std::vector<SegmentKind>& kinds,
                                     const std::vector<int>& ids) {
  PrefillContext p;
  p.layer = 0;
  p.n_layers = 1;
  p.n_heads = c.NH;
  p.n_kv_heads = c.NKV;
  p.head_dim = c.D;
  p.prompt_len = static_cast<int>(kinds.size());
  // The probabilities live as long as the test's arrays (a held view, never freed here).
  static std::vector<std::unique_ptr<kvlens::testing::HeldAttention>> held;
  held.push_back(std::make_unique<kvlens::testing::HeldAttention>(1, c.NH, p.prompt_len,
                                                                  [&probs](int) { return &probs; }));
  p.attention = held.back().get();
  p.token_kinds = &kinds;
  p.token_ids = &ids;
  return {p};
}

void check_bytes(const Side& g, const Side& cpu, int D, bool packed_only, const std::string& what) {
  // The device cache holds exactly what it reports, and the host store reports it too.
  EXPECT_EQ(g.dev->bytes().total(), g.store.bytes().total()) << what;
  const auto& sg = g.store.layer(0).segments;
  const auto& sc = cpu.store.layer(0).segments;
  ASSERT_EQ(sg.size(), sc.size()) << what;
  for (size_t i = 0; i < sg.size(); ++i) {
    if (sc[i].payload) {
      // A packed (or fp16-payload) segment: the same bytes as the CPU's simulated storage,
      // unless the device keeps it as dequantized fp16 (formats only the host decodes).
      const auto st = g.dev->storage(0);
      const bool packed = i < st.size() && st[i].rfind("packed", 0) == 0;
      if (packed_only) {
        EXPECT_TRUE(packed) << what << " segment " << i << " " << sc[i].storage << " held as "
                            << (i < st.size() ? st[i] : "nothing");
      }
      if (packed) {
        int64_t want = sc[i].bytes.total();
        // ZipCache's V token ranges shared by the KV heads (fp16 scale and zero, 4 bytes each)
        // are held per head on the device — one range a row of every head of the group (its
        // payload's bytes count on its first segment) — unless every head flags the same rows
        // salient (one ranking), when the shared table is what each head reads; a streamed gap
        // (generated rows) holds its copies either way.
        const auto* qp = quant::landed(sc[i].payload.get());
        bool same_flags = sc[i].kind != SegmentKind::Generated;
        for (size_t h = 1; qp && h < qp->k.size(); ++h) same_flags = same_flags && qp->k[h].flags == qp->k[0].flags;
        if (qp && qp->layout.shared_token_ranges && !same_flags && (i == 0 || sc[i - 1].payload != sc[i].payload)) {
          int64_t rows = 0;
          for (size_t j = i; j < sc.size() && sc[j].payload == sc[i].payload; ++j)
            for (const HeadRows& r : sc[j].heads) rows += r.n();
          want += 4 * rows - 4 * static_cast<int64_t>(qp->tokens.scales.size());
        }
        EXPECT_EQ(sg[i].bytes.total(), want) << what << " segment " << i << " " << sc[i].storage;
      }
    } else {
      EXPECT_EQ(sg[i].bytes.total(), sc[i].dense_bytes(D, 2).total()) << what << " segment " << i;
    }
  }
}

// Queries recorded for later, scored in one launch as a batch (Backend::recorded_attention,
// recorded_span_attention) against the same queries one call each: the same scores and
// probabilities, bit for bit (each query's blocks compute alone), every query seeing the
// decode rows at positions up to its own. The span's sums are the host's reduction of the
// whole answer within the softmax's roundings (expf's two ulps and the final division:
// 4·2⁻²⁴ of each value, and g(x)'s where a side fuses it: 32·2⁻²⁴·(M + |τ1| + |τ2| + 1)).
void recorded_queries_case(const DecodeCase& c, Backend* be, SeqKV kv, int T, const KVPolicy* policy,
                           const std::string& what) {
  const int n = c.steps;
  const AttnLayout l1 = layout_of(c, 1);
  const std::vector<float> rows = randn(static_cast<size_t>(n) * l1.row_stride);
  Buffer Q = make(*be, "recorded q", {n, l1.row_stride}, Dt::F32, rows);
  std::vector<int32_t> at(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) at[static_cast<size_t>(i)] = T + i;
  const ScoreTransform tr = policy ? policy->score_transform() : ScoreTransform{};
  std::vector<RecordedAttention> all, one;
  be->recorded_attention(kv, 0, Q, l1, at, &tr, all);
  ASSERT_EQ(all.size(), static_cast<size_t>(n)) << what;
  const int first = c.n_sys, span = c.n_vis;
  std::vector<float> sums;
  const bool by_span = be->recorded_span_attention(kv, 0, Q, l1, at, &tr, first, span, sums);
  EXPECT_EQ(by_span, tr.kind != ScoreTransform::Kind::Host) << what;
  // The same queries one call each, every call's sums queued to land with the others (one wait).
  std::vector<std::vector<float>> singles(static_cast<size_t>(n));
  bool queued = true;
  for (int i = 0; by_span && queued && i < n; ++i) {
    queued = be->recorded_span_attention(kv, 0, Q.row_view(i, 1), l1, {at[static_cast<size_t>(i)]}, &tr, first, span,
                                         singles[static_cast<size_t>(i)]);
    EXPECT_TRUE(queued) << what << " recorded query " << i;
  }
  be->finish_reductions();  // (before any early return: the queued sums land in this frame's vectors)
  ASSERT_TRUE(queued) << what;
  for (int i = 0; i < n; ++i) {
    const std::string w = what + " recorded query " + std::to_string(i);
    be->recorded_attention(kv, 0, Q.row_view(i, 1), l1, {at[static_cast<size_t>(i)]}, &tr, one);
    ASSERT_EQ(one.size(), 1u) << w;
    const RecordedAttention &a = all[static_cast<size_t>(i)], &b = one[0];
    EXPECT_EQ(a.n_max, b.n_max) << w;
    EXPECT_EQ(a.key_pos, b.key_pos) << w;
    EXPECT_EQ(a.scores, b.scores) << w;
    EXPECT_EQ(a.probs, b.probs) << w;
    // The decode rows it saw: those at positions up to its own (where no method moved decode
    // rows out of the tail, as recording requires).
    int tail = 0;
    for (size_t j = 0; j < static_cast<size_t>(a.n_max); ++j) tail += a.key_pos[j] >= T;
    if (!policy || !policy->acts_on_decode()) {
      EXPECT_EQ(tail, i + 1) << w;
    }
    if (!by_span) continue;
    const size_t per = static_cast<size_t>(c.NH) * span;
    const std::vector<float> x(sums.begin() + i * per, sums.begin() + (i + 1) * per);
    EXPECT_EQ(x, singles[static_cast<size_t>(i)]) << w;
    std::vector<float> ref(per);
    span_attention_sums(a.probs.data(), a.key_pos.data(), c.NH, c.NKV, a.n_max, first, span, ref.data());
    for (int hd = 0; hd < c.NH; ++hd) {
      float m = 0;
      for (int j = 0; j < a.n_max; ++j) {
        const float v = a.scores[static_cast<size_t>(hd) * a.n_max + j];
        if (std::isfinite(v)) m = std::max(m, std::abs(v));
      }
      const double rel = std::ldexp(4.0 + 32 * (m + std::abs(tr.tau1) + std::abs(tr.tau2) + 1), -24);
      for (int k = 0; k < span; ++k) {
        const size_t e = static_cast<size_t>(hd) * span + k;
        EXPECT_LE(std::abs(double(x[e]) - ref[e]), ref[e] * rel + std::ldexp(1.0, -140)) << w << " head " << hd << " patch " << k;
      }
    }
  }
}

void run_case(const DecodeCase& c) {
  const int T = c.n_sys + c.n_vis + c.n_post;
  const AttnLayout lp = layout_of(c, T), l1 = layout_of(c, 1);
  const std::string what = (c.method.empty() ? std::string("full") : c.method) + " D=" + std::to_string(c.D) +
                           (c.capture ? " captured" : "");
  std::vector<SegmentKind> kinds;
  kinds.insert(kinds.end(), c.n_sys, SegmentKind::System);
  kinds.insert(kinds.end(), c.n_vis, SegmentKind::Visual);
  kinds.insert(kinds.end(), c.n_post, SegmentKind::PostVisionText);
  std::vector<int> ids(T, 7);
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; ++t) pos[t] = t;
  const auto qkv = projections(c, lp, T);
  // Prefill attention (for methods that score tokens), from the CPU backend.
  std::vector<float> pscores(static_cast<size_t>(c.NH) * T * T), pprobs(pscores.size()), pq;
  {
    Backend& cpu = *op_backends().cpu;
    Buffer X = make(cpu, "qkv", {T, lp.row_stride}, Dt::F32, qkv);
    Buffer O = cpu.alloc("o", {T, static_cast<int64_t>(c.NH) * c.D}, Dt::F32);
    cpu.attention(X, lp, O, pscores.data(), pprobs.data());
    for (int t = 0; t < T; ++t) pq.insert(pq.end(), qkv.begin() + t * lp.row_stride, qkv.begin() + t * lp.row_stride + c.NH * c.D);
  }
  Side sides[2];
  sides[0].be = op_backends().cpu.get();
  sides[1].be = op_backends().gpu.get();
  const int nb = sides[1].be ? 2 : 1;  // the CPU half runs everywhere
  for (int si = 0; si < nb; ++si) {
    Side& s = sides[si];
    s.store = KVStore(1, c.NKV, c.D);
    s.dev = s.be->kv_create(1, c.NKV, c.D);
    if (!c.method.empty()) s.policy = make_policy(c.method);
    Buffer X = make(*s.be, "qkv", {T, lp.row_stride}, Dt::F32, qkv);
    Buffer P = make_ids(*s.be, "pos", pos);
    SeqKV kv = s.kv();
    s.be->kv_append(kv, 0, X, lp, P, pos.data(), kinds.data(), T);
  }
  Side &cpu = sides[0], &gpu = sides[1];
  const bool g = nb == 2;
  // The mirrored host rows are the device's rows.
  for (int h = 0; g && h < c.NKV; ++h) {
    std::vector<float> k0, v0, k1, v1;
    std::vector<int32_t> p0, p1;
    cpu.store.gather(0, h, k0, v0, p0);
    gpu.store.gather(0, h, k1, v1, p1);
    EXPECT_EQ(k0, k1) << what;
    EXPECT_EQ(v0, v1) << what;
    EXPECT_EQ(p0, p1) << what;
  }
  if (g) {
    EXPECT_EQ(gpu.dev->allocated(), gpu.dev->bytes().total()) << what << ": prompt cache";
  }
  if (cpu.policy) {
    const auto ctx = contexts(c, pq, pprobs, pscores, kinds, ids);
    cpu.policy->on_prefill(ctx, cpu.store);
    if (g) {
      gpu.policy->on_prefill(ctx, gpu.store);
      gpu.be->kv_sync(*gpu.dev, gpu.store, -1);
      EXPECT_EQ(gpu.dev->allocated(), gpu.dev->bytes().total()) << what << ": compressed cache";
    }
  }
  if (g) {
    check_bytes(gpu, cpu, c.D, c.packed, what + " after prefill");
    gpu.be->kv_reserve(*gpu.dev, c.reserve);
  }
  for (int step = 0; step < c.steps; ++step) {
    const auto row = projections(c, l1, 1);
    const int32_t p = T + step;
    const SegmentKind gen = SegmentKind::Generated;
    std::vector<float> outs[2], sc[2], pr[2], raw[2], tap_out[2];
    int n_max = 0;
    for (int h = 0; h < c.NKV; ++h) n_max = std::max(n_max, cpu.store.n_rows(0, h) + 1);
    for (int i = 0; i < nb; ++i) {
      Side& s = sides[i];
      Buffer X = make(*s.be, "qkv1", {1, l1.row_stride}, Dt::F32, row);
      Buffer P = make_ids(*s.be, "pos1", {p});
      SeqKV kv = s.kv();
      s.be->kv_append(kv, 0, X, l1, P, &p, &gen, 1);
      if (s.policy) {
        DecodeContext d;
        d.layer = 0; d.step = step; d.position = p; d.n_heads = c.NH; d.n_kv_heads = c.NKV; d.head_dim = c.D;
        d.q = row.data();
        s.policy->on_decode_step(d, s.store.layer(0));
        if (s.dev) {
          s.be->kv_sync(*s.dev, s.store, 0);
          // Again with nothing changed since: the layout (and the decode tables) stay.
          const uint64_t v = s.dev->version();
          s.be->kv_sync(*s.dev, s.store, 0);
          EXPECT_EQ(s.dev->version(), v) << what << ": a sync with nothing changed, step " << step;
        }
      }
      Buffer O = poisoned(*s.be, "out", {1, static_cast<int64_t>(c.NH) * c.D}, Dt::F32);
      sc[i].assign(static_cast<size_t>(c.NH) * n_max, 0.0f);
      pr[i].assign(sc[i].size(), 0.0f);
      const ScoreTransform tr = s.policy ? s.policy->score_transform() : ScoreTransform{};
      raw[i].assign(sc[i].size(), 0.0f);
      tap_out[i].assign(static_cast<size_t>(c.NH) * c.D, 0.0f);
      DecodeTaps taps;
      if (c.capture) {
        taps.scores = sc[i].data();
        taps.probs = pr[i].data();
        taps.raw_scores = raw[i].data();
        taps.out = tap_out[i].data();
        taps.n_max = n_max;
      }
      s.be->decode_attention(X, l1, kv, 0, &tr, O, taps);
      outs[i] = read(*s.be, O);
      // The fp32 output tap is the output itself when the output buffer is fp32; without a
      // transform the scores before it are the scores after it.
      if (c.capture) {
        EXPECT_EQ(tap_out[i], outs[i]) << what << " output tap, side " << i;
        if (!tr.any()) {
          EXPECT_EQ(raw[i], sc[i]) << what << " raw scores without a transform, side " << i;
        }
      }
    }
    if (g) check_bytes(gpu, cpu, c.D, c.packed, what + " step " + std::to_string(step));
    std::vector<float> ref;
    std::vector<double> bound;
    std::vector<std::vector<float>> rs;
    const std::vector<float> q(row.begin(), row.begin() + c.NH * c.D);
    reference(cpu.store, q, c, l1, cpu.policy.get(), ref, bound, rs);
    expect_within(outs[0], ref, bound, "cpu " + what + " step " + std::to_string(step));
    if (!g) continue;
    expect_within(outs[1], ref, bound, "cuda " + what + " step " + std::to_string(step));
    if (c.capture) {
      for (int hd = 0; hd < c.NH; ++hd) {
        const int n = static_cast<int>(rs[hd].size());
        std::vector<float> g(sc[1].begin() + hd * n_max, sc[1].begin() + hd * n_max + n);
        std::vector<float> g0(sc[0].begin() + hd * n_max, sc[0].begin() + hd * n_max + n);
        std::vector<float> pg(pr[1].begin() + hd * n_max, pr[1].begin() + hd * n_max + n);
        std::vector<float> p0(pr[0].begin() + hd * n_max, pr[0].begin() + hd * n_max + n);
        double amax = 0;
        for (float x : g0) amax = std::max(amax, std::abs(double(x)));
        expect_within(g, g0, bound_rel(g0, 64 * dot_rel(c.D) * (amax + 1), 0), "cuda " + what + " scores");
        std::vector<float> rg(raw[1].begin() + hd * n_max, raw[1].begin() + hd * n_max + n);
        std::vector<float> r0(raw[0].begin() + hd * n_max, raw[0].begin() + hd * n_max + n);
        double rmax = 0;
        for (float x : r0) rmax = std::max(rmax, std::abs(double(x)));
        expect_within(rg, r0, bound_rel(r0, 64 * dot_rel(c.D) * (rmax + 1), 0), "cuda " + what + " raw scores");
        expect_within(pg, p0, bound_rel(p0, 1e-6, 128 * dot_rel(c.D) * (amax + 1)), "cuda " + what + " probs");
        for (int j = n; j < n_max; ++j) EXPECT_EQ(pr[1][hd * n_max + j], 0.0f) << what << " probability padding";
      }
    }
  }
  if (g && gpu.be->records_decode_queries()) recorded_queries_case(c, gpu.be, gpu.kv(), T, gpu.policy.get(), what);
}

// A plain decode step's fused RoPE + append (no host rows): the new K/V row in the device tail
// and the rotated query equal the CPU's rope on the same projections, rounded to fp16.
TEST(DecodeOps, RopeAppendFused) {
  KVLENS_NEED_GPU();
  DecodeCase c;
  c.NH = 6;
  c.NKV = 2;
  const AttnLayout l1 = layout_of(c, 1);
  Backend& cpu = *op_backends().cpu;
  Backend& gpu = *op_backends().gpu;
  KVStore host(1, c.NKV, c.D);
  auto dev = gpu.kv_create(1, c.NKV, c.D);
  SeqKV kv{&host, dev.get(), false};
  append_prompt(gpu, kv, c, 37);
  gpu.kv_reserve(*dev, 4);
  const auto row = randn(static_cast<size_t>(l1.row_stride));
  const int32_t p = 1234;
  const SegmentKind gen = SegmentKind::Generated;
  Buffer Xg = make(gpu, "qkv1", {1, l1.row_stride}, Dt::F32, row), Pg = make_ids(gpu, "pos1", {p});
  gpu.rope_append(kv, 0, Xg, l1, Pg, &p, &gen, 1, 10000.0f);
  Buffer Xc = make(cpu, "qkv1", {1, l1.row_stride}, Dt::F32, row), Pc = make_ids(cpu, "pos1", {p});
  cpu.rope(Xc, l1, Pc, 10000.0f);
  const auto got = read(gpu, Xg), want = read(cpu, Xc);
  std::vector<double> bound(want.size());
  for (size_t i = 0; i < want.size(); ++i) bound[i] = 16 * unit(Dt::F32) * (std::abs(want[i]) + 1);
  expect_within(got, want, bound, "rope_append: rotated q and k in place");
  KVStore back;
  gpu.kv_hydrate(*dev, back, true);
  ASSERT_EQ(back.layer(0).segments.size(), 2u);
  const KVSegment& tail = back.layer(0).segments.back();
  EXPECT_EQ(tail.kind, SegmentKind::Generated);
  for (int h = 0; h < c.NKV; ++h) {
    ASSERT_EQ(tail.heads[h].n(), 1);
    EXPECT_EQ(tail.heads[h].pos[0], p);
    std::vector<float> k(c.D), v(c.D);
    std::vector<double> kb(c.D);
    for (int d = 0; d < c.D; ++d) {
      k[d] = quant::round_half(want[l1.k_col + h * c.D + d]);
      v[d] = quant::round_half(row[l1.v_col + h * c.D + d]);
      // fp32 rope to a few ulps, then fp16 rounding: near a rounding boundary one fp16 step
      kb[d] = 16 * unit(Dt::F32) * (std::abs(k[d]) + 1) + 2 * unit(Dt::F16) * std::abs(k[d]) + tiny(Dt::F16);
    }
    expect_within(tail.heads[h].k, k, kb, "rope_append: appended key");
    EXPECT_EQ(tail.heads[h].v, v) << "rope_append: appended value";
  }
  // The layout alone: the same segments, positions and bytes, no rows, and reading rows refused.
  KVStore layout;
  gpu.kv_hydrate(*dev, layout, false);
  EXPECT_TRUE(back.has_rows());
  EXPECT_FALSE(layout.has_rows());
  expect_layout_of(layout.layer(0), back.layer(0));
  std::vector<float> K, V;
  std::vector<int32_t> P;
  EXPECT_THROW(layout.gather(0, 0, K, V, P), InternalError);
}

TEST(DecodeOps, FullCacheFp16) {
  run_case({});
  KVLENS_GPU_HALF_SKIPPED();
}
TEST(DecodeOps, FullCacheCaptured) {
  DecodeCase c;
  c.capture = true;
  c.NKV = 8;
  run_case(c);
  KVLENS_GPU_HALF_SKIPPED();
}
TEST(DecodeOps, HeadDims) {
  for (int D : {64, 24, 8, 32}) {
    DecodeCase c;
    c.D = D;
    c.NH = 6;
    c.NKV = 3;
    c.n_vis = 61;
    c.method = "calibquant:bits=2";
    run_case(c);
  }
  KVLENS_GPU_HALF_SKIPPED();
}
TEST(DecodeOps, CalibQuantBitsInKernelCalibration) {
  for (const char* m : {"calibquant:bits=1", "calibquant:bits=2", "calibquant:bits=4,calibrate=force",
                        "calibquant:bits=8", "calibquant:preset=official", "calibquant:bits=1,calibrate=off"}) {
    DecodeCase c;
    c.method = m;
    c.NKV = 8;
    run_case(c);
  }
  KVLENS_GPU_HALF_SKIPPED();
}
TEST(DecodeOps, CalibQuantCapturedOnTheHost) {
  DecodeCase c;
  c.method = "calibquant:bits=1,tau1=0.5,tau2=2";
  c.capture = true;
  run_case(c);
  KVLENS_GPU_HALF_SKIPPED();
}
TEST(DecodeOps, UniformKiviZipCacheFull16) {
  for (const char* m : {"uniform:bits=4,k_granularity=per-token,v_granularity=per-channel",
                        "uniform:bits=3,k_granularity=global,v_granularity=global",
                        "uniform:bits=2,k_granularity=per-token,v_granularity=per-token",
                        "kivi:bits=2,group=32,residual=16", "kivi:bits=4,group=20,residual=8",
                        "zipcache", "zipcache:high_bits=8,low_bits=1,gap=3", "full:storage=fp16"}) {
    DecodeCase c;
    c.method = m;
    c.steps = 12;
    run_case(c);
  }
  KVLENS_GPU_HALF_SKIPPED();
}
// ZipCache's quantization groups held packed on the device: a layer's prompt as one group
// (salient and regular subsets over every segment) with V token ranges shared by the KV heads
// (the paper's default) or per head, channel factors per subset or per layer (official), one
// ranking for every head, each segment its own group, and streaming gaps compressed during
// decode; the decode output against the host store's dequantized rows, device bytes as reported.
TEST(DecodeOps, ZipCacheGroupsPackedOnTheDevice) {
  for (const char* m : {"zipcache:gap=4", "zipcache:preset=official,gap=5", "zipcache:value_token_range=head,gap=4",
                        "zipcache:saliency_ratio=0.25,saliency_heads=shared,gap=4", "zipcache:ranges=segment,gap=4",
                        "zipcache:ranges=segment,value_token_range=head,high_bits=8,low_bits=1,gap=3"}) {
    DecodeCase c;
    c.method = m;
    c.steps = 11;
    c.packed = true;
    run_case(c);
  }
  KVLENS_GPU_HALF_SKIPPED();
}
TEST(DecodeOps, EvictionAndMergingCompactOnTheDevice) {
  for (const char* m : {"snapkv:budget=0.4,window=8", "h2o", "lookm:alpha1=0.2,alpha2=0.2", "streamingllm",
                        "stack:evict=snapkv,quant=calibquant,budget=0.5,bits=1", "turboquant"}) {
    DecodeCase c;
    c.method = m;
    c.capture = std::string(m) == "h2o";
    run_case(c);
  }
  KVLENS_GPU_HALF_SKIPPED();
}

#ifdef KVLENS_HAVE_CUDA
}  // namespace
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/zip_kernels.h"
namespace {

// The device quantize-and-pack kernels against quant::quantize_block / zipcache::cst_quantize:
// identical fp16 scales and zero points, and codes equal except where a value sits within an
// fp32 rounding of a decision boundary (then one step apart).
void quant_case(int n, int D, int bits, quant::Axis axis, float shrink, bool cst, int group = 0, int rotation = 0) {
  Backend& be = *op_backends().gpu;
  const auto x = rounded(Dt::F16, randn(static_cast<size_t>(n) * D, 2.0f));
  quant::QuantBlock ref;
  std::vector<float> xr = x;
  if (cst) zipcache::cst_quantize(xr.data(), n, D, bits, ref);
  else quant::quantize_block(xr.data(), n, D, {bits, axis, shrink, true, group, rotation}, ref);
  Buffer X = make(be, "x", {n, D}, Dt::F16, x);
  const int64_t code_bytes = static_cast<int64_t>(n) * D * bits / 8;
  Buffer C = be.alloc("codes", {(code_bytes + 3) / 4}, Dt::I32);
  const int64_t groups = group > 0 && axis != quant::Axis::PerToken ? (n + group - 1) / group : 1;
  const int64_t ranges = axis == quant::Axis::PerToken ? n : axis == quant::Axis::Global ? groups : groups * D;
  Buffer S = poisoned(be, "scale", {ranges}, Dt::F16), Z = poisoned(be, "zero", {ranges}, Dt::F16);
  Buffer F = poisoned(be, "factor", {D}, Dt::F16);
  be.synchronize();
  cudaStream_t st = nullptr;  // the legacy stream orders after the backend's synchronize
  if (cst) {
    cuda::cst_factors(X.as<__half>(), n, D, F.as<__half>(), st);
    cuda::quantize_token(X.as<__half>(), n, D, bits, F.as<__half>(), reinterpret_cast<uint8_t*>(C.data), S.as<__half>(),
                         Z.as<__half>(), st);
  } else if (axis == quant::Axis::PerToken && rotation) {
    cuda::quantize_token_rotated(X.as<__half>(), n, D, bits, rotation, reinterpret_cast<uint8_t*>(C.data), S.as<__half>(),
                                 Z.as<__half>(), st);
  } else if (axis == quant::Axis::PerToken) {
    cuda::quantize_token(X.as<__half>(), n, D, bits, nullptr, reinterpret_cast<uint8_t*>(C.data), S.as<__half>(),
                         Z.as<__half>(), st);
  } else {
    cuda::quantize_channel(X.as<__half>(), n, D, bits, axis == quant::Axis::Global ? 0 : 1, shrink, true,
                           reinterpret_cast<uint8_t*>(C.data), S.as<__half>(), Z.as<__half>(), group, st);
  }
  cudaDeviceSynchronize();
  const std::string what = "quantize n=" + std::to_string(n) + " D=" + std::to_string(D) + " bits=" +
                           std::to_string(bits) + " " + quant::axis_name(axis) + (cst ? " cst" : "") + " group " +
                           std::to_string(group) + " rotation " + std::to_string(rotation);
  const auto s = read(be, S), z = read(be, Z);
  ASSERT_EQ(s.size(), ref.scales.size()) << what;
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_EQ(s[i], quant::from_half(ref.scales[i])) << what << " scale " << i;
    EXPECT_EQ(z[i], quant::from_half(ref.zeros[i])) << what << " zero " << i;
  }
  if (cst) {
    const auto f = read(be, F);
    for (int i = 0; i < D; ++i) EXPECT_EQ(f[i], quant::from_half(ref.meta[i])) << what << " factor " << i;
  }
  std::vector<int32_t> words(static_cast<size_t>(C.numel()));
  be.download(C, words.data());
  const auto* got = reinterpret_cast<const uint8_t*>(words.data());
  ASSERT_EQ(static_cast<int64_t>(ref.codes.size()), code_bytes) << what;
  int64_t differ = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(n) * D; ++i) {
    const uint32_t a = quant::unpack_one(got, i, bits), b = quant::unpack_one(ref.codes.data(), i, bits);
    if (a != b) {
      ++differ;
      EXPECT_LE(std::abs(static_cast<int>(a) - static_cast<int>(b)), 1) << what << " code " << i;
    }
  }
  EXPECT_LE(differ, static_cast<int64_t>(n) * D / 1000 + 1) << what << ": codes that differ";
}

// The channel-wise kernels for several heads in one launch (quantize_channel_heads, as a
// segment's KV heads are quantized together): each head's block against quant::quantize_block of
// that head's rows alone, with the same bounds as quant_case, at slots spaced as given (codes
// padded to 16 bytes, plus a gap) with the poison between them left alone. With gap_rows > 0 the
// heads' rows lie that many rows apart (as a segment's heads lie within a layer's prompt rows)
// and are read there.
void quant_heads_case(int heads, int n, int D, int bits, quant::Axis axis, float shrink, int gap_rows = 0, int group = 0) {
  Backend& be = *op_backends().gpu;
  const int64_t x_stride = static_cast<int64_t>(n + gap_rows) * D;
  const auto x = rounded(Dt::F16, randn(static_cast<size_t>(heads * x_stride), 2.0f));
  const int64_t code_bytes = static_cast<int64_t>(n) * D * bits / 8, code_stride = (code_bytes + 15) / 16 * 16 + 16;
  const int64_t groups = group > 0 ? (n + group - 1) / group : 1;
  const int64_t ranges = (axis == quant::Axis::Global ? 1 : D) * groups, range_stride = ranges + 3;
  Buffer X = make(be, "x", {static_cast<int64_t>(heads) * (n + gap_rows), D}, Dt::F16, x);
  std::vector<int32_t> poison(static_cast<size_t>(heads * code_stride / 4), 0x5a5a5a5a);
  Buffer C = be.alloc("codes", {heads * code_stride / 4}, Dt::I32);
  be.upload(poison.data(), C);
  Buffer S = poisoned(be, "scale", {heads * range_stride}, Dt::F16), Z = poisoned(be, "zero", {heads * range_stride}, Dt::F16);
  be.synchronize();
  cuda::quantize_channel_heads(X.as<__half>(), gap_rows ? x_stride : 0, heads, n, D, bits, axis == quant::Axis::Global ? 0 : 1, shrink, true,
                               reinterpret_cast<uint8_t*>(C.data), code_stride, S.as<__half>(), Z.as<__half>(),
                               range_stride, group, nullptr);
  cudaDeviceSynchronize();
  const auto s = read(be, S), z = read(be, Z);
  std::vector<int32_t> words(static_cast<size_t>(C.numel()));
  be.download(C, words.data());
  const auto* got = reinterpret_cast<const uint8_t*>(words.data());
  for (int h = 0; h < heads; ++h) {
    const std::string what = "heads=" + std::to_string(heads) + " head " + std::to_string(h) + " n=" + std::to_string(n) +
                             " bits=" + std::to_string(bits) + " " + quant::axis_name(axis);
    const auto x0 = x.begin() + static_cast<std::ptrdiff_t>(h * x_stride);
    std::vector<float> xr(x0, x0 + static_cast<std::ptrdiff_t>(n) * D);
    quant::QuantBlock ref;
    quant::quantize_block(xr.data(), n, D, {bits, axis, shrink, true, group}, ref);
    ASSERT_EQ(static_cast<int64_t>(ref.scales.size()), ranges) << what;
    for (int64_t i = 0; i < ranges; ++i) {
      EXPECT_EQ(s[static_cast<size_t>(h * range_stride + i)], quant::from_half(ref.scales[static_cast<size_t>(i)])) << what;
      EXPECT_EQ(z[static_cast<size_t>(h * range_stride + i)], quant::from_half(ref.zeros[static_cast<size_t>(i)])) << what;
    }
    for (int64_t i = ranges; i < range_stride; ++i)
      EXPECT_TRUE(std::isnan(s[static_cast<size_t>(h * range_stride + i)])) << what << ": the gap after the ranges was written";
    int64_t differ = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(n) * D; ++i) {
      const uint32_t a = quant::unpack_one(got + h * code_stride, i, bits), b = quant::unpack_one(ref.codes.data(), i, bits);
      if (a != b) {
        ++differ;
        EXPECT_LE(std::abs(static_cast<int>(a) - static_cast<int>(b)), 1) << what << " code " << i;
      }
    }
    EXPECT_LE(differ, static_cast<int64_t>(n) * D / 1000 + 1) << what << ": codes that differ";
    for (int64_t b = code_bytes; b < code_stride; ++b) EXPECT_EQ(got[h * code_stride + b], 0x5a) << what << ": gap byte " << b;
  }
}

TEST(DecodeOps, QuantizeAndPackKernels) {
  KVLENS_NEED_GPU();
  for (int bits : {1, 2, 4}) {
    quant_heads_case(5, 91, 128, bits, quant::Axis::PerChannel, 1.0f);
    quant_heads_case(3, 40, 64, bits, quant::Axis::Global, 1.0f);
  }
  quant_heads_case(4, 150, 128, 1, quant::Axis::PerChannel, 0.5f);
  quant_heads_case(6, 77, 128, 1, quant::Axis::PerChannel, 1.0f, 40);  // heads read where they lie
  quant_heads_case(3, 33, 64, 2, quant::Axis::Global, 1.0f, 5);
  // KIVI's key groups (UniformSpec::group): ranges per group of rows, a last group cut short
  quant_heads_case(4, 70, 128, 2, quant::Axis::PerChannel, 1.0f, 0, 32);
  quant_heads_case(3, 64, 64, 4, quant::Axis::PerChannel, 1.0f, 6, 16);
  quant_heads_case(2, 9, 64, 2, quant::Axis::Global, 1.0f, 0, 4);
  quant_case(45, 128, 2, quant::Axis::PerChannel, 1.0f, false, 8);
  quant_case(45, 24, 3, quant::Axis::PerChannel, 1.0f, false, 45);  // (one group: the whole block)
  // Hadamard-INT4's keys (UniformSpec::rotation): the rows rotated in fp32 first
  quant_case(57, 128, 4, quant::Axis::PerToken, 1.0f, false, 0, 16);
  quant_case(33, 64, 4, quant::Axis::PerToken, 1.0f, false, 0, 8);
  quant_case(20, 256, 2, quant::Axis::PerToken, 1.0f, false, 0, 128);
  for (int bits : {1, 2, 3, 4, 8}) {
    quant_case(203, 128, bits, quant::Axis::PerChannel, 1.0f, false);
    quant_case(57, 24, bits, quant::Axis::PerToken, 1.0f, false);
    quant_case(33, 64, bits, quant::Axis::Global, 1.0f, false);
    quant_case(77, 128, bits, quant::Axis::PerToken, 1.0f, true);
  }
  quant_case(150, 128, 1, quant::Axis::PerChannel, 0.5f, false);  // CalibQuant's official shrink
}

// 1-bit rows regrouped channel-major on the device (the V layout of the binary decode path,
// kChannelT) against quant::channel_major_1bit on fresh random bytes: every byte equal, for whole
// groups, a tail of rows, fewer rows than a group, and several heads a launch.
TEST(DecodeOps, ChannelMajorRegroupingKernel) {
  KVLENS_NEED_GPU();
  Backend& be = *op_backends().gpu;
  std::mt19937 rng(0x1b17);
  for (const auto& [heads, n, D] : {std::array<int, 3>{1, 64, 128}, {3, 91, 128}, {2, 7, 64}, {4, 576, 128}, {1, 33, 8}}) {
    const std::string what = std::to_string(heads) + " heads x " + std::to_string(n) + " rows x " + std::to_string(D);
    const int64_t bytes = static_cast<int64_t>(n) * D / 8, stride = (bytes + 15) / 16 * 16;
    std::vector<int32_t> words(static_cast<size_t>(heads * stride / 4));
    for (int32_t& w : words) w = static_cast<int32_t>(rng());
    Buffer In = make_ids(be, "rows", words);
    Buffer Out = be.alloc("regrouped", {static_cast<int64_t>(words.size())}, Dt::I32);
    be.synchronize();
    cuda::channel_major_1bit(reinterpret_cast<const uint8_t*>(In.data), heads, n, D, stride,
                             reinterpret_cast<uint8_t*>(Out.data), nullptr);
    cudaDeviceSynchronize();
    std::vector<int32_t> got(words.size());
    be.download(Out, got.data());
    const auto* in = reinterpret_cast<const uint8_t*>(words.data());
    const auto* out = reinterpret_cast<const uint8_t*>(got.data());
    for (int h = 0; h < heads; ++h) {
      const std::vector<uint8_t> want = quant::channel_major_1bit(in + h * stride, n, D);
      ASSERT_EQ(static_cast<int64_t>(want.size()), bytes) << what;
      int64_t differ = 0;
      for (int64_t i = 0; i < bytes; ++i) differ += out[h * stride + i] != want[static_cast<size_t>(i)];
      EXPECT_EQ(differ, 0) << what << ", head " << h << ": bytes that differ";
    }
  }
}

// KIVI's pieces (quantize_pieces), several of awkward sizes in one launch, each against
// quant::quantize_block of its rows alone — keys per channel, values per token — with
// quant_case's bounds: equal ranges, codes at most one step apart near a boundary.
TEST(DecodeOps, KiviPiecesKernel) {
  KVLENS_NEED_GPU();
  Backend& be = *op_backends().gpu;
  for (const auto& [D, bits] : {std::array<int, 2>{128, 2}, {64, 4}, {72, 1}, {128, 3}, {8, 8}}) {
    const std::vector<int> sizes = {1, 3, 32, 37, 2, 16};
    int rows = 0;
    for (int n : sizes) rows += n;
    const auto k = rounded(Dt::F16, randn(static_cast<size_t>(rows) * D, 2.0f));
    const auto v = rounded(Dt::F16, randn(static_cast<size_t>(rows) * D, 1.5f));
    Buffer K = make(be, "k", {rows, D}, Dt::F16, k), V = make(be, "v", {rows, D}, Dt::F16, v);
    const int64_t row_bytes = static_cast<int64_t>(D) * bits / 8;
    Buffer KC = be.alloc("k codes", {(rows * row_bytes + 3) / 4}, Dt::I32), VC = be.alloc("v codes", {(rows * row_bytes + 3) / 4}, Dt::I32);
    const int n_pieces = static_cast<int>(sizes.size());
    Buffer KR = poisoned(be, "k ranges", {2LL * n_pieces * D}, Dt::F16), VR = poisoned(be, "v ranges", {2LL * rows}, Dt::F16);
    std::vector<cuda::GroupPiece> table(sizes.size());
    int at = 0;
    for (int i = 0; i < n_pieces; ++i) {
      cuda::GroupPiece& g = table[static_cast<size_t>(i)];
      g.k = K.as<__half>() + static_cast<int64_t>(at) * D;
      g.v = V.as<__half>() + static_cast<int64_t>(at) * D;
      g.n = sizes[static_cast<size_t>(i)];
      g.k_codes = reinterpret_cast<uint8_t*>(KC.data) + at * row_bytes;
      g.v_codes = reinterpret_cast<uint8_t*>(VC.data) + at * row_bytes;
      g.k_scale = KR.as<__half>() + 2LL * i * D;
      g.k_zero = g.k_scale + D;
      g.v_scale = VR.as<__half>() + 2LL * at;
      g.v_zero = g.v_scale + g.n;
      at += g.n;
    }
    std::vector<int32_t> words(table.size() * sizeof(cuda::GroupPiece) / 4);
    std::memcpy(words.data(), table.data(), table.size() * sizeof(cuda::GroupPiece));
    Buffer T = make_ids(be, "pieces", words);
    be.synchronize();
    cuda::quantize_pieces(reinterpret_cast<const cuda::GroupPiece*>(T.data), n_pieces, D, bits, nullptr);
    cudaDeviceSynchronize();
    const auto kr = read(be, KR), vr = read(be, VR);
    std::vector<int32_t> kw(static_cast<size_t>(KC.numel())), vw(static_cast<size_t>(VC.numel()));
    be.download(KC, kw.data());
    be.download(VC, vw.data());
    at = 0;
    for (int i = 0; i < n_pieces; ++i) {
      const int n = sizes[static_cast<size_t>(i)];
      const std::string what = "D=" + std::to_string(D) + " bits=" + std::to_string(bits) + " piece " + std::to_string(i);
      for (int side = 0; side < 2; ++side) {
        const std::vector<float>& x = side ? v : k;
        std::vector<float> xr(x.begin() + static_cast<std::ptrdiff_t>(at) * D, x.begin() + static_cast<std::ptrdiff_t>(at + n) * D);
        quant::QuantBlock ref;
        quant::quantize_block(xr.data(), n, D, {bits, side ? quant::Axis::PerToken : quant::Axis::PerChannel}, ref);
        const int ranges = side ? n : D;
        const float* s = side ? vr.data() + 2 * at : kr.data() + 2 * i * D;
        ASSERT_EQ(ref.scales.size(), static_cast<size_t>(ranges)) << what;
        for (int r = 0; r < ranges; ++r) {
          EXPECT_EQ(s[r], quant::from_half(ref.scales[static_cast<size_t>(r)])) << what << " side " << side << " scale " << r;
          EXPECT_EQ(s[ranges + r], quant::from_half(ref.zeros[static_cast<size_t>(r)])) << what << " side " << side << " zero " << r;
        }
        const auto* got = reinterpret_cast<const uint8_t*>(side ? vw.data() : kw.data()) + at * row_bytes;
        int64_t differ = 0;
        for (int64_t e = 0; e < static_cast<int64_t>(n) * D; ++e) {
          const uint32_t a = quant::unpack_one(got, e, bits), b = quant::unpack_one(ref.codes.data(), e, bits);
          if (a != b) {
            ++differ;
            EXPECT_LE(std::abs(static_cast<int>(a) - static_cast<int>(b)), 1) << what << " side " << side << " code " << e;
          }
        }
        EXPECT_LE(differ, static_cast<int64_t>(n) * D / 1000 + 1) << what << " side " << side << ": codes that differ";
      }
      at += n;
    }
  }
}
#endif

}  // namespace
