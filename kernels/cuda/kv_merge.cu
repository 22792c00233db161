// LOOK-M where the cache is (Backend::kv_lookm_merge): the prompt's keys and values are read
// from the device cache by KV head and position, in the host layout's row order; the
// assignment (Eq. 9), the authors' similarity filter, and the merge (Eq. 10–12) run there, every
// layer at once, and only each kept row's merge count comes to the host. Every kept row, merged
// or as it was, waits in the layer's Staged rows until kv_sync stores the layer's segments where
// those rows lie.
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/parallel.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/kv_cache.h"
#include "core/trace.h"

namespace kvlens::cuda {

using namespace kv;

namespace {

// Appends runs of contiguous rows holding head h's rows of `layout` (gather_head's order) for
// every head, from `row0` of the flat row list on: a run a device segment's head when the layout
// mirrors the layer's segments (as a prefill's does), else a run a row found by position.
// Returns each head's row count.
std::vector<int> layout_runs(const CudaKV& C, int layer, const LayerKV& layout, int64_t row0,
                             std::vector<RowSegment>& runs) {
  if (layer < 0 || layer >= C.L) throw InternalError("kv_lookm_merge: layer " + std::to_string(layer) + " of " + std::to_string(C.L));
  const DevLayer& d = C.layers[static_cast<size_t>(layer)];
  std::vector<int> n(static_cast<size_t>(C.NKV), 0);
  bool same = d.merged.empty() && d.tail.n == 0 && layout.segments.size() == d.segs.size();
  for (size_t i = 0; same && i < d.segs.size(); ++i) same = mirrors(layout.segments[i], d.segs[i], C.NKV);
  if (same) {
    for (int h = 0; h < C.NKV; ++h)
      for (const DevSeg& s : d.segs) {
        const PartDesc& p = s.heads[static_cast<size_t>(h)][0].d;
        const int64_t m = static_cast<int64_t>(s.pos[static_cast<size_t>(h)].size());
        if (m == 0) continue;
        runs.push_back({static_cast<const __half*>(p.k.data), static_cast<const __half*>(p.v.data), row0, m});
        row0 += m;
        n[static_cast<size_t>(h)] += static_cast<int>(m);
      }
    return n;
  }
  const RowMap have = device_rows(C, d);
  for (const KVSegment& s : layout.segments)
    if (static_cast<int>(s.heads.size()) != C.NKV)
      throw InternalError("kv_lookm_merge: layer " + std::to_string(layer) + " has " + std::to_string(s.heads.size()) +
                          " KV heads, the cache " + std::to_string(C.NKV));
  for (int h = 0; h < C.NKV; ++h)
    for (const KVSegment& s : layout.segments)
      for (int32_t p : s.heads[static_cast<size_t>(h)].pos) {
        const RowMap::Row* r = have.find(h, p);
        if (!r)
          throw InternalError("kv_lookm_merge: layer " + std::to_string(layer) + " KV head " + std::to_string(h) +
                              ": no row at position " + std::to_string(p) + " in the device cache");
        runs.push_back({r->first, r->second, row0++, 1});
        ++n[static_cast<size_t>(h)];
      }
  return n;
}

// Head h's position of each of its kept rows (ascending indices into the head's layout rows).
std::vector<int32_t> kept_positions(const LayerKV& layout, int h, const std::vector<int>& keep) {
  std::vector<int32_t> out;
  out.reserve(keep.size());
  size_t j = 0;
  int base = 0;
  for (const KVSegment& s : layout.segments) {
    const std::vector<int32_t>& pos = s.heads[static_cast<size_t>(h)].pos;
    const int n = static_cast<int>(pos.size());
    for (; j < keep.size() && keep[j] < base + n; ++j) out.push_back(pos[static_cast<size_t>(keep[j] - base)]);
    base += n;
  }
  return out;
}

}  // namespace

void kv_lookm_merge(Context& ctx, DeviceKV& dev, const LookMMergeSpec& spec, std::vector<LayerMerge>& layers) {
  trace::Scope span("kv.lookm_merge");
  CudaKV& C = as_cuda(&dev);
  if (spec.kind == MergeKind::None || layers.empty()) return;
  // Every layer's KV heads as problems over one flat row list (runs of contiguous rows).
  std::optional<trace::Scope> plan_span(std::in_place, "kv.lookm_merge.plan");
  std::vector<RowSegment> runs;
  std::vector<AssignProblem> P;
  std::vector<int> keep;
  int64_t N = 0, NE = 0, tiles = 0;
  int max_kept = 0;
  for (const LayerMerge& m : layers) {
    if (!m.layout || static_cast<int>(m.keep.size()) != C.NKV)
      throw InternalError("kv_lookm_merge: layer " + std::to_string(m.layer) + " needs its layout and one kept list a KV head");
    if (!C.layers.at(static_cast<size_t>(m.layer)).merged.empty())
      throw InternalError("kv_lookm_merge: layer " + std::to_string(m.layer) + " was merged already");
    for (const LayerMerge& o : layers)
      if (&o != &m && o.layer == m.layer) throw InternalError("kv_lookm_merge: layer " + std::to_string(m.layer) + " listed twice");
    const std::vector<int> n = layout_runs(C, m.layer, *m.layout, N, runs);
    for (int h = 0; h < C.NKV; ++h) {
      const std::vector<int>& kp = m.keep[static_cast<size_t>(h)];
      const int nh = n[static_cast<size_t>(h)];
      const std::string where = "kv_lookm_merge: layer " + std::to_string(m.layer) + " KV head " + std::to_string(h);
      if (kp.empty()) throw InternalError(where + " keeps no row");
      for (size_t j = 0; j < kp.size(); ++j)
        if (kp[j] < 0 || kp[j] >= nh || (j > 0 && kp[j] <= kp[j - 1]))
          throw InternalError(where + ": kept rows must be ascending below " + std::to_string(nh));
      AssignProblem p;
      p.row0 = N;
      p.kept0 = static_cast<int64_t>(keep.size());
      p.ev0 = NE;
      p.tile0 = tiles;
      p.n = nh;
      p.K = static_cast<int>(kp.size());
      p.E = nh - p.K;
      keep.insert(keep.end(), kp.begin(), kp.end());
      N += nh;
      NE += p.E;
      tiles += cosine_assign_tiles(p.E);
      if (p.E > 0) max_kept = std::max(max_kept, p.K);  // (the kept rows a block stages)
      P.push_back(p);
    }
  }
  const int64_t NK = static_cast<int64_t>(keep.size()), D = C.D;
  const int np = static_cast<int>(P.size());
  const bool filter = spec.above_mean, prefix = spec.prefix_sources && spec.kind == MergeKind::Average;
  const std::string what = "LOOK-M (" + std::to_string(np) + " heads, " + std::to_string(N) + " rows)";
  // In: problems, kept rows, runs (each 8-byte aligned). Work: row pointers, evicted rows,
  // norms, choices, similarities, sources and their scratch, counts, the merge's lists. Out: the
  // merged rows.
  auto up8 = [](int64_t b) { return (b + 7) / 8 * 8; };
  const int64_t o_p = 0, o_keep = up8(np * static_cast<int64_t>(sizeof(AssignProblem))), o_runs = o_keep + up8(NK * 4);
  const int64_t in_bytes = o_runs + static_cast<int64_t>(runs.size() * sizeof(RowSegment));
  std::vector<char> in(static_cast<size_t>(in_bytes));
  std::memcpy(in.data() + o_p, P.data(), P.size() * sizeof(AssignProblem));
  std::memcpy(in.data() + o_keep, keep.data(), keep.size() * 4);
  std::memcpy(in.data() + o_runs, runs.data(), runs.size() * sizeof(RowSegment));
  const int64_t w_k = 0, w_v = N * 8, w_norm = 2 * N * 8, w_sim = 3 * N * 8, w_ev = w_sim + NE * 8, w_best = w_ev + up8(NE * 4),
                w_src = w_best + up8(NE * 4), w_scr = w_src + (filter ? up8(NE * 4) : 0),
                w_count = w_scr + (filter ? up8(NE * 4) : 0), w_lists = w_count + up8(NK * 4),
                work_bytes = w_lists + up8((NK + NE) * 4);
  const auto din = ctx.alloc(in_bytes, what + " problems");
  const auto work = ctx.alloc(work_bytes, what + " work");
  DevMem K{ctx.alloc(NK * D * 2, what + " merged K"), NK * D * 2};
  DevMem V{ctx.alloc(NK * D * 2, what + " merged V"), NK * D * 2};
  ctx.upload(din.get(), in.data(), in_bytes, what + " problems");
  const char* i0 = static_cast<const char*>(din.get());
  char* w0 = static_cast<char*>(work.get());
  const auto* dp = reinterpret_cast<const AssignProblem*>(i0 + o_p);
  const auto* dkeep = reinterpret_cast<const int*>(i0 + o_keep);
  auto** rk = reinterpret_cast<const __half**>(w0 + w_k);
  auto** rv = reinterpret_cast<const __half**>(w0 + w_v);
  auto* ev = reinterpret_cast<int*>(w0 + w_ev);
  auto* best = reinterpret_cast<int*>(w0 + w_best);
  auto* sim = reinterpret_cast<double*>(w0 + w_sim);
  int* src = filter ? reinterpret_cast<int*>(w0 + w_src) : nullptr;
  auto* count = reinterpret_cast<int*>(w0 + w_count);
  plan_span.reset();
  segment_rows(reinterpret_cast<const RowSegment*>(i0 + o_runs), static_cast<int>(runs.size()), N, C.D, rk, rv, ctx.stream);
  evicted_rows(dp, np, dkeep, ev, ctx.stream);
  cosine_assign(rk, N, C.D, dp, np, tiles, max_kept, dkeep, ev, reinterpret_cast<double*>(w0 + w_norm), best, sim,
                ctx.stream);
  if (filter)
    merge_sources(dp, np, C.NKV, ev, sim, prefix, reinterpret_cast<int*>(w0 + w_scr), src, ctx.stream);
  merge_kept(rk, rv, dp, np, NK, NE, dkeep, ev, src, best, sim, C.D, static_cast<int>(spec.kind), K.as<__half>(),
             V.as<__half>(), count, reinterpret_cast<int*>(w0 + w_lists), ctx.stream);
  // Every kept row (merged, or copied as it was) waits in its layer's Staged rows, each layer's a
  // part of one allocation: laid out on threads while the device merges.
  {
    trace::Scope stage_span("kv.lookm_merge.stage");
    parallel_for(static_cast<int>(layers.size()), 8, [&](int i) {
      const LayerMerge& m = layers[static_cast<size_t>(i)];
      Staged& st = C.layers[static_cast<size_t>(m.layer)].merged;
      const AssignProblem* lp = P.data() + static_cast<size_t>(i) * C.NKV;
      int64_t rows = 0;
      for (int h = 0; h < C.NKV; ++h) rows += lp[h].K;
      st.k = part_of(K, lp[0].kept0 * D * 2, rows * D * 2);
      st.v = part_of(V, lp[0].kept0 * D * 2, rows * D * 2);
      st.first.assign(static_cast<size_t>(C.NKV), 0);
      st.pos.assign(static_cast<size_t>(C.NKV), {});
      st.rows.by_head.assign(static_cast<size_t>(C.NKV), {});
      for (int h = 0; h < C.NKV; ++h) {
        const size_t x = static_cast<size_t>(h);
        st.first[x] = lp[h].kept0 - lp[0].kept0;
        st.pos[x] = kept_positions(*m.layout, h, m.keep[x]);
        const std::vector<int32_t>& pos = st.pos[x];
        if (!pos.empty())
          st.rows.by_head[x].assign(static_cast<size_t>(std::max(0, *std::max_element(pos.begin(), pos.end()))) + 1,
                                    RowMap::Row{nullptr, nullptr});
        for (size_t j = 0; j < pos.size(); ++j) {
          const int64_t r = lp[h].kept0 + static_cast<int64_t>(j);
          st.rows.put(h, pos[j], {K.as<__half>() + r * D, V.as<__half>() + r * D});
        }
      }
    });
  }
  // Each kept row's merge count to the host.
  std::vector<int> counts(static_cast<size_t>(NK));
  int* back = static_cast<int*>(ctx.staging(NK * 4, what + " merge counts"));
  ctx.download(back, count, NK * 4, what + " merge counts");
  std::memcpy(counts.data(), back, static_cast<size_t>(NK) * 4);
  for (size_t i = 0; i < layers.size(); ++i) {
    LayerMerge& m = layers[i];
    m.merged.assign(static_cast<size_t>(C.NKV), {});
    for (int h = 0; h < C.NKV; ++h) {
      const AssignProblem& p = P[i * static_cast<size_t>(C.NKV) + static_cast<size_t>(h)];
      m.merged[static_cast<size_t>(h)].assign(counts.data() + p.kept0, counts.data() + p.kept0 + p.K);
    }
  }
}

}  // namespace kvlens::cuda
