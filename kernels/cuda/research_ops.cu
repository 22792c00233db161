// The research path's device work beyond the model's ops: reductions of a layer's prefill
// attention (core/attention_reduce.h) and LOOK-M's assignment of evicted keys by cosine
// similarity (of host keys, or of a device cache's: kv_merge.cu). The CUDA backend's
// attention_reduce and cosine_assign call these.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/parallel.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "core/trace.h"

namespace kvlens::cuda {

namespace {

void need(bool ok, const std::string& what) {
  if (!ok) throw InternalError("cuda backend: " + what);
}

}  // namespace

void queue_prefill_reduction(Context& ctx, const Buffer& qkv, const AttnLayout& l, const AttentionReduction& r) {
  need(qkv.dt == Dt::F32 && l.causal, "attention_reduce: " + qkv.name + " (causal fp32 q/k/v)");
  r.check(l.T, "attention_reduce: " + qkv.name);
  const int H = l.n_heads, T = l.T, nq = static_cast<int>(r.queries.size());
  const int64_t map_cells = r.map ? static_cast<int64_t>(r.map_rows) * r.map_cols : 0;
  if (nq == 0 || T == 0) {  // nothing summed or counted
    if (r.column_sums) std::fill_n(r.column_sums, static_cast<size_t>(H) * T, 0.0);
    if (r.below) std::fill_n(r.below, H, int64_t{0});
    if (r.map) std::fill_n(r.map, map_cells, 0.0f);
    return;
  }
  // The listed query rows' probabilities as `attention` captures them ([H][rows][T]: rows are
  // independent), a pass of at most kPassRows rows (and 256 MB) at a time, each pass reduced in
  // place and its sums going on from the previous pass's.
  constexpr int kPassRows = 512;
  const int pass = static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / (int64_t{H} * T * 4), 1, kPassRows));
  const auto P = ctx.alloc(static_cast<int64_t>(H) * std::min(pass, nq) * T * 4, "attention reduction probabilities");
  // A list of consecutive rows (every row, a window, the rows after the image) goes as its first
  // row alone; another is uploaded.
  const int q0 = r.queries.front();
  const bool consecutive = r.queries.back() - q0 == nq - 1;  // (ascending: r.check)
  std::shared_ptr<void> q;
  if (!consecutive) {
    q = ctx.alloc(static_cast<int64_t>(nq) * 4, "attention reduction query rows");
    ctx.upload(q.get(), r.queries.data(), static_cast<int64_t>(nq) * 4, "attention reduction query rows");
  }
  const int64_t sums_bytes = r.column_sums ? static_cast<int64_t>(H) * T * 8 : 0, below_bytes = r.below ? H * 8 : 0;
  const int64_t bytes = sums_bytes + below_bytes + map_cells * 8;
  const auto out = ctx.alloc(std::max<int64_t>(bytes, 8), "attention reductions");
  double* sums = static_cast<double*>(out.get());
  auto* below = reinterpret_cast<unsigned long long*>(static_cast<char*>(out.get()) + sums_bytes);
  double* map = reinterpret_cast<double*>(static_cast<char*>(out.get()) + sums_bytes + below_bytes);
  if (below_bytes + map_cells)
    KV_CUDA(cudaMemsetAsync(below, 0, below_bytes + map_cells * 8, ctx.stream), "attention reductions");
  float* p = static_cast<float*>(P.get());
  for (int a0 = 0; a0 < nq; a0 += pass) {
    const int na = std::min(pass, nq - a0);
    const int* qa = q ? static_cast<const int*>(q.get()) + a0 : nullptr;
    const int qa0 = q0 + a0;  // (the pass's first row when consecutive)
    attention_scores_rows(qkv.as<float>(), l, qa, qa0, na, p, ctx.stream);
    if (r.below) softmax_below_rows(p, H, na, T, qa, qa0, r.p, r.zeros_below, below, ctx.stream);
    else softmax_rows(p, static_cast<int64_t>(H) * na, T, ctx.stream);
    if (r.column_sums) cuda::attention_column_sums(p, H, T, na, a0 > 0, sums, ctx.stream);
    if (r.map) {
      const int first = r.map_row_bin(r.queries[static_cast<size_t>(a0)], T);
      const int last = r.map_row_bin(r.queries[static_cast<size_t>(a0 + na - 1)], T);
      cuda::attention_map_sums(p, H, T, qa, qa0, na, r.map_rows, r.map_cols, r.map_keys, first, last - first + 1, map,
                               ctx.stream);
    }
  }
  // (P and q go back to the stream-ordered pool after the kernels that read them.)
  ctx.land_later(out, bytes, [r, H, T, sums_bytes, below_bytes, map_cells](const char* host) {
    if (r.column_sums) std::memcpy(r.column_sums, host, static_cast<size_t>(sums_bytes));
    if (r.below) {
      std::vector<unsigned long long> b(static_cast<size_t>(H));
      std::memcpy(b.data(), host + sums_bytes, static_cast<size_t>(below_bytes));
      for (int h = 0; h < H; ++h) r.below[h] = static_cast<int64_t>(b[static_cast<size_t>(h)]);
    }
    if (r.map) {
      std::vector<double> m(static_cast<size_t>(map_cells));
      std::memcpy(m.data(), host + sums_bytes + below_bytes, static_cast<size_t>(map_cells * 8));
      r.finish_map(m.data(), H, T);
    }
  });
}

void reduce_prefill_attention(Context& ctx, const Buffer& qkv, const AttnLayout& l, const AttentionReduction& r) {
  trace::Scope span("cuda.reduce_prefill_attention");
  queue_prefill_reduction(ctx, qkv, l, r);
  ctx.land_all("attention reductions");
}

namespace {

// LOOK-M's assignment of several KV heads' rows already on the device (row pointers to d fp32
// values), each with its kept rows: out[h] = every evicted row's assignment, as
// Backend::cosine_assign states it.
struct AssignHead {
  std::vector<const float*> rows;
  const std::vector<int>* keep = nullptr;
};

void assign_rows(Context& ctx, int d, const std::vector<AssignHead>& heads,
                 std::vector<std::vector<RowAssignment>>& out) {
  const size_t H = heads.size();
  need(d > 0, "cosine_assign: head size " + std::to_string(d));
  out.assign(H, {});
  // Every head's row pointers, problem, kept and evicted rows in one upload (each array 8-byte
  // aligned); norms, similarities and choices come back in one copy.
  auto up8 = [](int64_t b) { return (b + 7) / 8 * 8; };
  std::vector<AssignProblem> P;
  std::vector<const float*> rows;
  std::vector<int> keep, ev;
  std::vector<size_t> head_of;  // the head of each problem (heads with nothing evicted have none)
  int64_t tiles = 0;
  int max_kept = 0;
  for (size_t h = 0; h < H; ++h) {
    const AssignHead& a = heads[h];
    const std::vector<int>& kp = *a.keep;
    const int n = static_cast<int>(a.rows.size());
    if (kp.empty()) throw InternalError("cosine_assign: head " + std::to_string(h) + " keeps no row");
    std::vector<char> kept(static_cast<size_t>(n), 0);
    for (size_t j = 0; j < kp.size(); ++j) {
      if (kp[j] < 0 || kp[j] >= n || (j > 0 && kp[j] <= kp[j - 1]))
        throw InternalError("cosine_assign: head " + std::to_string(h) + " kept rows must be ascending below " +
                            std::to_string(n));
      kept[static_cast<size_t>(kp[j])] = 1;
    }
    AssignProblem p;
    p.row0 = static_cast<int64_t>(rows.size());
    p.kept0 = static_cast<int64_t>(keep.size());
    p.ev0 = static_cast<int64_t>(ev.size());
    p.tile0 = tiles;
    p.n = n;
    p.K = static_cast<int>(kp.size());
    for (int e = 0; e < n; ++e)
      if (!kept[static_cast<size_t>(e)]) ev.push_back(e);
    p.E = static_cast<int>(static_cast<int64_t>(ev.size()) - p.ev0);
    rows.insert(rows.end(), a.rows.begin(), a.rows.end());
    keep.insert(keep.end(), kp.begin(), kp.end());
    if (p.E == 0) continue;
    tiles += cosine_assign_tiles(p.E);
    max_kept = std::max(max_kept, p.K);
    P.push_back(p);
    head_of.push_back(h);
  }
  const int64_t N = static_cast<int64_t>(rows.size()), NE = static_cast<int64_t>(ev.size());
  if (P.empty()) return;
  const int64_t o_rows = 0, o_p = up8(N * 8), o_keep = o_p + up8(static_cast<int64_t>(P.size() * sizeof(AssignProblem)));
  const int64_t o_ev = o_keep + up8(static_cast<int64_t>(keep.size()) * 4), in_bytes = o_ev + up8(NE * 4);
  std::vector<char> in(static_cast<size_t>(in_bytes));
  std::memcpy(in.data() + o_rows, rows.data(), static_cast<size_t>(N) * 8);
  std::memcpy(in.data() + o_p, P.data(), P.size() * sizeof(AssignProblem));
  std::memcpy(in.data() + o_keep, keep.data(), keep.size() * 4);
  std::memcpy(in.data() + o_ev, ev.data(), static_cast<size_t>(NE) * 4);
  const int64_t o_sim = 0, o_best = NE * 8, o_norm = up8(o_best + NE * 4), out_bytes = o_norm + N * 8;
  const auto din = ctx.alloc(in_bytes, "LOOK-M rows, kept and evicted");
  const auto dout = ctx.alloc(out_bytes, "LOOK-M norms and assignments");
  ctx.upload(din.get(), in.data(), in_bytes, "LOOK-M rows, kept and evicted");
  const char* i0 = static_cast<const char*>(din.get());
  char* o0 = static_cast<char*>(dout.get());
  const auto* dp = reinterpret_cast<const AssignProblem*>(i0 + o_p);
  const auto* dk = reinterpret_cast<const int*>(i0 + o_keep);
  const auto* de = reinterpret_cast<const int*>(i0 + o_ev);
  auto* norm = reinterpret_cast<double*>(o0 + o_norm);
  auto* best = reinterpret_cast<int*>(o0 + o_best);
  auto* sim = reinterpret_cast<double*>(o0 + o_sim);
  const int np = static_cast<int>(P.size());
  cuda::cosine_assign(reinterpret_cast<const float* const*>(i0 + o_rows), N, d, dp, np, tiles, max_kept, dk, de, norm,
                      best, sim, ctx.stream);
  // Through the page-locked staging buffer: 12 bytes an evicted row (MBs for a 7B model's layers).
  char* back = static_cast<char*>(ctx.staging(o_norm, "LOOK-M assignments"));
  ctx.download(back, dout.get(), o_norm, "LOOK-M assignments");
  const auto* hs = reinterpret_cast<const double*>(back + o_sim);
  const auto* hb = reinterpret_cast<const int*>(back + o_best);
  for (size_t x = 0; x < P.size(); ++x) {
    const AssignProblem& p = P[x];
    std::vector<RowAssignment>& o = out[head_of[x]];
    o.resize(static_cast<size_t>(p.E));
    for (int i = 0; i < p.E; ++i) o[static_cast<size_t>(i)] = {ev[static_cast<size_t>(p.ev0 + i)], hb[p.ev0 + i], hs[p.ev0 + i]};
  }
}

}  // namespace

void assign_by_cosine(Context& ctx, int d, const std::vector<const std::vector<float>*>& k,
                      const std::vector<const std::vector<int>*>& keep, std::vector<std::vector<RowAssignment>>& out) {
  need(d > 0 && keep.size() == k.size(), "cosine_assign: " + std::to_string(k.size()) + " heads of keys and of kept rows");
  // Every head's keys in one upload, head after head; the rows by pointer into it.
  std::vector<int64_t> at(k.size() + 1, 0);
  for (size_t h = 0; h < k.size(); ++h) {
    need(k[h]->size() % static_cast<size_t>(d) == 0, "cosine_assign: head " + std::to_string(h) + " keys are not [n][d]");
    at[h + 1] = at[h] + static_cast<int64_t>(k[h]->size());
  }
  const auto keys = ctx.alloc(std::max<int64_t>(at.back() * 4, 8), "LOOK-M keys");
  std::vector<float> all(static_cast<size_t>(at.back()));
  std::vector<AssignHead> heads(k.size());
  const auto* base = static_cast<const float*>(keys.get());
  for (size_t h = 0; h < k.size(); ++h) {
    std::copy(k[h]->begin(), k[h]->end(), all.begin() + at[h]);
    for (int64_t r = at[h]; r < at[h + 1]; r += d) heads[h].rows.push_back(base + r);
    heads[h].keep = keep[h];
  }
  ctx.upload(keys.get(), all.data(), at.back() * 4, "LOOK-M keys");
  assign_rows(ctx, d, heads, out);
}

void exact_decode_attention(Context& ctx, const Buffer& qkv, const AttnLayout& l,
                            const std::vector<const Buffer*>& prompts, const AttnLayout& pl,
                            const std::vector<ExtraRows>& extras, std::vector<ExactAttention>& x) {
  trace::Scope span("cuda.exact_decode_attention");
  const int NH = l.n_heads, NKV = l.n_kv_heads, D = l.head_dim, T = pl.T, nq = static_cast<int>(prompts.size());
  need(qkv.dt == Dt::F32 && pl.n_heads == NH && pl.n_kv_heads == NKV && pl.head_dim == D && NKV > 0 && NH % NKV == 0 &&
           extras.size() == prompts.size() && qkv.rows() >= nq,
       "exact_decode_attention: " + qkv.name + " against " + std::to_string(nq) + " captures");
  for (int i = 0; i < nq; ++i) {
    const Buffer& P = *prompts[static_cast<size_t>(i)];
    const ExtraRows& e = extras[static_cast<size_t>(i)];
    need(P.dt == Dt::F32 && P.rows() >= T, "exact_decode_attention: " + qkv.name + " against " + P.name);
    need(e.pos.size() == static_cast<size_t>(NKV) * e.n && e.k.size() == e.pos.size() * D && e.v.size() == e.k.size(),
         "exact_decode_attention: extra rows of " + std::to_string(NKV) + " KV heads");
  }
  // The arguments and every query's extra rows in one upload, the results in one copy back.
  auto up8 = [](int64_t b) { return (b + 7) / 8 * 8; };
  const int64_t ab = up8(static_cast<int64_t>(nq) * static_cast<int64_t>(sizeof(ExactArgs)));
  std::vector<int64_t> in_at(static_cast<size_t>(nq)), out_at(static_cast<size_t>(nq));
  int64_t in_bytes = ab, out_bytes = 0;
  for (int i = 0; i < nq; ++i) {
    const ExtraRows& e = extras[static_cast<size_t>(i)];
    in_at[static_cast<size_t>(i)] = in_bytes;
    in_bytes += up8(static_cast<int64_t>(2 * e.k.size() + e.pos.size()) * 4);
    out_at[static_cast<size_t>(i)] = out_bytes;
    out_bytes += up8(2 * static_cast<int64_t>(NH) * (T + e.n) * 4) + static_cast<int64_t>(NH) * D * 8;
  }
  const auto in = ctx.alloc(in_bytes, "exact attention arguments and extra rows");
  const auto res = ctx.alloc(out_bytes, "exact attention results");
  char* din = static_cast<char*>(in.get());
  char* dout = static_cast<char*>(res.get());
  std::vector<char> staged(static_cast<size_t>(in_bytes));
  auto* args = reinterpret_cast<ExactArgs*>(staged.data());
  for (int i = 0; i < nq; ++i) {
    const ExtraRows& e = extras[static_cast<size_t>(i)];
    const int64_t rk = static_cast<int64_t>(e.k.size()) * 4, at = in_at[static_cast<size_t>(i)];
    std::memcpy(staged.data() + at, e.k.data(), static_cast<size_t>(rk));
    std::memcpy(staged.data() + at + rk, e.v.data(), static_cast<size_t>(rk));
    std::memcpy(staged.data() + at + 2 * rk, e.pos.data(), e.pos.size() * 4);
    const int64_t sp = static_cast<int64_t>(NH) * (T + e.n) * 4, o = out_at[static_cast<size_t>(i)];
    const Buffer& P = *prompts[static_cast<size_t>(i)];
    args[i] = ExactArgs{P.as<float>(), pl.row_stride, pl.k_col, pl.v_col, T,
                        qkv.as<float>() + static_cast<int64_t>(i) * l.row_stride + l.q_col,
                        e.n ? reinterpret_cast<const float*>(din + at) : nullptr,
                        e.n ? reinterpret_cast<const float*>(din + at + rk) : nullptr,
                        e.n ? reinterpret_cast<const int*>(din + at + 2 * rk) : nullptr, e.n, NH, NKV, D, pl.scale,
                        reinterpret_cast<float*>(dout + o), reinterpret_cast<float*>(dout + o + sp),
                        reinterpret_cast<double*>(dout + o + up8(2 * sp))};
  }
  ctx.upload(din, staged.data(), in_bytes, "exact attention arguments and extra rows");
  cuda::exact_attention_many(reinterpret_cast<const ExactArgs*>(din), nq, NH, D, ctx.stream);
  // Through the page-locked staging buffer: several MB at a step's every layer.
  char* back = static_cast<char*>(ctx.staging(out_bytes, "exact attention results"));
  ctx.download(back, dout, out_bytes, "exact attention results");
  x.resize(static_cast<size_t>(nq));
  // (side by side: most of the time is the host's first touch of the results' fresh pages)
  parallel_for(nq, 8, [&](int i) {
    const ExtraRows& e = extras[static_cast<size_t>(i)];
    ExactAttention& r = x[static_cast<size_t>(i)];
    const int n = T + e.n;
    const int64_t sp = static_cast<int64_t>(NH) * n * 4;
    const char* o = back + out_at[static_cast<size_t>(i)];
    r.n = n;
    r.scores.resize(static_cast<size_t>(NH) * n);
    r.probs.resize(r.scores.size());
    r.out.resize(static_cast<size_t>(NH) * D);
    std::memcpy(r.scores.data(), o, static_cast<size_t>(sp));
    std::memcpy(r.probs.data(), o + sp, static_cast<size_t>(sp));
    std::memcpy(r.out.data(), o + up8(2 * sp), r.out.size() * 8);
    r.pos = exact_positions(NKV, T, e);
  });
}

}  // namespace kvlens::cuda
