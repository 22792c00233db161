// The segments kv_sync builds (kv_cache.cu): rows gathered into fp16 segments of their own, or
// taken where a method made them (rows a codebook coded, rows a merge staged), their positions
// and copies queued in one SyncBatch.
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "core/half.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/kv_cache.h"

namespace kvlens::cuda::kv {

void SyncBatch::append(SyncBatch&& o) {
  const int64_t s0 = static_cast<int64_t>(src.size()), p0 = static_cast<int64_t>(pos.size());
  for (Gather g : o.gathers) {
    g.first += s0;
    g.pos_first += p0;
    gathers.push_back(g);
  }
  for (const auto& [k, v] : o.up_at) up_at.emplace_back(k + static_cast<size_t>(s0), v + static_cast<size_t>(s0));
  src.insert(src.end(), o.src.begin(), o.src.end());
  upk.insert(upk.end(), o.upk.begin(), o.upk.end());
  upv.insert(upv.end(), o.upv.begin(), o.upv.end());
  pos.insert(pos.end(), o.pos.begin(), o.pos.end());
  for (DevSeg& x : o.retired) retired.push_back(std::move(x));
  for (Staged& x : o.retired_rows) retired_rows.push_back(std::move(x));
  for (DevMem& x : o.targets) targets.push_back(std::move(x));
  o = SyncBatch{};
}

void SyncBatch::run(Context& ctx, int D) {
  if (gathers.empty()) return;
  // Layout of the one upload: uploaded rows (K then V halves), the pointer lists, positions,
  // the gathers.
  const int64_t n_up = static_cast<int64_t>(up_at.size()), n_src = static_cast<int64_t>(src.size());
  const int64_t o_rows = 0, o_ptr = (n_up * D * 2 * 2 + 15) / 16 * 16, o_pos = o_ptr + n_src * 8;
  const int64_t o_jobs = (o_pos + static_cast<int64_t>(pos.size()) * 4 + 15) / 16 * 16;
  const int64_t bytes = o_jobs + static_cast<int64_t>(gathers.size() * sizeof(Gather));
  DevMem U{ctx.alloc(std::max<int64_t>(bytes, 16), "KV sync upload"), bytes};
  char* u = static_cast<char*>(U.mem.get());
  auto* uk = reinterpret_cast<__half*>(u + o_rows);
  __half* uv = uk + n_up * D;
  for (int64_t i = 0; i < n_up; ++i) {  // the uploaded rows' device addresses
    src[up_at[static_cast<size_t>(i)].first] = uk + i * D;
    src[up_at[static_cast<size_t>(i)].second] = uv + i * D;
  }
  std::vector<char> host(static_cast<size_t>(bytes));
  std::memcpy(host.data() + o_rows, upk.data(), upk.size() * 2);
  std::memcpy(host.data() + o_rows + n_up * D * 2, upv.data(), upv.size() * 2);
  std::memcpy(host.data() + o_ptr, src.data(), static_cast<size_t>(n_src) * 8);
  std::memcpy(host.data() + o_pos, pos.data(), pos.size() * 4);
  std::memcpy(host.data() + o_jobs, gathers.data(), gathers.size() * sizeof(Gather));
  ctx.upload(u, host.data(), bytes, "KV sync upload");
  int64_t longest = 0;
  for (const Gather& g : gathers) longest = std::max(longest, g.rows);
  // Every segment's rows and positions in one launch.
  gather_segments(reinterpret_cast<const Gather*>(u + o_jobs), static_cast<int>(gathers.size()), longest,
                  reinterpret_cast<const __half* const*>(u + o_ptr), reinterpret_cast<const int32_t*>(u + o_pos), D,
                  ctx.stream);
}

// Head h of host segment s as device segment d's one fp16 part, its rows back to back at k and v,
// with s's positions and merge counts.
void place_head(DevSeg& d, const KVSegment& s, int h, const __half* k, const __half* v) {
  const HeadRows& r = s.heads[static_cast<size_t>(h)];
  DevPart p;
  p.d.n = r.n();
  p.d.visual = s.kind == SegmentKind::Visual;
  p.d.k.data = k;
  p.d.v.data = v;
  d.heads[static_cast<size_t>(h)].push_back(p);
  d.pos[static_cast<size_t>(h)] = r.pos;
  d.merged[static_cast<size_t>(h)] = r.merged;
}

// A segment of fp16 rows: rows found on the device are gathered there, the others uploaded (the
// copies queued in `batch`). A merged row is gathered from the rows merged on the device
// (`merged`), else uploaded. `whole`: the device segment whose rows s lists, in order (s only
// moves out of a shared allocation); `have` (the layer's rows by position) is not read then.
DevSeg build_fp16(const CudaKV& C, const KVSegment& s, const RowMap& have, const Staged& merged_rows,
                  const std::string& label, bool from_host_only, SyncBatch& batch, const DevSeg* whole) {
  Context& ctx = *C.ctx;
  const int NKV = C.NKV, D = C.D;
  DevSeg d = mirror(s, label, NKV, true);
  int64_t rows = 0;
  for (int h = 0; h < NKV; ++h) rows += s.heads[h].n();
  const std::string what = std::string("KV ") + segment_kind_name(s.kind) + " segment (" + std::to_string(rows) + " rows)";
  DevMem K{ctx.alloc(rows * D * 2, what + " K"), rows * D * 2};
  DevMem V{ctx.alloc(rows * D * 2, what + " V"), rows * D * 2};
  DevMem P{ctx.alloc(rows * 4, what + " positions"), rows * 4};
  SyncBatch::Gather g;
  g.first = static_cast<int64_t>(batch.src.size());
  g.rows = rows;
  g.k = K.as<__half>();
  g.v = V.as<__half>();
  g.pos = P.as<int32_t>();
  g.pos_first = static_cast<int64_t>(batch.pos.size());
  batch.src.resize(batch.src.size() + static_cast<size_t>(2 * rows), nullptr);
  int64_t off = 0, i_row = 0;
  for (int h = 0; h < NKV; ++h) {
    const HeadRows& r = s.heads[h];
    for (int i = 0; i < r.n(); ++i, ++i_row) {
      const bool merged = i < static_cast<int>(r.merged.size()) && r.merged[i];
      RowMap::Row in_whole;
      if (whole) {
        const PartDesc& p = whole->heads[static_cast<size_t>(h)].at(0).d;
        in_whole = {static_cast<const __half*>(p.k.data) + static_cast<int64_t>(i) * D,
                    static_cast<const __half*>(p.v.data) + static_cast<int64_t>(i) * D};
      }
      const RowMap::Row* it = whole ? &in_whole
                              : from_host_only ? nullptr
                              : !merged      ? have.find(h, r.pos[i])
                              : merged_rows.empty() ? nullptr
                                                    : merged_rows.rows.find(h, r.pos[i]);
      if (!it && s.layout_only)
        throw InternalError("kv_sync: " + what + ", KV head " + std::to_string(h) + ": the row at position " +
                            std::to_string(r.pos[i]) + " is neither on the device nor on the host");
      const size_t at = static_cast<size_t>(g.first + i_row);
      if (it) {
        batch.src[at] = it->first;
        batch.src[at + static_cast<size_t>(rows)] = it->second;
      } else {
        batch.up_at.emplace_back(at, at + static_cast<size_t>(rows));  // (run() sets both slots)
        const size_t u = batch.upk.size();
        batch.upk.resize(u + static_cast<size_t>(D));
        batch.upv.resize(u + static_cast<size_t>(D));
        to_half_n(r.k.data() + static_cast<size_t>(i) * D, batch.upk.data() + u, D);
        to_half_n(r.v.data() + static_cast<size_t>(i) * D, batch.upv.data() + u, D);
      }
      batch.pos.push_back(r.pos[i]);
    }
    place_head(d, s, h, K.as<__half>() + off * D, V.as<__half>() + off * D);
    off += r.n();
  }
  batch.gathers.push_back(g);
  batch.targets.insert(batch.targets.end(), {K, V, P});
  d.mem = {K, V, P};
  d.bytes = fp16_bytes(rows, D);
  return d;
}

// The coded rows kept for host segment s's payload (kv_code_rows), if any.
const DevLayer::Coded* coded_for(const DevLayer& d, const KVSegment& s) {
  if (!s.payload) return nullptr;
  for (const DevLayer::Coded& c : d.coded)
    if (c.payload == s.payload.get()) return &c;
  return nullptr;
}
// Whether s lists, head by head, the rows c coded in their order (a segment no method edited
// since it was coded; merged rows were coded as merged).
bool lists_coded(const KVSegment& s, const DevLayer::Coded& c) {
  if (s.heads.size() != c.pos.size()) return false;
  for (size_t h = 0; h < s.heads.size(); ++h)
    if (s.heads[h].pos != c.pos[h]) return false;
  return true;
}
// Host segment s as fp16 rows already on the device, head h's from at[h] (keys) and at[h].second
// (values), held by `mem`: no copy of the rows, their positions copied with the batch.
DevSeg adopt_rows(const CudaKV& C, const KVSegment& s, const std::string& label, const std::vector<RowMap::Row>& at,
                  std::vector<DevMem> mem, SyncBatch& batch) {
  const int NKV = C.NKV;
  DevSeg d = mirror(s, label, NKV, true);
  int64_t rows = 0;
  for (const HeadRows& r : s.heads) rows += r.n();
  DevMem P{C.ctx->alloc(std::max<int64_t>(rows, 1) * 4, "KV " + label + " segment positions"), rows * 4};
  SyncBatch::Gather g;
  g.first = static_cast<int64_t>(batch.src.size());
  g.rows = rows;
  g.pos = P.as<int32_t>();
  g.pos_first = static_cast<int64_t>(batch.pos.size());
  for (int h = 0; h < NKV; ++h) {
    const HeadRows& r = s.heads[static_cast<size_t>(h)];
    batch.pos.insert(batch.pos.end(), r.pos.begin(), r.pos.end());
    place_head(d, s, h, at[static_cast<size_t>(h)].first, at[static_cast<size_t>(h)].second);
  }
  batch.gathers.push_back(g);
  batch.targets.push_back(P);
  mem.push_back(P);
  d.mem = std::move(mem);
  d.bytes = fp16_bytes(rows, C.D);
  return d;
}

// Host segment s as the fp16 rows c coded for it, where they lie: no copy of the rows, their
// positions copied with the batch.
DevSeg adopt_coded(const CudaKV& C, const KVSegment& s, const DevLayer::Coded& c, const std::string& label,
                   SyncBatch& batch) {
  int64_t rows = 0;
  for (const HeadRows& r : s.heads) rows += r.n();
  const auto* k = c.rows.as<__half>();
  std::vector<RowMap::Row> at;
  int64_t off = 0;
  for (const HeadRows& r : s.heads) {
    at.push_back({k + off * C.D, k + (rows + off) * C.D});
    off += r.n();
  }
  return adopt_rows(C, s, label, at, {c.rows}, batch);
}

// Whether host segment s lists, head by head, a run of the rows a merge staged (Staged::pos):
// then head h's rows start at row at[h] of st.k and st.v.
bool merged_run(const Staged& st, const KVSegment& s, int NKV, std::vector<int64_t>& at) {
  if (st.empty() || s.payload || !dense_host(s.storage) || static_cast<int>(s.heads.size()) != NKV ||
      static_cast<int>(st.pos.size()) != NKV)
    return false;
  at.assign(static_cast<size_t>(NKV), 0);
  for (size_t h = 0; h < static_cast<size_t>(NKV); ++h) {
    const int64_t i = run_within(s.heads[h].pos, st.pos[h]);
    if (i < 0) return false;
    at[h] = st.first[h] + i;
  }
  return true;
}

// Host segment s as the rows a merge staged, where they lie (`at`: merged_run's): no copy of the
// rows, their positions copied with the batch.
DevSeg adopt_merged(const CudaKV& C, const KVSegment& s, const Staged& st, const std::vector<int64_t>& at,
                    SyncBatch& batch) {
  std::vector<RowMap::Row> rows;
  for (int64_t a : at) rows.push_back({st.k.as<__half>() + a * C.D, st.v.as<__half>() + a * C.D});
  return adopt_rows(C, s, "fp16", rows, {st.k, st.v}, batch);
}

}  // namespace kvlens::cuda::kv
