// Where the device cache holds a host segment's rows: every layer's rows by KV head and position
// (device_rows), and a segment's rows where they run within one device segment (SegmentRows),
// copied into one block by a strided copy where they lie equally spaced, else gathered.
#include <algorithm>
#include <string>
#include <vector>

#include "core/errors.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/kv_cache.h"

namespace kvlens::cuda {

namespace kv {

RowMap device_rows(const CudaKV& C, const DevLayer& d) {
  RowMap m;
  m.by_head.resize(static_cast<size_t>(C.NKV));
  // Each head's table made once at its final size (the largest position any row has).
  std::vector<int32_t> top(static_cast<size_t>(C.NKV), -1);
  for (const DevSeg& s : d.segs)
    for (int h = 0; h < C.NKV; ++h)
      for (int32_t p : s.pos[static_cast<size_t>(h)]) top[static_cast<size_t>(h)] = std::max(top[static_cast<size_t>(h)], p);
  for (int32_t p : d.tail.host_pos)
    for (int32_t& t : top) t = std::max(t, p);
  for (size_t h = 0; h < d.merged.rows.by_head.size() && h < top.size(); ++h)
    top[h] = std::max(top[h], static_cast<int32_t>(d.merged.rows.by_head[h].size()) - 1);
  for (int h = 0; h < C.NKV; ++h) m.by_head[static_cast<size_t>(h)].assign(static_cast<size_t>(top[static_cast<size_t>(h)] + 1), RowMap::Row{nullptr, nullptr});
  for (const DevSeg& s : d.segs) {
    if (!s.fp16_rows || !dense_host(s.host_storage) || s.payload) continue;
    for (int h = 0; h < C.NKV; ++h) {
      const PartDesc& p = s.heads[h].at(0).d;
      bool merged = false;
      for (uint16_t x : s.merged[h]) merged = merged || x;
      if (merged) continue;
      for (size_t i = 0; i < s.pos[h].size(); ++i)
        m.put(h, s.pos[h][i], {static_cast<const __half*>(p.k.data) + i * C.D, static_cast<const __half*>(p.v.data) + i * C.D});
    }
  }
  const Tail& t = d.tail;
  for (int h = 0; h < C.NKV && !t.packed(); ++h)  // (packed decode rows are codes, no fp16 rows)
    for (int i = t.first(h); i < t.n; ++i)
      m.put(h, t.host_pos[i], {t.k.as<__half>() + (static_cast<int64_t>(h) * t.cap + i) * C.D,
                               t.v.as<__half>() + (static_cast<int64_t>(h) * t.cap + i) * C.D});
  if (!d.merged.empty())
    for (size_t h = 0; h < d.merged.rows.by_head.size(); ++h) {
      const std::vector<RowMap::Row>& r = d.merged.rows.by_head[h];
      for (size_t p = 0; p < r.size(); ++p)
        if (r[p].first) m.put(static_cast<int>(h), static_cast<int32_t>(p), r[p]);
    }
  return m;
}

int64_t run_within(const std::vector<int32_t>& p, const std::vector<int32_t>& q) {
  if (p.empty()) return 0;
  if (p.size() > q.size()) return -1;
  const auto first = std::find(q.begin(), q.end(), p.front());
  if (static_cast<size_t>(q.end() - first) < p.size() || !std::equal(p.begin(), p.end(), first)) return -1;
  return first - q.begin();
}

namespace {
// Whether host segment s lists, head by head, a run of the fp16 rows of device segment d (none of
// them merged): then head h's rows start at at[h] in d's part of head h.
bool runs_in(const KVSegment& s, const DevSeg& d, int NKV, std::vector<int64_t>& at) {
  if (s.kind != d.kind || !d.fp16_rows || d.payload || !dense_host(d.host_storage) || s.payload ||
      static_cast<int>(s.heads.size()) != NKV || static_cast<int>(d.heads.size()) != NKV)
    return false;
  at.assign(static_cast<size_t>(NKV), 0);
  for (size_t h = 0; h < static_cast<size_t>(NKV); ++h) {
    const std::vector<int32_t>& p = s.heads[h].pos;
    const std::vector<int32_t>& q = d.pos[h];
    if (d.heads[h].size() != 1) return false;
    at[h] = run_within(p, q);
    if (at[h] < 0) return false;
    const std::vector<uint16_t>& m = d.merged[h];
    for (size_t i = static_cast<size_t>(at[h]); i < std::min(m.size(), static_cast<size_t>(at[h]) + p.size()); ++i)
      if (m[i]) return false;
  }
  return true;
}
}  // namespace

bool mirrors(const KVSegment& s, const DevSeg& d, int NKV) {
  std::vector<int64_t> at;
  if (!runs_in(s, d, NKV, at)) return false;
  for (size_t h = 0; h < s.heads.size(); ++h)
    if (s.heads[h].pos.size() != d.pos[h].size()) return false;
  return true;
}

SegmentRows::SegmentRows(const CudaKV& C, const DevLayer& d, const std::vector<const KVSegment*>& segs,
                         std::string what)
    : segs_(segs), what_(std::move(what)), D_(C.D), whole_(segs.size(), nullptr), at_(segs.size()) {
  bool all = true;
  for (size_t i = 0; i < segs.size(); ++i) {
    if (d.merged.empty())
      for (const DevSeg& x : d.segs)
        if (runs_in(*segs[i], x, C.NKV, at_[i])) {
          whole_[i] = &x;
          break;
        }
    all = all && whole_[i];
  }
  if (!all) have_ = device_rows(C, d);
}

RowMap::Row SegmentRows::row(size_t seg, int h, int i) const {
  if (const DevSeg* w = whole_[seg]) {
    const PartDesc& p = w->heads[static_cast<size_t>(h)][0].d;
    const int64_t r = at_[seg][static_cast<size_t>(h)] + i;
    return {static_cast<const __half*>(p.k.data) + r * D_, static_cast<const __half*>(p.v.data) + r * D_};
  }
  const int32_t pos = segs_[seg]->heads[static_cast<size_t>(h)].pos[static_cast<size_t>(i)];
  const RowMap::Row* r = have_.find(h, pos);
  if (!r)
    throw InternalError(what_ + ", KV head " + std::to_string(h) + ": no row at position " + std::to_string(pos) +
                        " in the device cache");
  return *r;
}

bool SegmentRows::spaced(size_t seg, const __half*& k, const __half*& v, int64_t& k_stride, int64_t& v_stride) const {
  const DevSeg* w = whole_[seg];
  const std::vector<HeadRows>& heads = segs_[seg]->heads;
  if (!w || heads.empty()) return false;
  const int64_t n = heads[0].n();
  auto at = [&](size_t h, bool values) {
    const PartDesc& p = w->heads[h][0].d;
    return static_cast<const __half*>(values ? p.v.data : p.k.data) + at_[seg][h] * D_;
  };
  k = at(0, false);
  v = at(0, true);
  k_stride = heads.size() > 1 ? at(1, false) - k : n * D_;
  v_stride = heads.size() > 1 ? at(1, true) - v : n * D_;
  if (k_stride < n * D_ || v_stride < n * D_) return false;
  for (size_t h = 0; h < heads.size(); ++h)
    if (heads[h].n() != n || at(h, false) != k + static_cast<int64_t>(h) * k_stride ||
        at(h, true) != v + static_cast<int64_t>(h) * v_stride)
      return false;
  return true;
}

void SegmentRows::copy_into(Context& ctx, size_t seg, __half* out, const std::string& what) const {
  const std::vector<HeadRows>& heads = segs_[seg]->heads;
  int64_t N = 0;
  for (const HeadRows& r : heads) N += r.n();
  if (N == 0) return;
  const __half *k = nullptr, *v = nullptr;
  int64_t k_stride = 0, v_stride = 0;
  if (spaced(seg, k, v, k_stride, v_stride)) {  // one strided copy a side
    const size_t width = static_cast<size_t>(heads[0].n()) * D_ * 2;
    KV_CUDA(cudaMemcpy2DAsync(out, width, k, static_cast<size_t>(k_stride) * 2, width, heads.size(),
                              cudaMemcpyDeviceToDevice, ctx.stream),
            what + " keys");
    KV_CUDA(cudaMemcpy2DAsync(out + N * D_, width, v, static_cast<size_t>(v_stride) * 2, width, heads.size(),
                              cudaMemcpyDeviceToDevice, ctx.stream),
            what + " values");
    return;
  }
  std::vector<const __half*> src(static_cast<size_t>(2 * N));  // keys, then values
  size_t at = 0;
  for (size_t h = 0; h < heads.size(); ++h)
    for (int i = 0; i < heads[h].n(); ++i, ++at) {
      const RowMap::Row r = row(seg, static_cast<int>(h), i);
      src[at] = r.first;
      src[at + static_cast<size_t>(N)] = r.second;
    }
  const int64_t bytes = 2 * N * static_cast<int64_t>(sizeof(void*));
  DevMem L{ctx.alloc(bytes, what + " gather list"), bytes};
  ctx.upload(L.mem.get(), src.data(), bytes, what + " gather list");
  gather_rows(static_cast<const __half* const*>(L.mem.get()), out, static_cast<int>(2 * N), D_, ctx.stream);
}

}  // namespace kv

}  // namespace kvlens::cuda
