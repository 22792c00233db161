// The KV cache on the GPU: per layer, segments tagged by modality as on the host, each KV head's
// rows held as fp16 or as the packed codes a quantizing policy produced (never dequantized in
// device memory), plus a growing fp16 tail for generated tokens whose row count lives on the
// device (so a captured decode step can be replayed). Bytes reported are the bytes allocated.
//
// The host KVStore stays what policies edit. After a policy ran, kv_sync makes the device
// mirror it: a segment that still equals its device copy (kind, storage, payload, positions,
// merge counts) is kept; kept rows of an evicted segment are gathered on the device from the
// rows already there (the compaction); merged rows and rows a host-only format holds are
// uploaded as fp16; packed payloads are uploaded as they are.
#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "core/errors.h"
#include "core/policies/quantize.h"
#include "core/policy.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

struct DevPart {
  PartDesc d;
  std::vector<int32_t> order;  // host row (within the segment's head) of each device row; empty = same
};

struct DevSeg {
  SegmentKind kind = SegmentKind::System;
  std::string storage = "fp16";
  std::vector<std::vector<DevPart>> heads;  // [kv head][part]
  std::vector<std::vector<int32_t>> pos;    // [kv head] positions, host order
  std::vector<DevMem> mem;
  KVBytes bytes;
  bool fp16_rows = true;  // one kF16 part per head in host order (rows can be gathered)
  // The host segment it mirrors.
  std::string host_storage = "fp32";
  const void* payload = nullptr;
  std::vector<std::vector<uint16_t>> merged;
};

struct Tail {
  DevMem k, v, pos;  // [kv head][cap][D] halves, [kv head][cap] positions
  int cap = 0, n = 0;
  std::vector<int32_t> host_pos;
};

struct DevLayer {
  std::vector<DevSeg> segs;
  Tail tail;
};

KVBytes fp16_bytes(int64_t rows, int D) {
  KVBytes b;
  b.codes = rows * D * 2 * 2;
  b.indices = rows * 4;
  return b;
}

class CudaKV : public DeviceKV {
 public:
  CudaKV(std::shared_ptr<Context> c, int L, int NKV, int D) : ctx(std::move(c)), L(L), NKV(NKV), D(D), layers(L) {
    counters = {ctx->alloc(static_cast<int64_t>(L) * 4, "KV tail counters"), static_cast<int64_t>(L) * 4};
    KV_CUDA(cudaMemsetAsync(counters.mem.get(), 0, static_cast<size_t>(L) * 4, ctx->stream), "KV tail counters");
    done = {ctx->alloc(static_cast<int64_t>(L) * 4, "KV append counters"), static_cast<int64_t>(L) * 4};
    KV_CUDA(cudaMemsetAsync(done.mem.get(), 0, static_cast<size_t>(L) * 4, ctx->stream), "KV append counters");
  }

  std::unique_ptr<DeviceKV> clone() const override {
    auto c = std::make_unique<CudaKV>(ctx, L, NKV, D);
    std::vector<int32_t> n(L);
    for (int l = 0; l < L; ++l) {
      c->layers[l].segs = layers[l].segs;  // immutable: shared
      const Tail& t = layers[l].tail;
      n[l] = t.n;
      if (t.cap == 0) continue;
      Tail& u = c->layers[l].tail;
      c->alloc_tail(u, t.cap, l);
      copy_tail(t, u);
      u.n = t.n;
      u.host_pos = t.host_pos;
    }
    ctx->upload(c->counters.mem.get(), n.data(), static_cast<int64_t>(L) * 4, "KV tail counters");
    return c;
  }
  KVBytes bytes(int l) const override {
    KVBytes b;
    for (const DevSeg& s : layers.at(l).segs) b += s.bytes;
    b += fp16_bytes(static_cast<int64_t>(layers[l].tail.n) * NKV, D);
    return b;
  }
  KVBytes bytes() const override {
    KVBytes b;
    for (int l = 0; l < L; ++l) b += bytes(l);
    return b;
  }
  int64_t allocated() const override {
    std::unordered_map<const void*, int64_t> seen;
    for (const DevLayer& d : layers) {
      for (const DevSeg& s : d.segs)
        for (const DevMem& m : s.mem) seen[m.mem.get()] = m.bytes;
      for (const DevMem* m : {&d.tail.k, &d.tail.v, &d.tail.pos})
        if (m->mem) seen[m->mem.get()] = m->bytes;
    }
    int64_t t = 0;
    for (const auto& kv : seen) t += kv.second;
    return t;
  }
  uint64_t version() const override { return ver; }
  std::vector<std::string> storage(int l) const override {
    std::vector<std::string> r;
    for (const DevSeg& s : layers.at(l).segs) r.push_back(s.storage);
    if (layers[l].tail.n) r.push_back("fp16 (decode tail)");
    return r;
  }

  void changed() {
    dirty = true;
    ++ver;
  }
  void alloc_tail(Tail& t, int cap, int l) {
    const int64_t rows = static_cast<int64_t>(NKV) * cap;
    const std::string what = "layer " + std::to_string(l) + " decode rows (" + std::to_string(cap) + " per head)";
    t.k = {ctx->alloc(rows * D * 2, what + " K"), rows * D * 2};
    t.v = {ctx->alloc(rows * D * 2, what + " V"), rows * D * 2};
    t.pos = {ctx->alloc(rows * 4, what + " positions"), rows * 4};
    t.cap = cap;
  }
  // Copies the first t.n rows of every head of t into u (u.cap >= t.n).
  void copy_tail(const Tail& t, Tail& u) const {
    if (t.n == 0) return;
    KV_CUDA(cudaMemcpy2DAsync(u.k.mem.get(), static_cast<size_t>(u.cap) * D * 2, t.k.mem.get(),
                              static_cast<size_t>(t.cap) * D * 2, static_cast<size_t>(t.n) * D * 2, NKV,
                              cudaMemcpyDeviceToDevice, ctx->stream),
            "decode rows K");
    KV_CUDA(cudaMemcpy2DAsync(u.v.mem.get(), static_cast<size_t>(u.cap) * D * 2, t.v.mem.get(),
                              static_cast<size_t>(t.cap) * D * 2, static_cast<size_t>(t.n) * D * 2, NKV,
                              cudaMemcpyDeviceToDevice, ctx->stream),
            "decode rows V");
    KV_CUDA(cudaMemcpy2DAsync(u.pos.mem.get(), static_cast<size_t>(u.cap) * 4, t.pos.mem.get(),
                              static_cast<size_t>(t.cap) * 4, static_cast<size_t>(t.n) * 4, NKV,
                              cudaMemcpyDeviceToDevice, ctx->stream),
            "decode rows positions");
  }
  void grow_tail(int l, int cap) {
    Tail& t = layers[l].tail;
    if (cap <= t.cap) return;
    if (ctx->replay || ctx->capturing) throw InternalError("KV cache: decode rows grew inside a captured step");
    Tail u;
    alloc_tail(u, cap, l);
    copy_tail(t, u);
    u.n = t.n;
    u.host_pos = t.host_pos;
    t = std::move(u);
    changed();
  }
  void reset_tail(int l) {
    Tail& t = layers[l].tail;
    if (t.n == 0) return;
    t.n = 0;
    t.host_pos.clear();
    KV_CUDA(cudaMemsetAsync(counters.as<int32_t>() + l, 0, 4, ctx->stream), "KV tail counter");
    changed();
  }

  // Decode tables: parts of every (layer, kv head), uploaded when the layout changed.
  void build_tables(int n_heads) {
    if (!dirty && n_heads == nh) return;
    if (ctx->replay || ctx->capturing) throw InternalError("KV cache: layout changed inside a captured step");
    nh = n_heads;
    max_parts = 1;
    lut_bits = 0;
    int rows = 1;
    for (const DevLayer& d : layers)
      for (const DevSeg& sg : d.segs)
        for (const auto& hp : sg.heads)
          for (const DevPart& pt : hp)
            if (pt.d.k.fmt == kChannel && pt.d.k.bits <= 4) lut_bits = std::max(lut_bits, pt.d.k.bits);
    for (const DevLayer& d : layers)
      for (int h = 0; h < NKV; ++h) {
        int np = d.tail.cap ? 1 : 0, r = d.tail.cap;
        for (const DevSeg& s : d.segs) {
          np += static_cast<int>(s.heads[h].size());
          r += static_cast<int>(s.pos[h].size());
        }
        max_parts = std::max(max_parts, np);
        rows = std::max(rows, r);
      }
    std::vector<PartDesc> t(static_cast<size_t>(L) * NKV * max_parts);
    std::vector<int32_t> np(static_cast<size_t>(L) * NKV, 0);
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < NKV; ++h) {
        PartDesc* row = t.data() + (static_cast<size_t>(l) * NKV + h) * max_parts;
        int& k = np[static_cast<size_t>(l) * NKV + h];
        for (const DevSeg& s : layers[l].segs)
          for (const DevPart& p : s.heads[h]) row[k++] = p.d;
        const Tail& tl = layers[l].tail;
        if (tl.cap) {
          PartDesc d;
          d.n = 0;
          d.counter = counters.as<int32_t>() + l;
          d.k.data = tl.k.as<__half>() + static_cast<int64_t>(h) * tl.cap * D;
          d.v.data = tl.v.as<__half>() + static_cast<int64_t>(h) * tl.cap * D;
          row[k++] = d;
        }
      }
    const int64_t tb = static_cast<int64_t>(t.size() * sizeof(PartDesc)), nb = static_cast<int64_t>(np.size() * 4);
    if (table.bytes < tb) table = {ctx->alloc(tb, "KV decode table"), tb};
    if (nparts.bytes < nb) nparts = {ctx->alloc(nb, "KV decode table"), nb};
    ctx->upload(table.mem.get(), t.data(), tb, "KV decode table");
    ctx->upload(nparts.mem.get(), np.data(), nb, "KV decode table");
    splits = decode_splits(1, nh, rows, ctx->n_sm);
    const int64_t po = static_cast<int64_t>(nh) * splits * D * 4, pm = static_cast<int64_t>(nh) * splits * 2 * 4;
    if (part_o.bytes < po) part_o = {ctx->alloc(po, "decode attention partial outputs"), po};
    if (part_md.bytes < pm) part_md = {ctx->alloc(pm, "decode attention partial states"), pm};
    if (vis_range.bytes < pm) vis_range = {ctx->alloc(pm, "decode attention visual ranges"), pm};
    if (md_out.bytes < nh * 8) md_out = {ctx->alloc(nh * 8, "decode attention states"), nh * 8};
    if (sem.bytes < nh * 4) {
      sem = {ctx->alloc(nh * 4, "decode attention merge counters"), nh * 4};
      KV_CUDA(cudaMemsetAsync(sem.mem.get(), 0, static_cast<size_t>(nh) * 4, ctx->stream), "merge counters");
    }
    dirty = false;
  }

  std::shared_ptr<Context> ctx;
  int L, NKV, D;
  std::vector<DevLayer> layers;
  DevMem counters, done;
  DevMem table, nparts, part_o, part_md, vis_range, md_out, sem;
  int max_parts = 1, splits = 1, nh = 0, lut_bits = 0;
  bool dirty = true;
  uint64_t ver = 1;
};

CudaKV& as_cuda(DeviceKV* d) {
  auto* c = dynamic_cast<CudaKV*>(d);
  if (!c) throw InternalError("cuda backend: a KV cache of another backend");
  return *c;
}
const CudaKV& as_cuda(const DeviceKV& d) {
  auto* c = dynamic_cast<const CudaKV*>(&d);
  if (!c) throw InternalError("cuda backend: a KV cache of another backend");
  return *c;
}

// The k and v columns of qkv's T rows on the host, rounded to fp16 as the device stores them.
void host_rows(Context& ctx, const Buffer& qkv, const AttnLayout& l, int T, std::vector<float>& k,
               std::vector<float>& v) {
  std::vector<float> all(static_cast<size_t>(qkv.rows()) * qkv.cols());
  ctx.download(all.data(), qkv.data, qkv.bytes(), qkv.name);
  const int KD = l.n_kv_heads * l.head_dim;
  k.resize(static_cast<size_t>(T) * KD);
  v.resize(k.size());
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < KD; ++i) {
      k[static_cast<size_t>(t) * KD + i] = quant::round_half(all[static_cast<size_t>(t) * l.row_stride + l.k_col + i]);
      v[static_cast<size_t>(t) * KD + i] = quant::round_half(all[static_cast<size_t>(t) * l.row_stride + l.v_col + i]);
    }
}

void set_host_bytes(CudaKV& C, KVStore& host, int l);

}  // namespace

std::unique_ptr<DeviceKV> kv_create(const std::shared_ptr<Context>& ctx, int n_layers, int n_kv_heads, int head_dim) {
  if (head_dim % 8 != 0 || head_dim > 256)
    throw InputError("the CUDA backend needs head_dim a multiple of 8 and at most 256, got " + std::to_string(head_dim));
  return std::make_unique<CudaKV>(ctx, n_layers, n_kv_heads, head_dim);
}

bool kv_rope_append(Context& ctx, SeqKV& kv, int layer, Buffer& qkv, const AttnLayout& l, const Buffer& pos,
                    const int32_t* pos_host, const SegmentKind* kinds, int T, const float* inv_freq) {
  if (T != 1 || kinds[0] != SegmentKind::Generated || kv.mirror) return false;
  CudaKV& C = as_cuda(kv.dev);
  Tail& t = C.layers.at(layer).tail;
  if (t.n + 1 > t.cap) C.grow_tail(layer, std::max(16, 2 * t.cap));
  if (!ctx.replay)
    cuda::rope_append(qkv.as<float>(), l.q_col, l.n_heads, l.k_col, l.v_col, C.NKV, C.D, pos.as<int32_t>(), inv_freq,
                      t.k.as<__half>(), t.v.as<__half>(), t.pos.as<int32_t>(), t.cap, C.counters.as<int32_t>() + layer,
                      C.done.as<int32_t>() + layer, ctx.stream);
  ++t.n;
  t.host_pos.push_back(pos_host[0]);
  return true;
}

void kv_append(Context& ctx, SeqKV& kv, int layer, const Buffer& qkv, const AttnLayout& l, const Buffer& pos,
               const int32_t* pos_host, const SegmentKind* kinds, int T) {
  CudaKV& C = as_cuda(kv.dev);
  DevLayer& d = C.layers.at(layer);
  const int NKV = C.NKV, D = C.D;
  if (T == 1 && kinds[0] == SegmentKind::Generated) {
    Tail& t = d.tail;
    if (t.n + 1 > t.cap) C.grow_tail(layer, std::max(16, 2 * t.cap));
    if (!ctx.replay)
      cuda::kv_append(qkv.as<float>(), l.row_stride, l.k_col, l.v_col, 1, NKV, D, pos.as<int32_t>(), t.k.as<__half>(),
                      t.v.as<__half>(), t.pos.as<int32_t>(), t.cap, 0, C.counters.as<int32_t>() + layer, ctx.stream);
    ++t.n;
    t.host_pos.push_back(pos_host[0]);
  } else {
    const int64_t rows = static_cast<int64_t>(NKV) * T;
    const std::string what = "layer " + std::to_string(layer) + " prompt rows (" + std::to_string(T) + " per head)";
    DevMem K{ctx.alloc(rows * D * 2, what + " K"), rows * D * 2};
    DevMem V{ctx.alloc(rows * D * 2, what + " V"), rows * D * 2};
    DevMem P{ctx.alloc(rows * 4, what + " positions"), rows * 4};
    cuda::kv_append(qkv.as<float>(), l.row_stride, l.k_col, l.v_col, T, NKV, D, pos.as<int32_t>(), K.as<__half>(),
                    V.as<__half>(), P.as<int32_t>(), T, 0, nullptr, ctx.stream);
    for (int t0 = 0; t0 < T;) {
      int t1 = t0 + 1;
      while (t1 < T && kinds[t1] == kinds[t0]) ++t1;
      DevSeg s;
      s.kind = kinds[t0];
      s.heads.resize(NKV);
      s.pos.resize(NKV);
      s.mem = {K, V, P};
      for (int h = 0; h < NKV; ++h) {
        DevPart p;
        p.d.n = t1 - t0;
        p.d.visual = s.kind == SegmentKind::Visual;
        p.d.k.data = K.as<__half>() + (static_cast<int64_t>(h) * T + t0) * D;
        p.d.v.data = V.as<__half>() + (static_cast<int64_t>(h) * T + t0) * D;
        s.heads[h].push_back(p);
        s.pos[h].assign(pos_host + t0, pos_host + t1);
      }
      s.bytes = fp16_bytes(static_cast<int64_t>(NKV) * (t1 - t0), D);
      s.merged.assign(NKV, {});
      d.segs.push_back(std::move(s));
      t0 = t1;
    }
    C.changed();
  }
  if (kv.mirror) {
    std::vector<float> k, v;
    host_rows(ctx, qkv, l, T, k, v);
    kv.host->append(layer, k.data(), v.data(), pos_host, kinds, T);
    set_host_bytes(C, *kv.host, layer);
  }
}

namespace {

// Host segment i of layer l ↔ device segment i (or the tail for the last host segment): the
// host reports what the device holds.
void set_host_bytes(CudaKV& C, KVStore& host, int l) {
  LayerKV& H = host.layer(l);
  const DevLayer& d = C.layers[l];
  const size_t ns = d.segs.size();
  for (size_t i = 0; i < H.segments.size(); ++i) {
    if (i < ns) H.segments[i].bytes = d.segs[i].bytes;
    else if (i == ns && d.tail.n) H.segments[i].bytes = fp16_bytes(static_cast<int64_t>(d.tail.n) * C.NKV, C.D);
  }
}

bool same_rows(const KVSegment& s, const DevSeg& d) {
  if (s.kind != d.kind || s.storage != d.host_storage || s.payload.get() != d.payload || s.heads.size() != d.pos.size())
    return false;
  for (size_t h = 0; h < s.heads.size(); ++h) {
    if (s.heads[h].pos != d.pos[h]) return false;
    if (s.heads[h].merged != d.merged[h]) return false;
  }
  return true;
}

bool is_tail(const KVSegment& s, const Tail& t) {
  if (s.kind != SegmentKind::Generated || s.storage != "fp32" || s.payload || t.n == 0) return false;
  for (const HeadRows& r : s.heads) {
    if (r.pos != t.host_pos) return false;
    for (uint16_t m : r.merged)
      if (m) return false;
  }
  return true;
}

using RowMap = std::unordered_map<int64_t, std::pair<const __half*, const __half*>>;
int64_t row_key(int h, int32_t pos) { return (static_cast<int64_t>(h) << 32) | static_cast<uint32_t>(pos); }

// fp16 rows already on the device, by (head, position), for gathering.
RowMap device_rows(const CudaKV& C, const DevLayer& d) {
  RowMap m;
  for (const DevSeg& s : d.segs) {
    if (!s.fp16_rows || s.host_storage != "fp32") continue;
    for (int h = 0; h < C.NKV; ++h) {
      const PartDesc& p = s.heads[h].at(0).d;
      bool merged = false;
      for (uint16_t x : s.merged[h]) merged = merged || x;
      if (merged) continue;
      for (size_t i = 0; i < s.pos[h].size(); ++i)
        m[row_key(h, s.pos[h][i])] = {static_cast<const __half*>(p.k.data) + i * C.D,
                                      static_cast<const __half*>(p.v.data) + i * C.D};
    }
  }
  const Tail& t = d.tail;
  for (int h = 0; h < C.NKV; ++h)
    for (int i = 0; i < t.n; ++i)
      m[row_key(h, t.host_pos[i])] = {t.k.as<__half>() + (static_cast<int64_t>(h) * t.cap + i) * C.D,
                                      t.v.as<__half>() + (static_cast<int64_t>(h) * t.cap + i) * C.D};
  return m;
}

// A segment of fp16 rows: rows found on the device are gathered there, the others uploaded.
DevSeg build_fp16(Context& ctx, const CudaKV& C, const KVSegment& s, const RowMap& have, const std::string& label,
                  bool from_host_only) {
  const int NKV = C.NKV, D = C.D;
  DevSeg d;
  d.kind = s.kind;
  d.storage = label;
  d.host_storage = s.storage;
  d.payload = s.payload.get();
  d.heads.resize(NKV);
  d.pos.resize(NKV);
  d.merged.resize(NKV);
  int64_t rows = 0;
  for (int h = 0; h < NKV; ++h) rows += s.heads[h].n();
  const std::string what = std::string("KV ") + segment_kind_name(s.kind) + " segment (" + std::to_string(rows) + " rows)";
  DevMem K{ctx.alloc(rows * D * 2, what + " K"), rows * D * 2};
  DevMem V{ctx.alloc(rows * D * 2, what + " V"), rows * D * 2};
  DevMem P{ctx.alloc(rows * 4, what + " positions"), rows * 4};
  std::vector<const __half*> srck, srcv;
  std::vector<uint16_t> upk, upv;
  std::vector<int64_t> up_at;  // index into srck of each uploaded row
  std::vector<int32_t> pos;
  int64_t off = 0;
  for (int h = 0; h < NKV; ++h) {
    const HeadRows& r = s.heads[h];
    for (int i = 0; i < r.n(); ++i) {
      const bool merged = i < static_cast<int>(r.merged.size()) && r.merged[i];
      auto it = from_host_only || merged ? have.end() : have.find(row_key(h, r.pos[i]));
      if (it != have.end()) {
        srck.push_back(it->second.first);
        srcv.push_back(it->second.second);
      } else {
        up_at.push_back(static_cast<int64_t>(srck.size()));
        srck.push_back(nullptr);
        srcv.push_back(nullptr);
        for (int c = 0; c < D; ++c) {
          upk.push_back(quant::to_half(r.k[static_cast<size_t>(i) * D + c]));
          upv.push_back(quant::to_half(r.v[static_cast<size_t>(i) * D + c]));
        }
      }
      pos.push_back(r.pos[i]);
    }
    DevPart p;
    p.d.n = r.n();
    p.d.visual = s.kind == SegmentKind::Visual;
    p.d.k.data = K.as<__half>() + off * D;
    p.d.v.data = V.as<__half>() + off * D;
    d.heads[h].push_back(p);
    d.pos[h] = r.pos;
    d.merged[h] = r.merged;
    off += r.n();
  }
  DevMem staging;
  if (!up_at.empty()) {
    const int64_t n = static_cast<int64_t>(up_at.size());
    staging = {ctx.alloc(n * D * 2 * 2, what + " upload"), n * D * 2 * 2};
    __half* sk = staging.as<__half>();
    __half* sv = sk + n * D;
    ctx.upload(sk, upk.data(), n * D * 2, what + " K upload");
    ctx.upload(sv, upv.data(), n * D * 2, what + " V upload");
    for (int64_t i = 0; i < n; ++i) {
      srck[static_cast<size_t>(up_at[i])] = sk + i * D;
      srcv[static_cast<size_t>(up_at[i])] = sv + i * D;
    }
  }
  if (rows) {
    DevMem ptrs{ctx.alloc(rows * 2 * static_cast<int64_t>(sizeof(void*)), what + " gather list"),
                rows * 2 * static_cast<int64_t>(sizeof(void*))};
    auto** pk = static_cast<const __half**>(ptrs.mem.get());
    ctx.upload(pk, srck.data(), rows * static_cast<int64_t>(sizeof(void*)), what + " gather list");
    ctx.upload(pk + rows, srcv.data(), rows * static_cast<int64_t>(sizeof(void*)), what + " gather list");
    gather_rows(pk, K.as<__half>(), static_cast<int>(rows), D, ctx.stream);
    gather_rows(pk + rows, V.as<__half>(), static_cast<int>(rows), D, ctx.stream);
    ctx.upload(P.mem.get(), pos.data(), rows * 4, what + " positions");
    ctx.sync(what);  // the staging and gather lists are freed on return
  }
  d.mem = {K, V, P};
  d.bytes = fp16_bytes(rows, D);
  return d;
}

// Whether the payload's arrays have the sizes its layout implies (else it is read on the host).
bool packed_ok(const quant::QuantPayload& p, const KVSegment& s, int D) {
  using K = quant::CodeLayout::Kind;
  const auto& L = p.layout;
  auto bits_ok = [](int b) { return b >= 1 && b <= 8; };
  for (size_t h = 0; h < s.heads.size(); ++h) {
    const int64_t n = s.heads[h].n();
    const quant::QuantBlock &k = p.k[h], &v = p.v[h];
    if (L.kind == K::Fp16) {
      if (static_cast<int64_t>(k.codes.size()) != n * D * 2 || static_cast<int64_t>(v.codes.size()) != n * D * 2) return false;
    } else if (L.kind == K::Blocks) {
      if (!bits_ok(L.k_bits) || !bits_ok(L.v_bits)) return false;
      if (static_cast<int64_t>(k.codes.size()) != n * D * L.k_bits / 8) return false;
      if (static_cast<int64_t>(v.codes.size()) != n * D * L.v_bits / 8) return false;
      auto ranges = [&](quant::Axis a, int group) -> int64_t {
        if (n == 0) return 0;
        if (a == quant::Axis::PerToken) return n;
        const int64_t g = group > 0 ? (n + group - 1) / group : 1;
        return a == quant::Axis::Global ? g : g * D;
      };
      if (static_cast<int64_t>(k.scales.size()) != ranges(L.k_axis, L.k_group) ||
          static_cast<int64_t>(v.scales.size()) != ranges(L.v_axis, L.v_group))
        return false;
    } else if (L.kind == K::ZipMixed) {
      if (!bits_ok(L.hi_bits) || !bits_ok(L.lo_bits) || k.flags.size() != static_cast<size_t>((n + 7) / 8)) return false;
      int64_t nh = 0;
      for (int64_t i = 0; i < n; ++i) nh += quant::unpack_one(k.flags.data(), i, 1);
      const int64_t nl = n - nh;
      if (static_cast<int64_t>(k.codes.size()) != (nh * D * L.hi_bits + nl * D * L.lo_bits) / 8) return false;
      if (static_cast<int64_t>(v.codes.size()) != (nh * D * L.hi_bits + nl * D * L.lo_bits) / 8) return false;
      if (static_cast<int64_t>(k.scales.size()) != (nh ? D : 0) + (nl ? D : 0)) return false;
      if (static_cast<int64_t>(v.scales.size()) != n || static_cast<int64_t>(v.meta.size()) != (nh ? D : 0) + (nl ? D : 0))
        return false;
    } else {
      return false;
    }
  }
  return true;
}

// A segment whose payload the decode kernel reads as it is: every array uploaded once.
DevSeg build_packed(Context& ctx, const CudaKV& C, const KVSegment& s, const quant::QuantPayload& p) {
  using K = quant::CodeLayout::Kind;
  const int NKV = C.NKV, D = C.D;
  const auto& L = p.layout;
  DevSeg d;
  d.kind = s.kind;
  d.storage = "packed " + s.storage;
  d.host_storage = s.storage;
  d.payload = s.payload.get();
  d.fp16_rows = false;
  d.heads.resize(NKV);
  d.pos.resize(NKV);
  d.merged.resize(NKV);
  const std::string what = std::string("KV ") + segment_kind_name(s.kind) + " segment " + s.storage;
  // One allocation per array kind (all heads concatenated), exactly the payload's bytes.
  struct Arr {
    std::vector<int64_t> off;
    DevMem mem;
  };
  auto upload_all = [&](auto get, int elem, const std::string& name) {
    Arr a;
    int64_t total = 0;
    for (int h = 0; h < NKV; ++h) {
      a.off.push_back(total);
      total += static_cast<int64_t>(get(h).size()) * elem;
    }
    if (total == 0) return a;
    a.mem = {ctx.alloc(total, what + " " + name), total};
    for (int h = 0; h < NKV; ++h)
      ctx.upload(static_cast<char*>(a.mem.mem.get()) + a.off[h], get(h).data(),
                 static_cast<int64_t>(get(h).size()) * elem, what + " " + name);
    return a;
  };
  Arr kc = upload_all([&](int h) -> const std::vector<uint8_t>& { return p.k[h].codes; }, 1, "K codes");
  Arr vc = upload_all([&](int h) -> const std::vector<uint8_t>& { return p.v[h].codes; }, 1, "V codes");
  Arr ks = upload_all([&](int h) -> const std::vector<uint16_t>& { return p.k[h].scales; }, 2, "K scales");
  Arr kz = upload_all([&](int h) -> const std::vector<uint16_t>& { return p.k[h].zeros; }, 2, "K zeros");
  Arr vs = upload_all([&](int h) -> const std::vector<uint16_t>& { return p.v[h].scales; }, 2, "V scales");
  Arr vz = upload_all([&](int h) -> const std::vector<uint16_t>& { return p.v[h].zeros; }, 2, "V zeros");
  Arr km = upload_all([&](int h) -> const std::vector<uint16_t>& { return p.k[h].meta; }, 2, "K factors");
  Arr vm = upload_all([&](int h) -> const std::vector<uint16_t>& { return p.v[h].meta; }, 2, "V factors");
  Arr kf = upload_all([&](int h) -> const std::vector<uint8_t>& { return p.k[h].flags; }, 1, "K flags");
  Arr vf = upload_all([&](int h) -> const std::vector<uint8_t>& { return p.v[h].flags; }, 1, "V flags");
  std::vector<int32_t> pos;
  for (int h = 0; h < NKV; ++h) pos.insert(pos.end(), s.heads[h].pos.begin(), s.heads[h].pos.end());
  DevMem P;
  if (!pos.empty()) {
    P = {ctx.alloc(static_cast<int64_t>(pos.size()) * 4, what + " positions"), static_cast<int64_t>(pos.size()) * 4};
    ctx.upload(P.mem.get(), pos.data(), P.bytes, what + " positions");
  }
  auto ptr = [](const Arr& a, int h, int64_t extra = 0) -> const void* {
    return a.mem.mem ? static_cast<const char*>(a.mem.mem.get()) + a.off[h] + extra : nullptr;
  };
  auto half_ptr = [&](const Arr& a, int h, int64_t elems = 0) {
    return static_cast<const __half*>(ptr(a, h, elems * 2));
  };
  for (int h = 0; h < NKV; ++h) {
    const int n = s.heads[h].n();
    d.pos[h] = s.heads[h].pos;
    d.merged[h] = s.heads[h].merged;
    if (n == 0) continue;
    const bool vis = s.kind == SegmentKind::Visual;
    if (L.kind == K::Fp16) {
      DevPart q;
      q.d.n = n;
      q.d.visual = vis;
      q.d.k.data = ptr(kc, h);
      q.d.v.data = ptr(vc, h);
      d.heads[h].push_back(q);
    } else if (L.kind == K::Blocks) {
      auto side = [&](int bits, quant::Axis a, int group, const Arr& c, const Arr& sc, const Arr& z) {
        KvSide k;
        k.fmt = a == quant::Axis::PerToken ? kToken : kChannel;
        k.bits = bits;
        k.group = group;
        k.chan_stride = a == quant::Axis::Global ? 0 : 1;
        k.data = ptr(c, h);
        k.scale = half_ptr(sc, h);
        k.zero = half_ptr(z, h);
        return k;
      };
      DevPart q;
      q.d.n = n;
      q.d.visual = vis;
      q.d.k = side(L.k_bits, L.k_axis, L.k_group, kc, ks, kz);
      q.d.v = side(L.v_bits, L.v_axis, L.v_group, vc, vs, vz);
      d.heads[h].push_back(q);
    } else {  // ZipMixed: salient rows, then the others
      std::vector<int32_t> hi, lo;
      for (int i = 0; i < n; ++i) (quant::unpack_one(p.k[h].flags.data(), i, 1) ? hi : lo).push_back(i);
      int64_t kcode = 0, vcode = 0, ranges = 0, rows = 0;
      for (int sal = 1; sal >= 0; --sal) {
        const std::vector<int32_t>& idx = sal ? hi : lo;
        const int bits = sal ? L.hi_bits : L.lo_bits;
        if (idx.empty()) continue;
        DevPart q;
        q.d.n = static_cast<int32_t>(idx.size());
        q.d.visual = vis;
        q.d.k.fmt = kChannel;
        q.d.k.bits = bits;
        q.d.k.data = ptr(kc, h, kcode);
        q.d.k.scale = half_ptr(ks, h, ranges);
        q.d.k.zero = half_ptr(kz, h, ranges);
        q.d.v.fmt = kToken;
        q.d.v.bits = bits;
        q.d.v.data = ptr(vc, h, vcode);
        q.d.v.scale = half_ptr(vs, h, rows);
        q.d.v.zero = half_ptr(vz, h, rows);
        q.d.v.factor = half_ptr(vm, h, ranges);
        q.order = idx;
        d.heads[h].push_back(q);
        kcode += static_cast<int64_t>(idx.size()) * D * bits / 8;
        vcode += static_cast<int64_t>(idx.size()) * D * bits / 8;
        ranges += D;
        rows += static_cast<int64_t>(idx.size());
      }
    }
  }
  for (const Arr* a : {&kc, &vc, &ks, &kz, &vs, &vz, &km, &vm, &kf, &vf})
    if (a->mem.mem) d.mem.push_back(a->mem);
  if (P.mem) d.mem.push_back(P);
  d.bytes = p.allocated();
  d.bytes.indices += static_cast<int64_t>(pos.size()) * 4;
  return d;
}

void sync_layer(Context& ctx, CudaKV& C, KVStore& host, int l) {
  DevLayer& d = C.layers[l];
  const LayerKV& H = host.layer(l);
  const RowMap have = device_rows(C, d);
  // Which host segments keep their device copy as it is.
  std::vector<const DevSeg*> same(H.segments.size(), nullptr);
  bool keep_tail = false;
  for (size_t i = 0; i < H.segments.size(); ++i) {
    const KVSegment& s = H.segments[i];
    if (i + 1 == H.segments.size() && is_tail(s, d.tail)) {
      keep_tail = true;
      continue;
    }
    for (const DevSeg& x : d.segs)
      if (same_rows(s, x)) same[i] = &x;
  }
  // A kept segment that shares an allocation with a dropped one (the prompt's segments share
  // one per layer) is gathered into its own, so that the dropped rows' memory is freed.
  std::unordered_map<const void*, int> dropped;
  for (const DevSeg& x : d.segs)
    if (std::find(same.begin(), same.end(), &x) == same.end())
      for (const DevMem& m : x.mem) dropped[m.mem.get()] = 1;
  for (auto& p : same) {
    if (!p) continue;
    for (const DevMem& m : p->mem)
      if (dropped.count(m.mem.get())) p = nullptr;
  }
  std::vector<DevSeg> segs;
  for (size_t i = 0; i < H.segments.size(); ++i) {
    const KVSegment& s = H.segments[i];
    if (keep_tail && i + 1 == H.segments.size()) continue;
    if (same[i]) {
      segs.push_back(*same[i]);
      continue;
    }
    const auto* p = dynamic_cast<const quant::QuantPayload*>(s.payload.get());
    if (p && p->layout.kind != quant::CodeLayout::Kind::None && packed_ok(*p, s, C.D)) {
      segs.push_back(build_packed(ctx, C, s, *p));
    } else if (s.payload) {
      segs.push_back(build_fp16(ctx, C, s, have, "fp16 (dequantized " + s.storage + ")", true));
    } else {
      segs.push_back(build_fp16(ctx, C, s, have, "fp16", false));
    }
  }
  // The new layout must be in place before the old rows can go: segments first, then the tail.
  d.segs = std::move(segs);
  if (!keep_tail) C.reset_tail(l);
  C.changed();
  set_host_bytes(C, host, l);
}

}  // namespace

void kv_sync(Context& ctx, DeviceKV& dev, KVStore& host, int layer) {
  CudaKV& C = as_cuda(&dev);
  if (host.n_layers() != C.L || host.n_kv_heads() != C.NKV || host.head_dim() != C.D)
    throw InternalError("kv_sync: the host store and the device cache differ in shape");
  if (layer >= 0) return sync_layer(ctx, C, host, layer);
  for (int l = 0; l < C.L; ++l) sync_layer(ctx, C, host, l);
}

void kv_hydrate(Context& ctx, const DeviceKV& dev, KVStore& host) {
  const CudaKV& C = as_cuda(dev);
  host = KVStore(C.L, C.NKV, C.D);
  std::vector<uint16_t> tmp;
  for (int l = 0; l < C.L; ++l) {
    LayerKV& H = host.layer(l);
    const DevLayer& d = C.layers[l];
    auto rows_of = [&](const __half* p, int n, std::vector<float>& out) {
      tmp.resize(static_cast<size_t>(n) * C.D);
      ctx.download(tmp.data(), p, static_cast<int64_t>(tmp.size()) * 2, "KV rows");
      out.resize(tmp.size());
      for (size_t i = 0; i < tmp.size(); ++i) out[i] = quant::from_half(tmp[i]);
    };
    for (const DevSeg& s : d.segs) {
      if (!s.fp16_rows || s.host_storage != "fp32")
        throw InternalError("kv_hydrate: only a cache of fp16 rows can be read back");
      KVSegment h;
      h.kind = s.kind;
      h.heads.resize(C.NKV);
      for (int k = 0; k < C.NKV; ++k) {
        const PartDesc& p = s.heads[k].at(0).d;
        rows_of(static_cast<const __half*>(p.k.data), p.n, h.heads[k].k);
        rows_of(static_cast<const __half*>(p.v.data), p.n, h.heads[k].v);
        h.heads[k].pos = s.pos[k];
        h.heads[k].merged = s.merged[k];
      }
      h.bytes = s.bytes;
      H.segments.push_back(std::move(h));
    }
    if (d.tail.n) {
      KVSegment h;
      h.kind = SegmentKind::Generated;
      h.heads.resize(C.NKV);
      for (int k = 0; k < C.NKV; ++k) {
        rows_of(d.tail.k.as<__half>() + static_cast<int64_t>(k) * d.tail.cap * C.D, d.tail.n, h.heads[k].k);
        rows_of(d.tail.v.as<__half>() + static_cast<int64_t>(k) * d.tail.cap * C.D, d.tail.n, h.heads[k].v);
        h.heads[k].pos = d.tail.host_pos;
      }
      h.bytes = fp16_bytes(static_cast<int64_t>(d.tail.n) * C.NKV, C.D);
      H.segments.push_back(std::move(h));
    }
  }
}

void kv_reserve(Context& ctx, DeviceKV& dev, int rows) {
  CudaKV& C = as_cuda(&dev);
  for (int l = 0; l < C.L; ++l) C.grow_tail(l, C.layers[l].tail.n + rows);
}

void kv_decode_attention(Context& ctx, const Buffer& qkv, const AttnLayout& l, SeqKV& kv, int layer,
                         const KVPolicy* policy, Buffer& out, float* scores, float* probs, int n_max) {
  CudaKV& C = as_cuda(kv.dev);
  if (l.n_kv_heads != C.NKV || l.head_dim != C.D) throw InternalError("decode_attention: cache shape differs");
  C.build_tables(l.n_heads);
  const int NH = l.n_heads, NKV = C.NKV, D = C.D, G = NH / NKV;
  DecodeParams p;
  p.B = 1;
  p.NH = NH;
  p.NKV = NKV;
  p.D = D;
  p.scale = l.scale;
  p.q = qkv.as<float>() + l.q_col;
  p.parts = static_cast<const PartDesc*>(C.table.mem.get()) + static_cast<int64_t>(layer) * NKV * C.max_parts;
  p.n_parts = C.nparts.as<int32_t>() + static_cast<int64_t>(layer) * NKV;
  p.max_parts = C.max_parts;
  p.splits = C.splits;
  p.part_o = C.part_o.as<float>();
  p.part_md = C.part_md.as<float>();
  p.out = out.data;
  p.odt = out.dt;
  p.sem = C.sem.as<int>();
  p.lut_bits = C.lut_bits;
  const bool transform = policy && policy->has_score_transform();
  float tau1 = 0, tau2 = 0;
  const bool in_kernel = transform && policy->visual_calibration(tau1, tau2);
  if (!scores && !probs && (!transform || in_kernel)) {
    if (ctx.replay) return;
    if (in_kernel) {
      p.calibrate = 1;
      p.tau1 = tau1;
      p.tau2 = tau2;
      p.vis_range = C.vis_range.as<float>();
    }
    decode_attention(p, ctx.stream);
    return;
  }
  // Materialized: scores to the host (transform, observers), back, then softmax and values.
  if (!kv.mirror) throw InternalError("decode_attention: scores on the host need the host rows");
  const DevLayer& d = C.layers[layer];
  // Device row order per kv head → host row index.
  std::vector<std::vector<int32_t>> dev2host(NKV);
  int n_dev = 0;
  for (int h = 0; h < NKV; ++h) {
    int base = 0;
    for (const DevSeg& s : d.segs) {
      for (const DevPart& q : s.heads[h])
        for (int i = 0; i < q.d.n; ++i) dev2host[h].push_back(base + (q.order.empty() ? i : q.order[i]));
      base += static_cast<int>(s.pos[h].size());
    }
    for (int i = 0; i < d.tail.n; ++i) dev2host[h].push_back(base + i);
    if (static_cast<int>(dev2host[h].size()) != kv.host->n_rows(layer, h))
      throw InternalError("decode_attention: device and host rows differ in layer " + std::to_string(layer));
    n_dev = std::max(n_dev, static_cast<int>(dev2host[h].size()));
  }
  const int64_t stride = std::max(n_dev, 1);
  const int64_t sb = static_cast<int64_t>(NH) * stride * 4;
  DevMem S{ctx.alloc(sb, "decode scores"), sb};
  DevMem Pb{ctx.alloc(sb, "decode probabilities"), sb};
  p.scores_out = S.as<float>();
  p.scores_stride = stride;
  decode_scores(p, ctx.stream);
  std::vector<float> sd(static_cast<size_t>(NH) * stride);
  ctx.download(sd.data(), S.mem.get(), sb, "decode scores");
  // To host order, transform there, back to device order.
  std::vector<float> sh(sd.size(), -INFINITY);
  for (int hd = 0; hd < NH; ++hd) {
    const auto& m = dev2host[hd / G];
    for (size_t i = 0; i < m.size(); ++i) sh[static_cast<size_t>(hd) * stride + m[i]] = sd[static_cast<size_t>(hd) * stride + i];
  }
  if (transform) {
    std::vector<float> K, V;
    std::vector<int32_t> P;
    std::vector<SegmentKind> kinds;
    for (int h = 0; h < NKV; ++h) {
      kv.host->gather(layer, h, K, V, P, &kinds);
      for (int hd = h * G; hd < (h + 1) * G; ++hd)
        policy->transform_scores(layer, hd, sh.data() + static_cast<size_t>(hd) * stride, kinds.data(),
                                 static_cast<int>(P.size()));
    }
  }
  for (int hd = 0; hd < NH; ++hd) {
    const auto& m = dev2host[hd / G];
    for (size_t i = 0; i < m.size(); ++i) sd[static_cast<size_t>(hd) * stride + i] = sh[static_cast<size_t>(hd) * stride + m[i]];
    for (size_t i = m.size(); i < static_cast<size_t>(stride); ++i) sd[static_cast<size_t>(hd) * stride + i] = -INFINITY;
  }
  ctx.upload(S.mem.get(), sd.data(), sb, "decode scores");
  p.scores_out = nullptr;
  p.scores_in = S.as<float>();
  p.md_out = C.md_out.as<float>();
  decode_attention(p, ctx.stream);
  std::vector<float> pd;
  if (probs) {
    decode_probs(p, Pb.as<float>(), ctx.stream);
    pd.resize(sd.size());
    ctx.download(pd.data(), Pb.mem.get(), sb, "decode probabilities");
  }
  for (int hd = 0; hd < NH; ++hd) {
    const auto& m = dev2host[hd / G];
    const int n = static_cast<int>(m.size());
    if (scores) {
      float* o = scores + static_cast<size_t>(hd) * n_max;
      std::fill(o, o + n_max, -INFINITY);
      std::copy_n(sh.data() + static_cast<size_t>(hd) * stride, n, o);
    }
    if (probs) {
      float* o = probs + static_cast<size_t>(hd) * n_max;
      std::fill(o, o + n_max, 0.0f);
      for (int i = 0; i < n; ++i) o[m[i]] = pd[static_cast<size_t>(hd) * stride + i];
    }
  }
  ctx.sync("decode attention");
}

}  // namespace kvlens::cuda
