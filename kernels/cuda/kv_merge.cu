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
// Whether host segment s lists exactly the fp16 rows of device segment d (as a prefill's
// layout does): then its rows are d's rows in order.
bool mirrors(const KVSegment& s, const DevSeg& d, int NKV) {
  if (s.kind != d.kind || !d.fp16_rows || d.payload || !dense_host(d.host_storage) || s.payload ||
      static_cast<int>(s.heads.size()) != NKV || static_cast<int>(d.heads.size()) != NKV)
    return false;
  for (int h = 0; h < NKV; ++h) {
    if (d.heads[static_cast<size_t>(h)].size() != 1 || s.heads[static_cast<size_t>(h)].pos != d.pos[static_cast<size_t>(h)])
      return false;
    for (uint16_t m : d.merged[static_cast<size_t>(h)])
      if (m) return false;
  }
  return true;
}

std::vector<HeadRowPtrs> layout_rows(const CudaKV& C, int layer, const LayerKV& layout, const std::string& op) {
  if (layer < 0 || layer >= C.L) throw InternalError(op + ": layer " + std::to_string(layer) + " of " + std::to_string(C.L));
  const DevLayer& d = C.layers[static_cast<size_t>(layer)];
  std::vector<HeadRowPtrs> out(static_cast<size_t>(C.NKV));
  // The prefill's layout: every host segment the device segment of the same index, row for row.
  bool same = d.merged.empty() && d.tail.n == 0 && layout.segments.size() == d.segs.size();
  for (size_t i = 0; same && i < d.segs.size(); ++i) same = mirrors(layout.segments[i], d.segs[i], C.NKV);
  if (same) {
    for (size_t i = 0; i < d.segs.size(); ++i)
      for (int h = 0; h < C.NKV; ++h) {
        const PartDesc& p = d.segs[i].heads[static_cast<size_t>(h)][0].d;
        const std::vector<int32_t>& pos = d.segs[i].pos[static_cast<size_t>(h)];
        HeadRowPtrs& o = out[static_cast<size_t>(h)];
        for (size_t r = 0; r < pos.size(); ++r) {
          o.k.push_back(static_cast<const __half*>(p.k.data) + r * C.D);
          o.v.push_back(static_cast<const __half*>(p.v.data) + r * C.D);
        }
        o.pos.insert(o.pos.end(), pos.begin(), pos.end());
      }
    return out;
  }
  const RowMap have = device_rows(C, d);
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

void kv_cosine_assign(Context& ctx, const DeviceKV& dev, std::vector<LayerMerge>& layers) {
  const CudaKV& C = as_cuda(dev);
  // Every layer's KV heads as one batch of problems, the keys read where they are.
  std::vector<AssignHead> heads;
  for (const LayerMerge& m : layers) {
    if (!m.layout || static_cast<int>(m.keep.size()) != C.NKV)
      throw InternalError("kv_cosine_assign: layer " + std::to_string(m.layer) + " needs its layout and one kept list a KV head");
    std::vector<HeadRowPtrs> rows = layout_rows(C, m.layer, *m.layout, "kv_cosine_assign");
    for (int h = 0; h < C.NKV; ++h) {
      AssignHead a;
      a.rows.assign(rows[static_cast<size_t>(h)].k.begin(), rows[static_cast<size_t>(h)].k.end());
      a.keep = &m.keep[static_cast<size_t>(h)];
      heads.push_back(std::move(a));
    }
  }
  std::vector<std::vector<RowAssignment>> out;
  assign_rows(ctx, C.D, true, heads, out);
  size_t x = 0;
  for (LayerMerge& m : layers) {
    m.rows.resize(static_cast<size_t>(C.NKV));
    for (int h = 0; h < C.NKV; ++h) m.rows[static_cast<size_t>(h)] = std::move(out[x++]);
  }
}

void kv_merge_rows(Context& ctx, DeviceKV& dev, MergeKind kind, const std::vector<LayerMerge>& layers) {
  CudaKV& C = as_cuda(&dev);
  if (kind == MergeKind::None) return;
  // Per merged row (layer, KV head, kept row): its kept row's halves, then its contributions in
  // order; every layer's in one upload and one launch.
  std::vector<const __half*> kc, vc, ke, ve;
  std::vector<int> first{0};
  std::vector<double> w;
  struct Where {
    int layer, head;
    int32_t pos;
  };
  std::vector<Where> where;  // of each merged row
  for (const LayerMerge& m : layers) {
    if (!m.layout || static_cast<int>(m.rows.size()) != C.NKV)
      throw InternalError("kv_merge_rows: layer " + std::to_string(m.layer) + " needs its layout and one contribution list a KV head");
    if (!C.layers.at(static_cast<size_t>(m.layer)).merged.empty())
      throw InternalError("kv_merge_rows: layer " + std::to_string(m.layer) + " was merged already");
    const std::vector<HeadRowPtrs> rows = layout_rows(C, m.layer, *m.layout, "kv_merge_rows");
    for (size_t h = 0; h < rows.size(); ++h) {
      const HeadRowPtrs& r = rows[h];
      const std::vector<RowAssignment>& contrib = m.rows[h];
      const int n = static_cast<int>(r.pos.size());
      // Contributions grouped by kept row (counting sort: the order within a group kept).
      const std::vector<int> count = contribution_counts(
          contrib, n, true, "kv_merge_rows: layer " + std::to_string(m.layer) + " KV head " + std::to_string(h));
      std::vector<int> at(static_cast<size_t>(n) + 1, 0);
      for (int c = 0; c < n; ++c) at[static_cast<size_t>(c) + 1] = at[static_cast<size_t>(c)] + count[static_cast<size_t>(c)];
      std::vector<int> order(contrib.size()), fill(at.begin(), at.end() - 1);
      for (size_t j = 0; j < contrib.size(); ++j) order[static_cast<size_t>(fill[static_cast<size_t>(contrib[j].c)]++)] = static_cast<int>(j);
      for (int c = 0; c < n; ++c) {
        const int j0 = at[static_cast<size_t>(c)], j1 = at[static_cast<size_t>(c) + 1];
        if (j0 == j1) continue;
        kc.push_back(r.k[static_cast<size_t>(c)]);
        vc.push_back(r.v[static_cast<size_t>(c)]);
        for (int j = j0; j < j1; ++j) {
          const RowAssignment& a = contrib[static_cast<size_t>(order[static_cast<size_t>(j)])];
          ke.push_back(r.k[static_cast<size_t>(a.e)]);
          ve.push_back(r.v[static_cast<size_t>(a.e)]);
          w.push_back(a.s);
        }
        first.push_back(static_cast<int>(ke.size()));
        where.push_back({m.layer, static_cast<int>(h), r.pos[static_cast<size_t>(c)]});
      }
    }
  }
  const int64_t mr = static_cast<int64_t>(kc.size()), nc = static_cast<int64_t>(ke.size()), D = C.D;
  if (mr == 0) return;
  const std::string what = "LOOK-M merged rows (" + std::to_string(mr) + ")";
  // The pointer lists, weights and offsets in one upload: kc, vc, ke, ve, s, first.
  const int64_t pb = 8 * (2 * mr + 2 * nc), sb = 8 * nc, fb = 4 * (mr + 1);
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
  DevMem K{ctx.alloc(mr * D * 2, what + " K"), mr * D * 2};
  DevMem V{ctx.alloc(mr * D * 2, what + " V"), mr * D * 2};
  cuda::merge_rows(p, p + mr, reinterpret_cast<const int*>(base + pb + sb), p + 2 * mr, p + 2 * mr + nc,
                   reinterpret_cast<const double*>(base + pb), static_cast<int>(mr), C.D, static_cast<int>(kind),
                   K.as<__half>(), V.as<__half>(), ctx.stream);
  // Each layer's merged rows wait in its Staged rows (one allocation shared by the layers).
  for (int64_t i = 0; i < mr; ++i) {
    const Where& x = where[static_cast<size_t>(i)];
    Staged& st = C.layers[static_cast<size_t>(x.layer)].merged;
    if (st.empty()) {
      st.k = K;
      st.v = V;
      st.rows.by_head.resize(static_cast<size_t>(C.NKV));
    }
    st.rows.put(x.head, x.pos, {K.as<__half>() + i * D, V.as<__half>() + i * D});
  }
  // (No wait: the upload has read the host's lists when it returns, and the lists go back to the
  // pool in stream order, after the merge.)
}

}  // namespace kvlens::cuda
