// LOOK-M where the cache is (Backend::kv_cosine_assign, kv_merge_rows): the prompt's keys are
// read from the device cache by KV head and position, in the host layout's row order; only the
// assignments come to the host, and only the contributions go back. The merged rows wait in the
// layer's Staged rows until kv_sync stores them in place of the kept rows.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/errors.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/kv_cache.h"

namespace kvlens::cuda {

using namespace kv;

namespace {

// Head h's rows of `layout` (gather_head's order) where the device cache holds them.
struct HeadRowPtrs {
  std::vector<const __half*> k, v;
  std::vector<int32_t> pos;
};
std::vector<HeadRowPtrs> layout_rows(const CudaKV& C, int layer, const LayerKV& layout, const std::string& op) {
  if (layer < 0 || layer >= C.L) throw InternalError(op + ": layer " + std::to_string(layer) + " of " + std::to_string(C.L));
  const RowMap have = device_rows(C, C.layers[static_cast<size_t>(layer)]);
  std::vector<HeadRowPtrs> out(static_cast<size_t>(C.NKV));
  for (const KVSegment& s : layout.segments) {
    if (static_cast<int>(s.heads.size()) != C.NKV)
      throw InternalError(op + ": layer " + std::to_string(layer) + " has " + std::to_string(s.heads.size()) +
                          " KV heads, the cache " + std::to_string(C.NKV));
    for (int h = 0; h < C.NKV; ++h)
      for (int32_t p : s.heads[static_cast<size_t>(h)].pos) {
        const RowMap::Row* r = have.find(h, p);
        if (!r)
          throw InternalError(op + ": layer " + std::to_string(layer) + " KV head " + std::to_string(h) +
                              ": no row at position " + std::to_string(p) + " in the device cache");
        HeadRowPtrs& o = out[static_cast<size_t>(h)];
        o.k.push_back(r->first);
        o.v.push_back(r->second);
        o.pos.push_back(p);
      }
  }
  return out;
}

}  // namespace

void kv_cosine_assign(Context& ctx, const DeviceKV& dev, int layer, const LayerKV& layout,
                      const std::vector<std::vector<int>>& keep, std::vector<std::vector<int>>& evicted,
                      std::vector<std::vector<int>>& best, std::vector<std::vector<double>>& sim) {
  const CudaKV& C = as_cuda(dev);
  const std::vector<HeadRowPtrs> rows = layout_rows(C, layer, layout, "kv_cosine_assign");
  if (keep.size() != rows.size()) throw InternalError("kv_cosine_assign: one kept list per KV head expected");
  // Every head's keys gathered into one [N][D] block, head after head.
  std::vector<const __half*> src;
  std::vector<int64_t> at(rows.size() + 1, 0);
  for (size_t h = 0; h < rows.size(); ++h) {
    src.insert(src.end(), rows[h].k.begin(), rows[h].k.end());
    at[h + 1] = static_cast<int64_t>(src.size());
  }
  const int64_t N = static_cast<int64_t>(src.size()), D = C.D;
  const std::string what = "LOOK-M keys of layer " + std::to_string(layer);
  DevMem X{ctx.alloc(std::max<int64_t>(N * D * 2, 8), what), N * D * 2};
  DevMem L{ctx.alloc(std::max<int64_t>(N * 8, 8), what + " gather list"), N * 8};
  if (N) {
    ctx.upload(L.mem.get(), src.data(), N * 8, what + " gather list");
    gather_rows(static_cast<const __half* const*>(L.mem.get()), X.as<__half>(), static_cast<int>(N), C.D, ctx.stream);
  }
  std::vector<DeviceKeys> k(rows.size());
  std::vector<const std::vector<int>*> kp(rows.size());
  for (size_t h = 0; h < rows.size(); ++h) {
    k[h] = {X.as<__half>() + at[h] * D, static_cast<int>(at[h + 1] - at[h]), true};
    kp[h] = &keep[h];
  }
  assign_by_cosine(ctx, C.D, k, kp, evicted, best, sim);
}

void kv_merge_rows(Context& ctx, DeviceKV& dev, int layer, const LayerKV& layout, MergeKind kind,
                   const std::vector<std::vector<RowAssignment>>& contrib) {
  CudaKV& C = as_cuda(&dev);
  const std::vector<HeadRowPtrs> rows = layout_rows(C, layer, layout, "kv_merge_rows");
  if (contrib.size() != rows.size()) throw InternalError("kv_merge_rows: one contribution list per KV head expected");
  DevLayer& d = C.layers[static_cast<size_t>(layer)];
  if (!d.merged.empty()) throw InternalError("kv_merge_rows: layer " + std::to_string(layer) + " was merged already");
  if (kind == MergeKind::None) return;
  // Per merged row (KV head, kept row): its kept row's halves, then its contributions in order.
  std::vector<const __half*> kc, vc, ke, ve;
  std::vector<int> first{0};
  std::vector<double> w;
  std::vector<std::pair<int, int32_t>> where;  // (KV head, position) of each merged row
  for (size_t h = 0; h < rows.size(); ++h) {
    const HeadRowPtrs& r = rows[h];
    const int n = static_cast<int>(r.pos.size());
    std::vector<std::vector<int>> by_kept(static_cast<size_t>(n));
    for (size_t j = 0; j < contrib[h].size(); ++j) {
      const RowAssignment& a = contrib[h][j];
      if (a.e < 0 || a.e >= n || a.c < 0 || a.c >= n || a.e == a.c)
        throw InternalError("kv_merge_rows: KV head " + std::to_string(h) + " row " + std::to_string(a.e) +
                            " into row " + std::to_string(a.c) + " of " + std::to_string(n));
      by_kept[static_cast<size_t>(a.c)].push_back(static_cast<int>(j));
    }
    for (int c = 0; c < n; ++c) {
      const std::vector<int>& js = by_kept[static_cast<size_t>(c)];
      if (js.empty()) continue;
      kc.push_back(r.k[static_cast<size_t>(c)]);
      vc.push_back(r.v[static_cast<size_t>(c)]);
      for (int j : js) {
        const RowAssignment& a = contrib[h][static_cast<size_t>(j)];
        if (!by_kept[static_cast<size_t>(a.e)].empty())
          throw InternalError("kv_merge_rows: KV head " + std::to_string(h) + " row " + std::to_string(a.e) +
                              " is both merged and merged into");
        ke.push_back(r.k[static_cast<size_t>(a.e)]);
        ve.push_back(r.v[static_cast<size_t>(a.e)]);
        w.push_back(a.s);
      }
      first.push_back(static_cast<int>(ke.size()));
      where.emplace_back(static_cast<int>(h), r.pos[static_cast<size_t>(c)]);
    }
  }
  const int64_t m = static_cast<int64_t>(kc.size()), nc = static_cast<int64_t>(ke.size()), D = C.D;
  if (m == 0) return;
  const std::string what = "LOOK-M merged rows of layer " + std::to_string(layer);
  // The pointer lists, weights and offsets in one upload: kc, vc, ke, ve, s, first.
  const int64_t pb = 8 * (2 * m + 2 * nc), sb = 8 * nc, fb = 4 * (m + 1);
  std::vector<char> in(static_cast<size_t>(pb + sb + fb));
  char* o = in.data();
  for (const auto* list : {&kc, &vc, &ke, &ve}) {
    std::memcpy(o, list->data(), list->size() * 8);
    o += list->size() * 8;
  }
  std::memcpy(o, w.data(), static_cast<size_t>(sb));
  std::memcpy(o + sb, first.data(), static_cast<size_t>(fb));
  DevMem args{ctx.alloc(static_cast<int64_t>(in.size()), what + " lists"), static_cast<int64_t>(in.size())};
  ctx.upload(args.mem.get(), in.data(), static_cast<int64_t>(in.size()), what + " lists");
  const auto* p = static_cast<const __half* const*>(args.mem.get());
  const char* base = static_cast<const char*>(args.mem.get());
  Staged st;
  st.k = {ctx.alloc(m * D * 2, what + " K"), m * D * 2};
  st.v = {ctx.alloc(m * D * 2, what + " V"), m * D * 2};
  cuda::merge_rows(p, p + m, reinterpret_cast<const int*>(base + pb + sb), p + 2 * m, p + 2 * m + nc,
                   reinterpret_cast<const double*>(base + pb), static_cast<int>(m), C.D, static_cast<int>(kind),
                   st.k.as<__half>(), st.v.as<__half>(), ctx.stream);
  st.rows.by_head.resize(static_cast<size_t>(C.NKV));
  for (int64_t i = 0; i < m; ++i)
    st.rows.put(where[static_cast<size_t>(i)].first, where[static_cast<size_t>(i)].second,
                {st.k.as<__half>() + i * D, st.v.as<__half>() + i * D});
  d.merged = std::move(st);
  // (No wait: the upload has read the host's lists when it returns, and the lists go back to the
  // pool in stream order, after the merge.)
}

}  // namespace kvlens::cuda
