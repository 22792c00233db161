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
  // The probabilities as `attention` captures them, then reduced in place of a copy.
  const int64_t n = static_cast<int64_t>(H) * T * T;
  const auto P = ctx.alloc(n * 4, "attention reduction probabilities");
  attention_scores(qkv.as<float>(), l, static_cast<float*>(P.get()), ctx.stream);
  softmax_rows(static_cast<float*>(P.get()), static_cast<int64_t>(H) * T, T, ctx.stream);
  const auto q = ctx.alloc(static_cast<int64_t>(nq) * 4, "attention reduction query rows");
  ctx.upload(q.get(), r.queries.data(), static_cast<int64_t>(nq) * 4, "attention reduction query rows");
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

void exact_decode_attention(Context& ctx, const Buffer& qkv, const AttnLayout& l, const Buffer& prompt,
                            const AttnLayout& pl, const ExtraRows& extra, ExactAttention& x) {
  const int NH = l.n_heads, NKV = l.n_kv_heads, D = l.head_dim, T = pl.T, m = extra.n, n = T + m;
  need(qkv.dt == Dt::F32 && prompt.dt == Dt::F32 && pl.n_heads == NH && pl.n_kv_heads == NKV && pl.head_dim == D &&
           NKV > 0 && NH % NKV == 0 && prompt.rows() >= T,
       "exact_decode_attention: " + qkv.name + " against " + prompt.name);
  need(extra.pos.size() == static_cast<size_t>(NKV) * m && extra.k.size() == extra.pos.size() * D &&
           extra.v.size() == extra.k.size(),
       "exact_decode_attention: extra rows of " + std::to_string(NKV) + " KV heads");
  // The extra rows in one upload (keys, values, positions), the results in one copy back.
  const int64_t rk = static_cast<int64_t>(extra.k.size()) * 4, rp = static_cast<int64_t>(extra.pos.size()) * 4;
  std::shared_ptr<void> rows;
  if (m > 0) {
    std::vector<char> staged(static_cast<size_t>(2 * rk + rp));
    std::memcpy(staged.data(), extra.k.data(), static_cast<size_t>(rk));
    std::memcpy(staged.data() + rk, extra.v.data(), static_cast<size_t>(rk));
    std::memcpy(staged.data() + 2 * rk, extra.pos.data(), static_cast<size_t>(rp));
    rows = ctx.alloc(2 * rk + rp, "exact attention extra rows");
    ctx.upload(rows.get(), staged.data(), 2 * rk + rp, "exact attention extra rows");
  }
  const char* r = static_cast<const char*>(rows.get());
  const int64_t sp = static_cast<int64_t>(NH) * n * 4, so = (2 * sp + 7) / 8 * 8, ob = static_cast<int64_t>(NH) * D * 8;
  const auto res = ctx.alloc(so + ob, "exact attention results");
  char* o = static_cast<char*>(res.get());
  cuda::exact_attention(prompt.as<float>(), pl.row_stride, pl.k_col, pl.v_col, T, qkv.as<float>() + l.q_col,
                        m ? reinterpret_cast<const float*>(r) : nullptr,
                        m ? reinterpret_cast<const float*>(r + rk) : nullptr,
                        m ? reinterpret_cast<const int*>(r + 2 * rk) : nullptr, m, NH, NKV, D, pl.scale,
                        reinterpret_cast<float*>(o), reinterpret_cast<float*>(o + sp), reinterpret_cast<double*>(o + so),
                        ctx.stream);
  std::vector<char> back(static_cast<size_t>(so + ob));
  ctx.download(back.data(), o, so + ob, "exact attention results");
  x.n = n;
  x.scores.resize(static_cast<size_t>(NH) * n);
  x.probs.resize(x.scores.size());
  x.out.resize(static_cast<size_t>(NH) * D);
  std::memcpy(x.scores.data(), back.data(), static_cast<size_t>(sp));
  std::memcpy(x.probs.data(), back.data() + sp, static_cast<size_t>(sp));
  std::memcpy(x.out.data(), back.data() + so, static_cast<size_t>(ob));
  x.pos = exact_positions(NKV, T, extra);
}

}  // namespace kvlens::cuda
