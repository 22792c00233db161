// KIVI's streaming groups on the GPU (StepQuant::group). Before a decode step appends its row,
// each KV head whose trailing dense rows — the prompt's last fp16 segments, then the decode
// rows — number, with that row, at least residual + group has its oldest such rows quantized in
// whole groups so that `residual` stay dense, as KIVI's on_decode_step does to the host store:
// the rows taken from one segment are one piece, a packed segment put before what is left of
// that segment (the whole segment when all of it is taken; the decode rows' pieces before the
// decode rows), keys with a range per channel over the piece, values one per row. The decode
// tables then read the codes; the decode rows' part starts past the rows taken (Tail::start).
// Every layer's pieces of a step are made by one launch from one upload.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/errors.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/kv_cache.h"
#include "core/trace.h"

namespace kvlens::cuda {

using namespace kv;

namespace {

// A segment the host keeps dense (KVSegment::dense): fp16 rows on the device.
bool dense_seg(const DevSeg& s) { return dense_host(s.host_storage) && !s.payload; }

int quantizable(const StepQuant& q, int n) { return n > q.residual ? (n - q.residual) / q.group * q.group : 0; }

// The rows each KV head of layer d gives up before this step's row; `from`: the first of the
// trailing dense segments.
std::vector<int> rows_due(const CudaKV& C, const DevLayer& d, size_t& from) {
  const Tail& t = d.tail;
  from = d.segs.size();
  while (from > 0 && dense_seg(d.segs[from - 1])) --from;
  std::vector<int> take(static_cast<size_t>(C.NKV), 0);
  for (int h = 0; h < C.NKV; ++h) {
    int n = t.n - t.first(h) + 1;  // (with the row this step appends)
    for (size_t i = from; i < d.segs.size(); ++i) n += static_cast<int>(d.segs[i].pos[h].size());
    take[static_cast<size_t>(h)] = quantizable(t.groups, n);
  }
  return take;
}

constexpr int64_t kAlign = 16;
int64_t aligned(int64_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

// One step's pieces over every layer: each head's arrays placed in one allocation, the pieces'
// table and positions uploaded together.
struct Plan {
  struct Head {
    int layer = 0;
    size_t seg = 0;  // the piece's index among its layer's new segments
    int h = 0, n = 0;
    const __half* k = nullptr;
    const __half* v = nullptr;
    int64_t codes = 0, ranges = 0, pos = 0;  // byte offsets of the head's arrays
  };
  std::vector<Head> heads;
  std::vector<int32_t> pos;
  int64_t bytes = 0;
};

// The piece of segment `src` (or of the decode rows) that KV heads take `cut` rows from,
// its rows at k / v: a packed segment of that kind, each head's arrays planned.
DevSeg plan_piece(const CudaKV& C, int layer, size_t index, SegmentKind kind, const std::vector<int>& cut,
                  const std::vector<const __half*>& k, const std::vector<const __half*>& v,
                  const std::vector<const int32_t*>& pos, const std::vector<const uint16_t*>& merged, Plan& plan) {
  const int NKV = C.NKV, D = C.D;
  const StepQuant& q = C.layers[static_cast<size_t>(layer)].tail.groups;
  DevSeg s;
  s.kind = kind;
  s.storage = "packed " + q.label;
  s.host_storage = q.label;
  s.fp16_rows = false;
  s.heads.resize(NKV);
  s.pos.resize(NKV);
  s.merged.resize(NKV);
  const int64_t row_bytes = static_cast<int64_t>(D) * q.k_bits / 8;
  for (int h = 0; h < NKV; ++h) {
    const int n = cut[static_cast<size_t>(h)];
    s.pos[h].assign(pos[h], pos[h] + n);
    if (merged[h]) s.merged[h].assign(merged[h], merged[h] + n);
    if (n == 0) continue;
    Plan::Head x;
    x.layer = layer;
    x.seg = index;
    x.h = h;
    x.n = n;
    x.k = k[h];
    x.v = v[h];
    x.codes = plan.bytes;
    plan.bytes += 2 * aligned(n * row_bytes);
    x.ranges = plan.bytes;
    plan.bytes += 2 * aligned(static_cast<int64_t>(D) * 2) + 2 * aligned(static_cast<int64_t>(n) * 2);
    x.pos = static_cast<int64_t>(plan.pos.size());
    plan.pos.insert(plan.pos.end(), pos[h], pos[h] + n);
    plan.heads.push_back(x);
    // As quant::set_quantized counts KIVI's payload: codes, D key ranges and n value ranges,
    // positions.
    s.bytes.codes += 2 * n * row_bytes;
    s.bytes.scales += (D + n) * 2;
    s.bytes.zeros += (D + n) * 2;
    s.bytes.indices += static_cast<int64_t>(n) * 4;
  }
  return s;
}

}  // namespace

bool kv_has_groups(const DeviceKV& dev) {
  const CudaKV& C = as_cuda(dev);
  return std::any_of(C.layers.begin(), C.layers.end(), [](const DevLayer& d) { return d.tail.grouped() || d.tail.zipped(); });
}

bool kv_groups_due(const DeviceKV& dev) {
  const CudaKV& C = as_cuda(dev);
  for (const DevLayer& d : C.layers) {
    if (d.tail.zipped()) return true;
    if (!d.tail.grouped()) continue;
    size_t from = 0;
    const std::vector<int> take = rows_due(C, d, from);
    if (std::any_of(take.begin(), take.end(), [](int x) { return x > 0; })) return true;
  }
  return false;
}

void kv_before_step(Context& ctx, SeqKV& kv) {
  trace::Scope span("kv.before_step");
  CudaKV& C = as_cuda(kv.dev);
  if (!C.layers.empty() && C.layers.front().tail.zipped()) {
    zip_gap(ctx, C);
    return;
  }
  const int NKV = C.NKV, D = C.D;
  Plan plan;
  // Per layer, the new segments in order and where each goes: before segment `at` of the layer
  // as it was (replacing it when `whole`), or at the end.
  struct NewSeg {
    DevSeg seg;
    size_t at = 0;
    bool whole = false;
  };
  std::vector<std::vector<NewSeg>> added(static_cast<size_t>(C.L));
  for (int l = 0; l < C.L; ++l) {
    DevLayer& d = C.layers[static_cast<size_t>(l)];
    Tail& t = d.tail;
    if (!t.grouped()) continue;
    size_t from = 0;
    std::vector<int> take = rows_due(C, d, from);
    if (std::all_of(take.begin(), take.end(), [](int x) { return x == 0; })) continue;
    std::vector<NewSeg>& out = added[static_cast<size_t>(l)];
    std::vector<int> cut(static_cast<size_t>(NKV));
    std::vector<const __half*> k(NKV), v(NKV);
    std::vector<const int32_t*> pos(NKV);
    std::vector<const uint16_t*> merged(NKV);
    for (size_t i = from; i < d.segs.size(); ++i) {
      const DevSeg& s = d.segs[i];
      bool any = false, partial = false;
      for (int h = 0; h < NKV; ++h) {
        const int n = static_cast<int>(s.pos[h].size());
        cut[h] = std::min(take[h], n);
        any = any || cut[h] > 0;
        partial = partial || cut[h] < n;
        k[h] = v[h] = nullptr;
        if (n > 0) {
          if (!s.fp16_rows || s.heads[h].size() != 1 || s.heads[h][0].d.k.fmt != kF16 || s.heads[h][0].d.n != n)
            throw InternalError("KIVI groups: layer " + std::to_string(l) + " segment " + std::to_string(i) +
                                " holds dense rows not as one fp16 part a head");
          k[h] = static_cast<const __half*>(s.heads[h][0].d.k.data);
          v[h] = static_cast<const __half*>(s.heads[h][0].d.v.data);
        }
        pos[h] = s.pos[h].data();
        merged[h] = s.merged[h].empty() ? nullptr : s.merged[h].data();
      }
      if (!any) continue;
      out.push_back({plan_piece(C, l, out.size(), s.kind, cut, k, v, pos, merged, plan), i, !partial});
      for (int h = 0; h < NKV; ++h) take[h] -= cut[h];
    }
    bool any = false;
    for (int h = 0; h < NKV; ++h) {
      const int f = t.first(h);
      cut[h] = std::min(take[h], t.n - f);
      any = any || cut[h] > 0;
      const int64_t at = (static_cast<int64_t>(h) * t.cap + f) * D;
      k[h] = t.k.as<__half>() + at;
      v[h] = t.v.as<__half>() + at;
      pos[h] = t.host_pos.data() + f;
      merged[h] = nullptr;
    }
    if (any) out.push_back({plan_piece(C, l, out.size(), SegmentKind::Generated, cut, k, v, pos, merged, plan), d.segs.size(), false});
  }
  if (plan.heads.empty()) return;
  // The layers and positions of the decode rows quantized now (for the host's copies, below).
  int32_t lo = INT32_MAX, hi = INT32_MIN;
  std::vector<int> host_layers;
  for (int l = 0; l < C.L; ++l)
    for (const NewSeg& a : added[static_cast<size_t>(l)]) {
      if (a.seg.kind != SegmentKind::Generated) continue;
      if (host_layers.empty() || host_layers.back() != l) host_layers.push_back(l);
      for (const std::vector<int32_t>& p : a.seg.pos)
        if (!p.empty()) lo = std::min(lo, p.front()), hi = std::max(hi, p.back());
    }

  // One allocation: every head's codes and ranges, then the pieces' table and positions, which
  // go up in one copy.
  const int64_t table_at = aligned(plan.bytes);
  const int64_t pos_at = table_at + aligned(static_cast<int64_t>(plan.heads.size() * sizeof(GroupPiece)));
  const int64_t total = pos_at + static_cast<int64_t>(plan.pos.size()) * 4;
  DevMem arena{ctx.alloc(total, "KIVI groups (" + std::to_string(plan.heads.size()) + " pieces)"), total};
  char* base = static_cast<char*>(arena.mem.get());
  std::vector<char> up(static_cast<size_t>(total - table_at));
  auto* table = reinterpret_cast<GroupPiece*>(up.data());
  // (kv_reserve gives every layer the same groups: one launch takes one width)
  const int bits = C.layers[static_cast<size_t>(plan.heads.front().layer)].tail.groups.k_bits;
  const int64_t row_bytes = static_cast<int64_t>(D) * bits / 8;
  for (size_t i = 0; i < plan.heads.size(); ++i) {
    const Plan::Head& x = plan.heads[i];
    if (C.layers[static_cast<size_t>(x.layer)].tail.groups.k_bits != bits)
      throw InternalError("KIVI groups: layers of " + std::to_string(bits) + " and " +
                          std::to_string(C.layers[static_cast<size_t>(x.layer)].tail.groups.k_bits) + " bits");
    GroupPiece& g = table[i];
    g.k = x.k;
    g.v = x.v;
    g.n = x.n;
    g.k_codes = reinterpret_cast<uint8_t*>(base + x.codes);
    g.v_codes = g.k_codes + aligned(x.n * row_bytes);
    auto* r = reinterpret_cast<__half*>(base + x.ranges);
    g.k_scale = r;
    g.k_zero = g.k_scale + aligned(static_cast<int64_t>(D) * 2) / 2;
    g.v_scale = g.k_zero + aligned(static_cast<int64_t>(D) * 2) / 2;
    g.v_zero = g.v_scale + aligned(static_cast<int64_t>(x.n) * 2) / 2;
    // The part the decode kernel reads (build_packed's for KIVI's payload, one key group).
    DevPart p;
    p.d.n = x.n;
    DevSeg& s = added[static_cast<size_t>(x.layer)][x.seg].seg;
    p.d.visual = s.kind == SegmentKind::Visual;
    p.d.k.fmt = kChannel;
    p.d.k.bits = bits;
    p.d.k.group = 0;
    p.d.k.chan_stride = 1;
    p.d.k.data = g.k_codes;
    p.d.k.scale = g.k_scale;
    p.d.k.zero = g.k_zero;
    p.d.v.fmt = kToken;
    p.d.v.bits = bits;
    p.d.v.data = g.v_codes;
    p.d.v.scale = g.v_scale;
    p.d.v.zero = g.v_zero;
    s.heads[static_cast<size_t>(x.h)].push_back(p);
  }
  std::memcpy(up.data() + (pos_at - table_at), plan.pos.data(), plan.pos.size() * 4);
  ctx.upload(base + table_at, up.data(), total - table_at, "KIVI groups' table");
  quantize_pieces(reinterpret_cast<const GroupPiece*>(base + table_at), static_cast<int>(plan.heads.size()), D, bits,
                  ctx.stream);

  // The layouts: each piece before what is left of its segment (or in its place), the decode
  // rows' pieces last; the rows taken leave their segments and the decode rows' part.
  for (int l = 0; l < C.L; ++l) {
    std::vector<NewSeg>& add = added[static_cast<size_t>(l)];
    if (add.empty()) continue;
    DevLayer& d = C.layers[static_cast<size_t>(l)];
    Tail& t = d.tail;
    std::vector<DevSeg> segs;
    size_t next = 0;
    for (size_t i = 0; i <= d.segs.size(); ++i) {
      bool replaced = false;
      for (; next < add.size() && add[next].at == i; ++next) {
        NewSeg& a = add[next];
        a.seg.mem = {arena};
        const std::vector<std::vector<int32_t>> taken = a.seg.pos;
        segs.push_back(std::move(a.seg));
        if (i == d.segs.size()) {  // the decode rows
          if (t.start.empty()) t.start.assign(static_cast<size_t>(NKV), 0);
          for (int h = 0; h < NKV; ++h) t.start[h] += static_cast<int>(taken[h].size());
        } else if (a.whole) {
          replaced = true;
        } else {  // the rest of segment i stays dense
          DevSeg& s = d.segs[i];
          int64_t rows = 0;
          for (int h = 0; h < NKV; ++h) {
            const int c = static_cast<int>(taken[h].size());
            s.pos[h].erase(s.pos[h].begin(), s.pos[h].begin() + c);
            if (!s.merged[h].empty()) s.merged[h].erase(s.merged[h].begin(), s.merged[h].begin() + c);
            if (!s.heads[h].empty()) {
              PartDesc& p = s.heads[h][0].d;
              p.n -= c;
              p.k.data = static_cast<const __half*>(p.k.data) + static_cast<int64_t>(c) * D;
              p.v.data = static_cast<const __half*>(p.v.data) + static_cast<int64_t>(c) * D;
            }
            rows += static_cast<int64_t>(s.pos[h].size());
          }
          s.bytes = fp16_bytes(rows, D);
        }
      }
      if (i < d.segs.size() && !replaced) segs.push_back(std::move(d.segs[i]));
    }
    d.segs = std::move(segs);
  }
  C.changed();
  // The host's copies of the decode rows just quantized (held by an observed decode, also while
  // its steps put off the host's rows), as the device holds them now.
  if (!host_layers.empty() && kv.host) group_rows_to_host(ctx, C, *kv.host, host_layers, lo, hi);
}

}  // namespace kvlens::cuda
