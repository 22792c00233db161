// The research path's device work beyond the model's ops: reductions of a layer's prefill
// attention (core/attention_reduce.h) and LOOK-M's assignment of evicted keys by cosine
// similarity. The CUDA backend's attention_reduce and cosine_assign call these.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/errors.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

void need(bool ok, const std::string& what) {
  if (!ok) throw InternalError("cuda backend: " + what);
}

}  // namespace

void reduce_prefill_attention(Context& ctx, const Buffer& qkv, const AttnLayout& l, const AttentionReduction& r) {
  need(qkv.dt == Dt::F32 && l.causal, "attention_reduce: " + qkv.name + " (causal fp32 q/k/v)");
  r.check(l.T, "attention_reduce: " + qkv.name);
  const int H = l.n_heads, T = l.T, nq = static_cast<int>(r.queries.size());
  if (nq == 0 || T == 0) {  // nothing summed or counted
    if (r.column_sums) std::fill_n(r.column_sums, static_cast<size_t>(H) * T, 0.0);
    if (r.below) std::fill_n(r.below, H, int64_t{0});
    return;
  }
  // The listed query rows' probabilities as `attention` captures them ([H][nq][T]: rows are
  // independent), then reduced in place of a copy.
  const int64_t n = static_cast<int64_t>(H) * nq * T;
  const auto P = ctx.alloc(n * 4, "attention reduction probabilities");
  const auto q = ctx.alloc(static_cast<int64_t>(nq) * 4, "attention reduction query rows");
  ctx.upload(q.get(), r.queries.data(), static_cast<int64_t>(nq) * 4, "attention reduction query rows");
  attention_scores_rows(qkv.as<float>(), l, static_cast<const int*>(q.get()), nq, static_cast<float*>(P.get()),
                        ctx.stream);
  softmax_rows(static_cast<float*>(P.get()), static_cast<int64_t>(H) * nq, T, ctx.stream);
  if (r.column_sums) {
    const int64_t bytes = static_cast<int64_t>(H) * T * 8;
    const auto out = ctx.alloc(bytes, "attention column sums");
    cuda::attention_column_sums(static_cast<const float*>(P.get()), H, T, static_cast<const int*>(q.get()), nq,
                                static_cast<double*>(out.get()), ctx.stream);
    ctx.download(r.column_sums, out.get(), bytes, "attention column sums");
  }
  if (r.below) {
    const int64_t bytes = static_cast<int64_t>(H) * 8;
    const auto out = ctx.alloc(bytes, "attention entries below the threshold");
    KV_CUDA(cudaMemsetAsync(out.get(), 0, bytes, ctx.stream), "attention entries below the threshold");
    cuda::attention_below(static_cast<const float*>(P.get()), H, T, static_cast<const int*>(q.get()), nq, r.p,
                          r.zeros_below, static_cast<unsigned long long*>(out.get()), ctx.stream);
    std::vector<unsigned long long> b(static_cast<size_t>(H));
    ctx.download(b.data(), out.get(), bytes, "attention entries below the threshold");
    for (int h = 0; h < H; ++h) r.below[h] = static_cast<int64_t>(b[static_cast<size_t>(h)]);
  }
}

void assign_by_cosine(Context& ctx, const float* k, int n, int d, const std::vector<int>& keep, std::vector<int>& evicted,
                    std::vector<int>& best, std::vector<double>& sim) {
  need(n >= 0 && d > 0 && !keep.empty(), "cosine_assign: rows and kept rows");
  std::vector<char> kept(static_cast<size_t>(n), 0);
  for (size_t j = 0; j < keep.size(); ++j) {
    need(keep[j] >= 0 && keep[j] < n && (j == 0 || keep[j] > keep[j - 1]), "cosine_assign: kept rows ascending below n");
    kept[static_cast<size_t>(keep[j])] = 1;
  }
  evicted.clear();
  for (int e = 0; e < n; ++e)
    if (!kept[static_cast<size_t>(e)]) evicted.push_back(e);
  const int E = static_cast<int>(evicted.size()), K = static_cast<int>(keep.size());
  best.assign(static_cast<size_t>(E), -1);
  sim.assign(static_cast<size_t>(E), 0.0);
  if (E == 0) return;
  const int64_t kb = static_cast<int64_t>(n) * d * 4;
  const auto dk = ctx.alloc(kb, "LOOK-M keys");
  const auto dkeep = ctx.alloc(static_cast<int64_t>(K) * 4, "LOOK-M kept rows");
  const auto dev = ctx.alloc(static_cast<int64_t>(E) * 4, "LOOK-M evicted rows");
  const auto dnorm = ctx.alloc(static_cast<int64_t>(n) * 8, "LOOK-M key norms");
  const auto dbest = ctx.alloc(static_cast<int64_t>(E) * 4, "LOOK-M assignments");
  const auto dsim = ctx.alloc(static_cast<int64_t>(E) * 8, "LOOK-M similarities");
  ctx.upload(dk.get(), k, kb, "LOOK-M keys");
  ctx.upload(dkeep.get(), keep.data(), static_cast<int64_t>(K) * 4, "LOOK-M kept rows");
  ctx.upload(dev.get(), evicted.data(), static_cast<int64_t>(E) * 4, "LOOK-M evicted rows");
  cuda::cosine_assign(static_cast<const float*>(dk.get()), n, d, static_cast<const int*>(dkeep.get()), K,
                      static_cast<const int*>(dev.get()), E, static_cast<double*>(dnorm.get()),
                      static_cast<int*>(dbest.get()), static_cast<double*>(dsim.get()), ctx.stream);
  ctx.download(best.data(), dbest.get(), static_cast<int64_t>(E) * 4, "LOOK-M assignments");
  ctx.download(sim.data(), dsim.get(), static_cast<int64_t>(E) * 8, "LOOK-M similarities");
}

void exact_decode_attention(Context& ctx, const Buffer& qkv, const AttnLayout& l,
                            const std::vector<const Buffer*>& prompts, const AttnLayout& pl,
                            const std::vector<ExtraRows>& extras, std::vector<ExactAttention>& x) {
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
  for (int i = 0; i < nq; ++i) {
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
  }
}

}  // namespace kvlens::cuda
