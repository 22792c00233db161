// The KV cache on the GPU: per layer, segments tagged by modality as on the host, each KV head's
// rows held as fp16 or as the packed codes a quantizing policy produced (never dequantized in
// device memory), plus a growing tail for generated tokens — fp16 rows, or each row's codes with
// its own range (StepQuant) — whose row count lives on the device (so a captured decode step can
// be replayed). Bytes reported are the bytes allocated.
//
// The host KVStore stays what policies edit. After a policy ran, kv_sync makes the device
// mirror it: a segment that still equals its device copy (kind, storage, payload, positions,
// merge counts) is kept; kept rows of an evicted segment are gathered on the device from the
// rows already there (the compaction, every layer's lists in one upload); rows merged on the device (kv_merge.cu) are gathered
// from where the merge wrote them; rows merged on the host and rows a host-only format holds are
// uploaded as fp16; packed payloads are uploaded as they are.
#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <unordered_map>
#include <utility>

#include "core/errors.h"
#include "core/half.h"
#include "core/parallel.h"
#include "core/kv_format.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/kv_cache.h"
#include "core/trace.h"

namespace kvlens::cuda {

namespace kv {

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

}  // namespace kv

using namespace kv;

namespace {

// The k and v columns of qkv's T rows on the host, rounded to fp16 as the device stores them.
void host_rows(Context& ctx, const Buffer& qkv, const AttnLayout& l, int T, std::vector<float>& k,
               std::vector<float>& v) {
  const int KD = l.n_kv_heads * l.head_dim;
  // Only the key and value columns cross (two thirds of a row at GQA 1:1), when they are adjacent.
  const bool kv_only = l.v_col == l.k_col + KD;
  const int64_t width = kv_only ? 2 * KD : l.row_stride, c0 = kv_only ? l.k_col : 0;
  const std::string what = qkv.name + " keys and values to the host";
  float* all = static_cast<float*>(ctx.staging(static_cast<int64_t>(T) * width * 4, what));
  KV_CUDA(cudaMemcpy2DAsync(all, static_cast<size_t>(width) * 4, qkv.as<float>() + c0,
                            static_cast<size_t>(l.row_stride) * 4, static_cast<size_t>(width) * 4, T,
                            cudaMemcpyDeviceToHost, ctx.stream),
          what);
  ctx.sync(what);
  k.resize(static_cast<size_t>(T) * KD);
  v.resize(k.size());
  for (int t = 0; t < T; ++t) {
    float* kt = k.data() + static_cast<size_t>(t) * KD;
    float* vt = v.data() + static_cast<size_t>(t) * KD;
    const float* row = all + static_cast<size_t>(t) * width;
    std::copy_n(row + l.k_col - c0, KD, kt);
    std::copy_n(row + l.v_col - c0, KD, vt);
    round_half_n(kt, KD);
    round_half_n(vt, KD);
  }
}

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
  if (!ctx.replay && t.packed())
    cuda::rope_quant_append(qkv.as<float>(), l.q_col, l.n_heads, l.k_col, l.v_col, C.NKV, C.D, pos.as<int32_t>(),
                            inv_freq, quant_tail(t), C.counters.as<int32_t>() + layer, C.done.as<int32_t>() + layer,
                            ctx.stream);
  else if (!ctx.replay)
    cuda::rope_append(qkv.as<float>(), l.q_col, l.n_heads, l.k_col, l.v_col, C.NKV, C.D, pos.as<int32_t>(), inv_freq,
                      t.k.as<__half>(), t.v.as<__half>(), t.pos.as<int32_t>(), t.cap, C.counters.as<int32_t>() + layer,
                      C.done.as<int32_t>() + layer, ctx.stream, t.zipped() ? C.zip.keep(layer) : KeptQueries{});
  if (!ctx.replay && t.coded())  // the row just appended, coded in place
    cuda::codec_tail_rows(codec_dev(t, 0), codec_dev(t, 1), t.k.as<__half>(), t.v.as<__half>(), C.NKV, C.D, t.cap,
                          C.counters.as<int32_t>() + layer, t.kcodes.as<uint8_t>(), t.vcodes.as<uint8_t>(),
                          t.cscales.as<__half>(), ctx.stream);
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
    if (t.packed() || t.coded())
      throw InternalError("kv_append: layer " + std::to_string(layer) +
                          "'s decode rows are quantized on the device; they take rows through rope_append alone");
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

namespace kv {

bool codec_fits(const quant::RowCodec* c, int D) {
  return c && c->d == D && c->dp >= D && c->dp <= kMaxCodecDp && (c->dp & (c->dp - 1)) == 0 && c->mse_bits >= 0 &&
         c->mse_bits <= 8 && (c->mse_bits > 0 || c->qjl) && static_cast<int>(c->signs.size()) == c->dp &&
         (c->mse_bits == 0 || c->levels.size() == (size_t{1} << c->mse_bits)) &&
         (!c->qjl || c->S.size() == static_cast<size_t>(D) * D);
}

DevMem codec_upload(Context& ctx, const quant::RowCodec& k, const quant::RowCodec& v) {
  const int64_t per_side = k.dp + 256;
  std::vector<float> a(static_cast<size_t>(2 * per_side), 0.0f);
  for (int side = 0; side < 2; ++side) {
    const quant::RowCodec& c = side ? v : k;
    std::copy(c.signs.begin(), c.signs.end(), a.begin() + side * per_side);
    if (c.mse_bits > 0) std::copy(c.levels.begin(), c.levels.end(), a.begin() + side * per_side + c.dp);
  }
  if (k.qjl) {
    const int d = k.d;
    a.insert(a.end(), k.S.begin(), k.S.end());
    const size_t t0 = a.size();
    a.resize(t0 + static_cast<size_t>(d) * d);
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) a[t0 + static_cast<size_t>(j) * d + i] = k.S[static_cast<size_t>(i) * d + j];
  }
  const int64_t bytes = static_cast<int64_t>(a.size() * sizeof(float));
  DevMem m{ctx.alloc(bytes, "decode rows' codecs"), bytes};
  ctx.upload(m.mem.get(), a.data(), bytes, "decode rows' codecs");
  return m;
}

void set_host_bytes(CudaKV& C, KVStore& host, int l) {
  LayerKV& H = host.layer(l);
  const DevLayer& d = C.layers[l];
  const size_t ns = d.segs.size();
  if (d.tail.grouped() && H.segments.size() != ns + (d.tail.n ? 1 : 0)) return;
  for (size_t i = 0; i < H.segments.size(); ++i) {
    if (i < ns) H.segments[i].bytes = d.segs[i].bytes;
    else if (i == ns && d.tail.n) H.segments[i].bytes = tail_bytes(d.tail, d.tail.rows(C.NKV), C.D);
  }
}

bool dense_host(const std::string& storage) { return storage == "fp32" || storage == "fp16"; }

// The device segment that mirrors host segment s, labelled `storage`, with an empty slot per KV
// head for its parts, positions and merge counts.
DevSeg mirror(const KVSegment& s, std::string storage, int NKV, bool fp16_rows) {
  DevSeg d;
  d.kind = s.kind;
  d.storage = std::move(storage);
  d.host_storage = s.storage;
  d.payload = s.payload.get();
  d.fp16_rows = fp16_rows;
  d.heads.resize(NKV);
  d.pos.resize(NKV);
  d.merged.resize(NKV);
  return d;
}

}  // namespace kv

namespace {

bool same_rows(const KVSegment& s, const DevSeg& d) {
  // A dense host segment, fp32- or fp16-labelled, mirrors the same fp16 rows on the device.
  const bool same_storage = s.storage == d.host_storage || (!s.payload && dense_host(s.storage) && dense_host(d.host_storage));
  if (s.kind != d.kind || !same_storage || s.payload.get() != d.payload || s.heads.size() != d.pos.size())
    return false;
  for (size_t h = 0; h < s.heads.size(); ++h) {
    if (s.heads[h].pos != d.pos[h]) return false;
    if (s.heads[h].merged != d.merged[h]) return false;
  }
  return true;
}

bool is_tail(const KVSegment& s, const Tail& t) {
  // (a coded tail's segment on the host is its codes' payload, kv_hydrate's)
  const bool host_form = t.coded() ? s.storage == t.label && s.payload : dense_host(s.storage) && !s.payload;
  if (s.kind != SegmentKind::Generated || !host_form || t.n == 0 || t.packed()) return false;
  for (const HeadRows& r : s.heads) {
    if (r.pos != t.host_pos) return false;
    for (uint16_t m : r.merged)
      if (m) return false;
  }
  return true;
}

// What a layer's sync keeps: the device segment that already holds each host segment's rows as
// they are, whether the decode tail stays, and whether nothing changed at all; for each host
// segment that lists a run of rows a merge staged, where that run starts (else empty).
struct SyncPlan {
  std::vector<const DevSeg*> same;
  std::vector<std::vector<int64_t>> merged_at;
  bool keep_tail = false, unchanged = false;
  bool needs_rows = false;  // whether a segment's rows are looked up by position (device_rows)
  size_t n_host = 0;  // host segments before the tail
};

SyncPlan plan_sync(const CudaKV& C, const KVStore& host, int l) {
  const DevLayer& d = C.layers[l];
  const LayerKV& H = host.layer(l);
  SyncPlan p;
  p.same.assign(H.segments.size(), nullptr);
  for (size_t i = 0; i < H.segments.size(); ++i) {
    const KVSegment& s = H.segments[i];
    if (i + 1 == H.segments.size() && is_tail(s, d.tail)) {
      p.keep_tail = true;
      continue;
    }
    for (const DevSeg& x : d.segs)
      if (same_rows(s, x)) p.same[i] = &x;
  }
  // Nothing changed (a decode step whose method left the store as it was): the layout, and the
  // decode tables built from it, stay.
  p.n_host = H.segments.size() - (p.keep_tail ? 1 : 0);
  p.unchanged = p.n_host == d.segs.size() && (p.keep_tail || d.tail.n == 0);
  for (size_t i = 0; p.unchanged && i < p.n_host; ++i) p.unchanged = p.same[i] == &d.segs[i];
  // Rows are looked up only for a segment of dense rows that changed (one that only moves is
  // copied from where it is, one a merge staged is stored where it lies; payloads are stored from
  // their codes or uploaded).
  p.merged_at.resize(H.segments.size());
  for (size_t i = 0; !p.unchanged && i < p.n_host; ++i) {
    if (p.same[i] || H.segments[i].payload) continue;
    if (!merged_run(d.merged, H.segments[i], C.NKV, p.merged_at[i])) {
      p.merged_at[i].clear();
      p.needs_rows = true;
    }
  }
  return p;
}

// Layer l made to mirror the host store as `plan` found it; `given`: the layer's device rows
// (device_rows) when the caller found them already. Layers sync side by side: this touches
// layer l's state alone (the calls it makes on the device are independent of other layers'),
// and the caller then finishes each layer in turn (finish_layer).
void sync_layer(Context& ctx, CudaKV& C, KVStore& host, int l, SyncPlan plan, const RowMap* given, SyncBatch& batch) {
  DevLayer& d = C.layers[l];
  const LayerKV& H = host.layer(l);
  std::vector<const DevSeg*>& same = plan.same;
  const size_t n_host = plan.n_host;
  if (plan.unchanged) {
    batch.retired_rows.push_back(std::move(d.merged));
    d.merged = Staged{};
    d.quantized.clear();
    d.zipped.clear();
    d.coded.clear();
    return;
  }
  const RowMap none;
  RowMap have;  // (found when first needed, unless the caller found them)
  bool found = false;
  auto rows = [&]() -> const RowMap& {
    if (given) return *given;
    if (!found) have = device_rows(C, d);
    found = true;
    return have;
  };
  // A kept segment that shares an allocation with a dropped one (the prompt's segments share
  // one per layer) is gathered into its own, so that the dropped rows' memory is freed.
  std::unordered_map<const void*, int> dropped;
  for (const DevSeg& x : d.segs)
    if (std::find(same.begin(), same.end(), &x) == same.end())
      for (const DevMem& m : x.mem) dropped[m.mem.get()] = 1;
  std::vector<const DevSeg*> moved(same.size(), nullptr);  // such a segment's fp16 rows, where they are
  for (size_t i = 0; i < same.size(); ++i) {
    const DevSeg* x = same[i];
    if (!x || std::none_of(x->mem.begin(), x->mem.end(), [&](const DevMem& m) { return dropped.count(m.mem.get()) > 0; }))
      continue;
    same[i] = nullptr;
    bool one_part = x->fp16_rows && !x->payload;
    for (const std::vector<DevPart>& parts : x->heads) one_part = one_part && parts.size() == 1;
    if (one_part) moved[i] = x;
  }
  std::vector<DevSeg> segs;
  for (size_t i = 0; i < n_host; ++i) {
    const KVSegment& s = H.segments[i];
    const auto* p = dynamic_cast<const quant::QuantPayload*>(s.payload.get());
    if (p && p->layout.kind == quant::CodeLayout::Kind::ZipMixed) {
      // ZipCache's group: this segment and the next ones that share its payload, kept whole or
      // rebuilt whole.
      size_t j = i + 1;
      while (j < n_host && H.segments[j].payload == s.payload) ++j;
      bool kept = true;
      for (size_t x = i; x < j; ++x) kept = kept && same[x];
      std::vector<DevSeg> built;
      if (!kept) {
        std::vector<const KVSegment*> g;
        for (size_t x = i; x < j; ++x) g.push_back(&H.segments[x]);
        StagedZip taken;  // (arrays made for this payload, taken once)
        for (auto q = d.zipped.begin(); q != d.zipped.end(); ++q)
          if (q->payload == p) {
            taken = std::move(*q);
            d.zipped.erase(q);
            break;
          }
        built = build_zip(ctx, C, g, *p, taken.payload ? &taken : nullptr);
      }
      for (size_t x = i; x < j; ++x) {
        if (kept) segs.push_back(*same[x]);
        else if (!built.empty()) segs.push_back(std::move(built[x - i]));
        else segs.push_back(build_fp16(C, H.segments[x], none, d.merged, "fp16 (dequantized " + H.segments[x].storage + ")", true, batch));
      }
      i = j - 1;
      continue;
    }
    if (same[i]) {
      segs.push_back(*same[i]);
      continue;
    }
    // The arrays made on the device for this payload (staged_for), and the rows a row codebook
    // coded for it: a payload whose arrays are deferred, with neither here, lands them (they are
    // uploaded from the host).
    const auto staged = p ? std::find_if(d.quantized.begin(), d.quantized.end(),
                                         [&](const StagedCodes& q) { return staged_for(q, s, *p); })
                          : d.quantized.end();
    const DevLayer::Coded* c = coded_for(d, s);
    if (p && p->deferred() && staged == d.quantized.end() && !c) p->land();
    if (p && p->layout.kind != quant::CodeLayout::Kind::None && packed_ok(*p, s, C.D, C.q_rotation)) {
      // Codes made for this payload are taken (whatever happens next, not used twice: the values'
      // regrouping happens in place); a sync tried again uploads the payload.
      StagedCodes taken;
      if (staged != d.quantized.end()) {
        taken = std::move(*staged);
        d.quantized.erase(staged);
      }
      segs.push_back(build_packed(ctx, C, s, *p, taken.payload ? &taken : nullptr));
    } else if (c) {
      // rows a row codebook coded where they are, for this payload, taken as they lie (the
      // payload's codes are of those rows: a segment that lists others is not its payload's)
      if (!lists_coded(s, *c))
        throw InternalError("kv_sync: layer " + std::to_string(l) + "'s " + segment_kind_name(s.kind) +
                            " segment lists rows other than those its payload's codes were made of");
      segs.push_back(adopt_coded(C, s, *c, "fp16 (dequantized " + s.storage + ")", batch));
    } else if (s.payload) {
      segs.push_back(build_fp16(C, s, none, d.merged, "fp16 (dequantized " + s.storage + ")", true, batch));
    } else if (!plan.merged_at[i].empty()) {
      segs.push_back(adopt_merged(C, s, d.merged, plan.merged_at[i], batch));
    } else {
      segs.push_back(build_fp16(C, s, moved[i] ? none : rows(), d.merged, "fp16", false, batch, moved[i]));
    }
  }
  // The new layout must be in place before the old rows can go: segments first, then the tail.
  for (DevSeg& x : d.segs) batch.retired.push_back(std::move(x));  // (read by the batch's gathers)
  d.segs = std::move(segs);
  batch.retired_rows.push_back(std::move(d.merged));
  d.merged = Staged{};
  d.quantized.clear();  // (what a segment took is held by it; the rest goes back to the pool in stream order)
  d.zipped.clear();
  for (DevLayer::Coded& c : d.coded)  // (read by the batch's gathers)
    batch.retired_rows.push_back(Staged{std::move(c.rows), DevMem{}, RowMap{}});
  d.coded.clear();
}

// What sync_layer leaves to be done in turn: the decode tail dropped where the plan does not keep
// it, the cache's tables marked stale, the host segments' bytes.
void finish_layer(CudaKV& C, KVStore& host, int l, const SyncPlan& plan) {
  if (!plan.unchanged) {
    if (!plan.keep_tail) C.reset_tail(l);
    C.changed();
  }
  set_host_bytes(C, host, l);
}

}  // namespace

void kv_sync(Context& ctx, DeviceKV& dev, KVStore& host, int layer) {
  trace::Scope span("kv.sync");
  CudaKV& C = as_cuda(&dev);
  if (host.n_layers() != C.L || host.n_kv_heads() != C.NKV || host.head_dim() != C.D)
    throw InternalError("kv_sync: the host store and the device cache differ in shape");
  SyncBatch batch;
  try {
    std::vector<int> ls;
    if (layer >= 0) ls.push_back(layer);
    else
      for (int l = 0; l < C.L; ++l) ls.push_back(l);
    std::vector<SyncPlan> plans;
    std::vector<int> changed;  // (indices into ls: the layers whose rows are looked up)
    std::vector<RowMap> rows(ls.size());
    {
      trace::Scope plan_span("kv.sync.plan");
      for (size_t i = 0; i < ls.size(); ++i) {
        plans.push_back(plan_sync(C, host, ls[i]));
        if (plans.back().needs_rows) changed.push_back(static_cast<int>(i));
      }
      // The device rows by position of the layers that look rows up, found on threads (they only
      // read the cache); then the layers in turn.
      if (changed.size() > 1)
        parallel_for(static_cast<int>(changed.size()), 8, [&](int x) {
          const size_t i = static_cast<size_t>(changed[static_cast<size_t>(x)]);
          rows[i] = device_rows(C, C.layers[static_cast<size_t>(ls[i])]);
        });
    }
    // The layers side by side, each with its batch of copies; then each finished in turn and
    // the batches made one (also when a layer failed: the others get their rows).
    trace::Scope layers_span("kv.sync.layers");
    std::vector<SyncBatch> batches(ls.size());
    std::vector<char> done(ls.size(), 0);
    auto finish = [&] {
      size_t src = 0, pos = 0, up = 0, gathers = 0;
      for (const SyncBatch& b : batches) {
        src += b.src.size();
        pos += b.pos.size();
        up += b.upk.size();
        gathers += b.gathers.size();
      }
      batch.src.reserve(batch.src.size() + src);
      batch.pos.reserve(batch.pos.size() + pos);
      batch.upk.reserve(batch.upk.size() + up);
      batch.upv.reserve(batch.upv.size() + up);
      batch.gathers.reserve(batch.gathers.size() + gathers);
      for (size_t i = 0; i < ls.size(); ++i) {
        if (done[i]) finish_layer(C, host, ls[i], plans[i]);
        batch.append(std::move(batches[i]));
      }
    };
    try {
      parallel_for(static_cast<int>(ls.size()), 8, [&](int x) {
        const size_t i = static_cast<size_t>(x);
        trace::Scope layer_span("kv.sync.layer", ls[i]);
        const RowMap* found = changed.size() > 1 && plans[i].needs_rows ? &rows[i] : nullptr;
        sync_layer(ctx, C, host, ls[i], plans[i], found, batches[i]);
        done[i] = 1;
      });
    } catch (...) {
      finish();
      throw;
    }
    finish();
  } catch (...) {
    try {
      batch.run(ctx, C.D);  // the layers synced before the error get their rows
    } catch (...) {
      // (the first error is the one to report)
    }
    throw;
  }
  trace::Scope run_span("kv.sync.batch");
  batch.run(ctx, C.D);
}

// What a captured decode step holds of the tables' launch: its choices and the arrays it points at.
std::vector<int64_t> kv::CudaKV::launch_signature() const {
  std::vector<int64_t> s = {max_parts, nh, lut_bits, all_f16, all_mma, has_b1, tok_bits, mix_bits, vis_stride, launch.splits,
                            launch.b1_pair, launch.f16_bulk, launch.bulk_fine, launch.f16_gqa};
  for (const DevMem* m : {&table, &nparts, &part_o, &part_md, &vis_range, &vis_scores, &md_out, &sem, &claim})
    s.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(m->mem.get())));
  return s;
}

void kv::CudaKV::build_tables(int n_heads) {
  if (!dirty && n_heads == nh) return;
  if (ctx->replay || ctx->capturing) throw InternalError("KV cache: layout changed inside a captured step");
  const std::vector<int64_t> before = relaid ? std::vector<int64_t>{} : launch_signature();
  nh = n_heads;
  max_parts = 1;
  lut_bits = 0;
  all_f16 = 1;
  all_mma = D == 128 ? 1 : 0;
  has_b1 = 0;
  // The one code width every part (and tail) has, for the token-wise kernel; the one every
  // quantized part has beside fp16 ones, for the mixed kernel (0: none, or several).
  OneWidth tok, mix;
  bool mixable = true;   // every quantized part one the mixed kernel reads (1, 2 or 4 bits)
  bool factors = false;  // some part's values with CST factors
  int rows = 1;
  for (const DevLayer& d : layers)
    for (const DevSeg& sg : d.segs)
      for (const auto& hp : sg.heads)
        for (const DevPart& pt : hp) {
          if (pt.d.k.fmt == kChannel && pt.d.k.bits <= 4) lut_bits = std::max(lut_bits, pt.d.k.bits);
          if (pt.d.k.fmt != kF16 || pt.d.v.fmt != kF16) all_f16 = 0;
          if (!mma_part(pt.d, true)) all_mma = 0;
          if (pt.d.v.fmt == kChannelT) has_b1 = 1;
          tok.add(tok_width(pt.d));
          if (const int w = mix_width(pt.d); w != 16) {
            mix.add(w);
            if (w != 1 && w != 2 && w != 4) mixable = false;
            if (pt.d.v.factor) factors = true;
          }
        }
  for (const DevLayer& d : layers) {
    if (d.tail.packed()) all_f16 = all_mma = 0;
    if (d.tail.cap) tok.add(d.tail.packed() && d.tail.k_bits == d.tail.v_bits ? d.tail.k_bits : 0);
    if (d.tail.cap && d.tail.packed()) mixable = false;  // (an fp16 tail sits beside the mixed kernel's parts)
  }
  // (the part count is checked at launch) The mixed kernel reads each part's own width
  // (kDecodeMixWidths) where they differ, are 1 bit, or come with CST factors.
  tok_bits = decode_tok_supported(D, 1, tok.get()) ? tok.get() : 0;
  const int one = mix.get();
  mix_bits = !mixable || !mix.any() ? 0 : (one == 2 || one == 4) && !factors ? one : kDecodeMixWidths;
  if (!decode_mix_supported(D, 1, mix_bits)) mix_bits = 0;
  // A rotated query reads rotated keys alone.
  for (int l = 0; l < L && q_rotation; ++l) {
    bool ok = !layers[l].tail.cap || layers[l].tail.rotation == q_rotation;
    for (const DevSeg& sg : layers[l].segs) ok = ok && sg.k_rotation == q_rotation;
    if (!ok)
      throw InternalError("KV cache: layer " + std::to_string(l) + " holds keys not rotated by the Hadamard blocks of " +
                          std::to_string(q_rotation) + " the query is rotated by");
  }
  for (const DevLayer& d : layers)
    for (int h = 0; h < NKV; ++h) {
      int np = d.tail.cap ? 1 : 0, r = d.tail.cap;
      for (const DevSeg& s : d.segs) {
        np += static_cast<int>(s.heads[h].size());
        if (!s.zip.gaps) r += static_cast<int>(s.pos[h].size());  // (a gap's rows: counted in the tail's capacity)
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
        d.n = -tl.first(h);  // (rows quantized into segments of their own are not read here)
        d.counter = counters.as<int32_t>() + l;
        const int64_t at = static_cast<int64_t>(h) * tl.cap + tl.first(h);
        if (tl.packed()) {  // codes with a range per row
          auto side = [&](KvSide& x, const DevMem& codes, int bits, int which) {
            x.fmt = kToken;
            x.bits = bits;
            x.data = codes.as<uint8_t>() + at * D * bits / 8;
            x.scale = tl.ranges.as<__half>() + (2 * which * static_cast<int64_t>(NKV)) * tl.cap + at;
            x.zero = tl.ranges.as<__half>() + ((2 * which + 1) * static_cast<int64_t>(NKV)) * tl.cap + at;
          };
          side(d.k, tl.k, tl.k_bits, 0);
          side(d.v, tl.v, tl.v_bits, 1);
        } else {
          d.k.data = tl.k.as<__half>() + at * D;
          d.v.data = tl.v.as<__half>() + at * D;
        }
        row[k++] = d;
      }
    }
  const int64_t tb = static_cast<int64_t>(t.size() * sizeof(PartDesc)), nb = static_cast<int64_t>(np.size() * 4);
  if (table.bytes < tb) table = {ctx->alloc(tb, "KV decode table"), tb};
  if (nparts.bytes < nb) nparts = {ctx->alloc(nb, "KV decode table"), nb};
  ctx->upload(table.mem.get(), t.data(), tb, "KV decode table");
  ctx->upload(nparts.mem.get(), np.data(), nb, "KV decode table");
  const DecodeLaunch plan = decode_launch(1, nh, rows, ctx->n_sm, D, all_f16, all_mma, has_b1, 0, ctx->sm90, NKV);
  launch = plan;
  const int64_t po = static_cast<int64_t>(nh) * plan.splits * D * 4, pm = static_cast<int64_t>(nh) * plan.splits * 2 * 4;
  if (part_o.bytes < po) part_o = {ctx->alloc(po, "decode attention partial outputs"), po};
  if (part_md.bytes < pm) part_md = {ctx->alloc(pm, "decode attention partial states"), pm};
  if (vis_range.bytes < pm) vis_range = {ctx->alloc(pm, "decode attention visual ranges"), pm};
  // Calibrated visual parts of 1- and 2-bit codes keep their scores between the two passes
  // (a cache of fp16 parts only has none).
  vis_stride = D == 128 && !all_f16 ? rows + kDecodeScorePad : 0;
  const int64_t vb = static_cast<int64_t>(nh) * vis_stride * 4;
  if (vis_scores.bytes < vb) vis_scores = {ctx->alloc(vb, "decode attention visual scores"), vb};
  if (md_out.bytes < nh * 8) md_out = {ctx->alloc(nh * 8, "decode attention states"), nh * 8};
  if (sem.bytes < nh * 4) {
    sem = {ctx->alloc(nh * 4, "decode attention merge counters"), nh * 4};
    KV_CUDA(cudaMemsetAsync(sem.mem.get(), 0, static_cast<size_t>(nh) * 4, ctx->stream), "merge counters");
  }
  if (claim.bytes < nh * 4) {
    claim = {ctx->alloc(nh * 4, "decode attention row claims"), nh * 4};
    KV_CUDA(cudaMemsetAsync(claim.mem.get(), 0, static_cast<size_t>(nh) * 4, ctx->stream), "row claims");
  }
  if (!relaid && launch_signature() != before) ++step_ver;
  dirty = relaid = false;
}

namespace {

// ZipCache's probe schedule for `rows` decode rows of every layer (StepZip::probes, the method's
// own draws) and the room for their queries.
void plan_probes(Context& ctx, CudaKV& C, int rows, const StepZip& z) {
  if (z.n_heads <= 0 || z.n_heads % C.NKV != 0 || !(z.scale > 0))
    throw InternalError("kv_reserve: ZipCache's probes need the query heads (" + std::to_string(z.n_heads) +
                        ", a multiple of the " + std::to_string(C.NKV) + " KV heads) and their attention's scale (" +
                        std::to_string(z.scale) + ")");
  CudaKV::ZipProbes& p = C.zip;
  p.rows = std::max(rows, 1);
  p.n_heads = z.n_heads;
  p.scale = z.scale;
  p.width = static_cast<int64_t>(z.n_heads) * C.D;
  p.slot_of_row.assign(static_cast<size_t>(C.L), std::vector<int32_t>(static_cast<size_t>(p.rows), -1));
  for (int l = 0; l < C.L; ++l) {
    std::vector<int32_t>& s = p.slot_of_row[static_cast<size_t>(l)];
    s = z.probes(l, p.rows);
    if (static_cast<int>(s.size()) != p.rows)
      throw InternalError("kv_reserve: ZipCache's probes of layer " + std::to_string(l) + ": " +
                          std::to_string(s.size()) + " slots for " + std::to_string(p.rows) + " rows");
    for (int32_t k : s) p.slots = std::max(p.slots, k + 1);
  }
  p.slots = std::max(p.slots, 1);
  std::vector<int32_t> all;
  for (const std::vector<int32_t>& s : p.slot_of_row) all.insert(all.end(), s.begin(), s.end());
  const int64_t sb = static_cast<int64_t>(all.size()) * 4, qb = static_cast<int64_t>(C.L) * p.slots * p.width * 4;
  p.slot = {ctx.alloc(sb, "ZipCache probe slots"), sb};
  ctx.upload(p.slot.mem.get(), all.data(), sb, "ZipCache probe slots");
  p.q = {ctx.alloc(qb, "ZipCache probe queries"), qb};
  const int64_t mb = static_cast<int64_t>(C.L) * p.slots * p.n_heads * 8;
  p.md = {ctx.alloc(mb, "ZipCache probe softmax states"), mb};
  // (a state no step wrote is NaN, whose sum a gap's saliency skips)
  KV_CUDA(cudaMemsetAsync(p.md.mem.get(), 0xff, static_cast<size_t>(mb), ctx.stream), "ZipCache probe softmax states");
}

}  // namespace

bool kv_quantizes_steps(const StepQuant& q, int D) {
  const bool bits = q.k_bits >= 1 && q.k_bits <= 8 && q.v_bits >= 1 && q.v_bits <= 8;
  if (q.k_codec || q.v_codec)
    return bits && codec_fits(q.k_codec.get(), D) && codec_fits(q.v_codec.get(), D) && q.k_codec->dp == q.v_codec->dp &&
           !q.v_codec->qjl && q.group == 0 && q.rotation == 0 && q.zip.gap == 0;
  if (q.zip.gap > 0) return bits && q.group == 0 && q.rotation == 0 && D % 8 == 0 && q.zip.probes;
  if (q.group > 0) return bits && q.k_bits == q.v_bits && q.rotation == 0 && q.residual >= 1 && D % 8 == 0;
  return bits && q.group == 0 && quant_tail_ok(D, q.rotation);
}

void kv_reserve(Context& ctx, DeviceKV& dev, int rows, const StepQuant& quant) {
  CudaKV& C = as_cuda(&dev);
  // The decode rows' storage changes only while no layer holds any, and to one the kernels take:
  // checked for every layer before any changes.
  // (grouped or zipped: fp16 rows, the groups' StepQuant kept beside them; a zipped tail is
  // made anew, its probes scheduled from its first row)
  const bool zipped = quant.any() && quant.zip.gap > 0;
  const bool grouped = quant.any() && (quant.group > 0 || zipped);
  const bool coded = quant.any() && quant.k_codec;
  auto differs = [&](const Tail& t) {
    if (zipped) return true;
    if (coded || t.coded())  // (room alone, StepQuant{}, keeps the storage, as for a packed tail)
      return quant.any() && (!coded || !t.coded() || !(*t.k_codec == *quant.k_codec) ||
                             !(*t.v_codec == *quant.v_codec) || t.coded_bits != quant.k_bits || t.label != quant.label);
    if (grouped)
      return t.packed() || t.groups.k_bits != quant.k_bits || t.groups.group != quant.group ||
             t.groups.residual != quant.residual || t.groups.label != quant.label;
    return quant.any() && (quant.k_bits != t.k_bits || quant.v_bits != t.v_bits || quant.rotation != t.rotation ||
                           quant.label != t.label || t.grouped());
  };
  for (int l = 0; l < C.L; ++l)
    if (differs(C.layers[l].tail) && C.layers[l].tail.n)
      throw InternalError("kv_reserve: layer " + std::to_string(l) + " already holds decode rows");
  if (quant.any() && !kv_quantizes_steps(quant, C.D))
    throw InternalError("kv_reserve: decode rows of " + std::to_string(quant.k_bits) + "/" + std::to_string(quant.v_bits) +
                        " bits, rotation " + std::to_string(quant.rotation) + ", head size " + std::to_string(C.D));
  for (int l = 0; l < C.L; ++l) {
    Tail& t = C.layers[l].tail;
    if (differs(t)) {
      Tail u;
      if (grouped) {
        u.groups = quant;
      } else if (coded) {  // fp16 rows, the codes beside them
        u.k_codec = quant.k_codec;
        u.v_codec = quant.v_codec;
        u.coded_bits = quant.k_bits;
        u.codec_mem = C.codecs(*quant.k_codec, *quant.v_codec);
        u.label = quant.label;
      } else {
        u.k_bits = quant.k_bits;
        u.v_bits = quant.v_bits;
        u.rotation = quant.rotation;
        u.label = quant.label;
      }
      t = std::move(u);
      C.changed();
    }
    C.grow_tail(l, t.n + rows);
  }
  if (quant.any() && quant.rotation != C.q_rotation) {
    C.q_rotation = quant.rotation;
    C.changed();
  }
  C.zip = {};
  if (zipped) plan_probes(ctx, C, rows, quant.zip);
}


}  // namespace kvlens::cuda
