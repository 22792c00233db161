// Decode attention over the GPU KV cache: the fused kernel on the device's parts, or (for
// observers, and for score transforms a device cannot apply in its kernel) scores to the host,
// transformed there in the host store's row order, and back for the softmax and values.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/exact_attention.h"
#include "core/parallel.h"
#include "kernels/cuda/kv_cache.h"
#include "core/trace.h"

namespace kvlens::cuda {

using namespace kv;

namespace {

// The launch parameters of one sequence's decode attention over layer `layer` of the cache.
DecodeParams layer_params(CudaKV& C, const Buffer& qkv, const AttnLayout& l, int layer, Buffer& out) {
  const int NH = l.n_heads, NKV = C.NKV, D = C.D;
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
  p.part_o = C.part_o.as<float>();
  p.part_md = C.part_md.as<float>();
  p.out = out.data;
  p.odt = out.dt;
  p.sem = C.sem.as<int>();
  p.claim = C.claim.as<int>();
  p.lut_bits = C.lut_bits;
  p.all_f16 = C.all_f16;
  p.all_mma = C.all_mma;
  p.b1 = C.has_b1;
  p.tok_bits = C.tok_bits;
  p.mix_bits = C.mix_bits;
  set_launch(p, C.launch);
  return p;
}

// The host store's row index of each of a KV head's segment rows on the device, in the device's
// order, per KV head (the tail's rows follow in the same order on both sides).
std::vector<std::vector<int32_t>> segment_order(const CudaKV& C, int layer) {
  const DevLayer& d = C.layers[static_cast<size_t>(layer)];
  // The orders of rows ranked on the device, fetched (segment i's at ranked[i]).
  std::vector<std::vector<int32_t>> ranked(d.segs.size());
  for (size_t i = 0; i < d.segs.size(); ++i) {
    const DevSeg& s = d.segs[i];
    if (!s.order_dev.mem) continue;
    int64_t n = 0;
    for (const std::vector<int32_t>& p : s.pos) n += static_cast<int64_t>(p.size());
    if (s.zip.gaps) n = static_cast<int64_t>(C.NKV) * s.zip.room * s.zip.gap;  // (the store's orders, room for every gap)
    if (s.order_dev.bytes != n * 4)
      throw InternalError("segment_order: a device-ranked segment of layer " + std::to_string(layer) + " holds an order of " +
                          std::to_string(s.order_dev.bytes) + " bytes for " + std::to_string(n) + " rows");
    ranked[i].resize(static_cast<size_t>(n));
    C.ctx->download(ranked[i].data(), s.order_dev.mem.get(), n * 4, "device-ranked rows' order");
  }
  std::vector<std::vector<int32_t>> dev2host(static_cast<size_t>(C.NKV));
  for (int h = 0; h < C.NKV; ++h) {
    int base = 0;
    for (size_t i = 0; i < d.segs.size(); ++i) {
      const DevSeg& s = d.segs[i];
      const int n = static_cast<int>(s.pos[h].size());
      if (s.zip.gaps) {  // every gap's salient rows, then every gap's others: gap g's i-th at g·gap + order
        const DevSeg::Gaps& z = s.zip;
        const int32_t* o = ranked[i].data() + static_cast<int64_t>(h) * z.room * z.gap;
        for (int sal = 1; sal >= 0; --sal)
          for (int g = 0; g < z.gaps; ++g)
            for (int j = sal ? 0 : z.k; j < (sal ? z.k : z.gap); ++j)
              dev2host[h].push_back(base + g * z.gap + o[static_cast<int64_t>(g) * z.gap + j]);
      } else if (s.order_dev.mem) {  // (every head's rows before head h's, then head h's)
        int64_t at = 0;
        for (int k = 0; k < h; ++k) at += static_cast<int64_t>(s.pos[k].size());
        for (int j = 0; j < n; ++j) dev2host[h].push_back(base + ranked[i][static_cast<size_t>(at + j)]);
      } else {
        for (const DevPart& q : s.heads[h])
          for (int j = 0; j < q.d.n; ++j) dev2host[h].push_back(base + (q.order.empty() ? j : q.order[j]));
      }
      base += n;
    }
  }
  return dev2host;
}

// Device row order per KV head → the host store's row index; n_dev = the most rows of a head.
// (The tail's rows a head reads, past those quantized into segments of their own, follow its
// segments' on both sides.)
std::vector<std::vector<int32_t>> host_order(const CudaKV& C, const KVStore& host, int layer, int& n_dev) {
  std::vector<std::vector<int32_t>> dev2host = segment_order(C, layer);
  const Tail& t = C.layers[static_cast<size_t>(layer)].tail;
  n_dev = 0;
  for (int h = 0; h < C.NKV; ++h) {
    const int base = static_cast<int>(dev2host[h].size());
    for (int i = 0; i < t.n - t.first(h); ++i) dev2host[h].push_back(base + i);
    if (static_cast<int>(dev2host[h].size()) != host.n_rows(layer, h))
      throw InternalError("decode_attention: device and host rows differ in layer " + std::to_string(layer));
    n_dev = std::max(n_dev, static_cast<int>(dev2host[h].size()));
  }
  return dev2host;
}

// The most rows a KV head of `layer` holds on the device.
int device_rows(const CudaKV& C, int layer) {
  const DevLayer& d = C.layers[layer];
  int n = 0;
  for (int h = 0; h < C.NKV; ++h) {
    int r = d.tail.n - d.tail.first(h);
    for (const DevSeg& s : d.segs)
      for (const DevPart& q : s.heads[h]) r += q.d.n;
    n = std::max(n, r);
  }
  return n;
}

// The in-kernel calibration of `transform` on p.
void set_calibration(DecodeParams& p, CudaKV& C, const ScoreTransform& transform) {
  p.calibrate = 1;
  p.tau1 = transform.tau1;
  p.tau2 = transform.tau2;
  p.vis_range = C.vis_range.as<float>();
  p.vis_scores = C.vis_stride ? C.vis_scores.as<float>() : nullptr;
  p.vis_stride = C.vis_stride;
}

// d.map, d.seg_rows and d.tail_first for the layout of `layer` as it is now (kept while the
// layout's version is: quantizing a tail's rows into segments lays the cache out anew). The map's
// device array: [NKV][map_stride] host rows, then seg_rows [NKV], then tail_first [NKV].
void segment_map(Context& ctx, CudaKV& C, int layer, CudaKV::Deferred& d) {
  if (d.map.mem && d.map_ver == C.ver) return;
  const std::vector<std::vector<int32_t>> order = segment_order(C, layer);
  const Tail& t = C.layers[static_cast<size_t>(layer)].tail;
  d.seg_rows.assign(static_cast<size_t>(C.NKV), 0);
  d.tail_first.assign(static_cast<size_t>(C.NKV), 0);
  for (int h = 0; h < C.NKV; ++h) {
    d.seg_rows[static_cast<size_t>(h)] = static_cast<int32_t>(order[h].size());
    d.tail_first[static_cast<size_t>(h)] = t.first(h);
  }
  d.map_stride = std::max<int64_t>(1, *std::max_element(d.seg_rows.begin(), d.seg_rows.end()));
  std::vector<int32_t> m(static_cast<size_t>(C.NKV) * d.map_stride + 2 * C.NKV, 0);
  for (int h = 0; h < C.NKV; ++h) {
    std::copy(order[h].begin(), order[h].end(), m.begin() + h * d.map_stride);
    m[static_cast<size_t>(C.NKV) * d.map_stride + h] = d.seg_rows[static_cast<size_t>(h)];
    m[static_cast<size_t>(C.NKV) * (d.map_stride + 1) + h] = d.tail_first[static_cast<size_t>(h)];
  }
  const int64_t b = static_cast<int64_t>(m.size()) * 4;
  if (d.map.bytes < b) d.map = {ctx.alloc(b, "deferred decode row map"), b};
  ctx.upload(d.map.mem.get(), m.data(), b, "deferred decode row map");
  d.map_ver = C.ver;
}

// Every pending layer's taps and output not fetched yet, in one wait.
void fetch_deferred(Context& ctx, CudaKV& C) {
  int64_t total = 0;
  for (const CudaKV::Deferred& d : C.deferred)
    if (d.pending && !d.host) total += d.taps_used + (d.out.mem ? d.out.bytes : 0);
  if (total > C.taps_host_bytes) {
    // (with room for a few dozen more rows a layer: the taps grow by one row each step, and
    // page-locking anew each step costs more than the step's copies)
    const int64_t room = total + total / 8 + (int64_t{1} << 20);
    C.taps_host.reset();
    C.taps_host_bytes = 0;  // (none, should the allocation fail)
    C.taps_host = ctx.pinned(room, "deferred decode taps on the host");
    C.taps_host_bytes = room;
  }
  auto* at = static_cast<char*>(C.taps_host.get());
  for (CudaKV::Deferred& d : C.deferred) {
    if (!d.pending || d.host) continue;
    d.host = reinterpret_cast<const float*>(at);
    ctx.download_async(at, d.taps.mem.get(), d.taps_used, "deferred decode taps");
    at += d.taps_used;
    if (d.out.mem) {
      ctx.download_async(at, d.out.mem.get(), d.out.bytes, "deferred decode output (fp32)");
      at += d.out.bytes;
    }
  }
  ctx.sync("deferred decode taps");
}

}  // namespace

void kv_decode_deferred(Context& ctx, const Buffer& qkv, const AttnLayout& l, SeqKV& kv, int layer,
                        const ScoreTransform* transform, Buffer& out, bool want_out) {
  CudaKV& C = as_cuda(kv.dev);
  if (l.n_kv_heads != C.NKV || l.head_dim != C.D) throw InternalError("decode_attention: cache shape differs");
  if (transform && transform->kind == ScoreTransform::Kind::Host)
    throw InternalError("decode_attention: a host score transform cannot be deferred");
  if (C.layers.at(static_cast<size_t>(layer)).tail.zipped())  // (device_step_quant: not when observed)
    throw InternalError("decode_attention: ZipCache's device gaps keep their probes' states in plain steps, not deferred ones");
  C.build_tables(l.n_heads);
  const int NH = l.n_heads;
  DecodeParams p = layer_params(C, qkv, l, layer, out);
  DecodeParams raw = p;
  if (transform && transform->kind == ScoreTransform::Kind::Calibrate) set_calibration(p, C, *transform);
  decode_attention(p, ctx.stream);
  if (C.deferred.size() != static_cast<size_t>(C.L)) C.deferred.resize(static_cast<size_t>(C.L));
  CudaKV::Deferred& d = C.deferred[static_cast<size_t>(layer)];
  d.stride = std::max(device_rows(C, layer), 1);
  d.n_heads = NH;
  const int64_t sb = static_cast<int64_t>(NH) * d.stride * 4;
  if (d.scores.bytes < sb) {  // room for a few more steps' rows
    const int64_t room = sb + static_cast<int64_t>(NH) * 64 * 4;
    d.scores = {ctx.alloc(room, "deferred decode scores"), room};
  }
  raw.scores_out = d.scores.as<float>();
  raw.scores_stride = d.stride;
  decode_scores(raw, ctx.stream);  // before the transform: the scoring pass never calibrates
  // In the host's row order on the device, with their softmax when no transform comes between.
  segment_map(ctx, C, layer, d);
  d.tail_rows = C.layers[static_cast<size_t>(layer)].tail.n;
  d.probs = !(transform && transform->any());
  d.taps_used = (d.probs ? 2 : 1) * sb;
  if (d.taps.bytes < d.taps_used) {  // room for a few more steps' rows
    const int64_t room = d.taps_used + (d.probs ? 2 : 1) * static_cast<int64_t>(NH) * 64 * 4;
    d.taps = {ctx.alloc(room, "deferred decode taps"), room};
  }
  const int32_t* map = d.map.as<int32_t>();
  const int32_t* seg_rows = map + C.NKV * d.map_stride;
  scores_in_order(d.scores.as<float>(), NH, NH / C.NKV, d.stride, seg_rows, d.tail_rows, seg_rows + C.NKV, map,
                  d.map_stride, d.taps.as<float>(), d.probs ? d.taps.as<float>() + NH * d.stride : nullptr, ctx.stream);
  if (want_out) {
    const int64_t ob = static_cast<int64_t>(NH) * C.D * 4;
    if (d.out.bytes != ob) d.out = {ctx.alloc(ob, "deferred decode output (fp32)"), ob};
    DecodeParams p32 = p;
    p32.out = d.out.mem.get();
    p32.odt = Dt::F32;
    decode_attention(p32, ctx.stream);
  } else {
    d.out = {};
  }
  // A query rotated for rotated keys (rope_quant_append) goes back as the model computed it: the
  // taps' exact attention and the observers read it.
  if (C.q_rotation) hadamard_rows(const_cast<float*>(p.q), NH, C.D, C.q_rotation, ctx.stream);
  d.host = nullptr;
  d.pending = true;
}

void kv_collect_deferred(Context& ctx, SeqKV& kv, int layer, const ScoreTransform* transform, const DecodeTaps& taps) {
  trace::Scope span("kv.collect_deferred");
  CudaKV& C = as_cuda(kv.dev);
  if (C.deferred.size() <= static_cast<size_t>(layer) || !C.deferred[static_cast<size_t>(layer)].pending)
    throw InternalError("collect_deferred: nothing deferred for layer " + std::to_string(layer));
  CudaKV::Deferred& d = C.deferred[static_cast<size_t>(layer)];
  if (!d.host) fetch_deferred(ctx, C);
  d.pending = false;
  const int NH = d.n_heads, G = NH / C.NKV, n_max = taps.n_max;
  const int64_t stride = d.stride;
  auto rows_of = [&](int h) {
    return d.seg_rows[static_cast<size_t>(h)] + d.tail_rows - d.tail_first[static_cast<size_t>(h)];
  };
  for (int h = 0; h < C.NKV; ++h)
    if (kv.host->n_rows(layer, h) != rows_of(h))
      throw InternalError("collect_deferred: layer " + std::to_string(layer) + " rows changed since the step");
  if (taps.rows() && n_max < stride)
    throw InternalError("collect_deferred: layer " + std::to_string(layer) + " rows changed since the step");
  const float* raw = d.host;
  const float* probs = d.probs ? raw + NH * stride : nullptr;
  if (taps.out) {
    if (!d.out.mem) throw InternalError("collect_deferred: the output was not kept for layer " + std::to_string(layer));
    std::copy_n(raw + (d.probs ? 2 : 1) * NH * stride, static_cast<size_t>(NH) * C.D, taps.out);
  }
  if (!taps.rows()) return;
  std::vector<float> s(static_cast<size_t>(n_max));
  std::vector<int32_t> P;
  std::vector<SegmentKind> kinds;
  for (int hd = 0; hd < NH; ++hd) {
    const int n = rows_of(hd / G);
    std::copy_n(raw + hd * stride, stride, s.begin());
    std::fill(s.begin() + stride, s.end(), -INFINITY);
    if (taps.raw_scores) std::copy(s.begin(), s.end(), taps.raw_scores + static_cast<size_t>(hd) * n_max);
    if (transform && transform->any()) {  // on the host, in its row order, as the materialized path
      if (hd % G == 0) kv.host->positions(layer, hd / G, P, kinds);
      transform->apply(layer, hd, s.data(), kinds.data(), n);
    }
    if (taps.scores) std::copy(s.begin(), s.end(), taps.scores + static_cast<size_t>(hd) * n_max);
    if (taps.probs) {
      float* o = taps.probs + static_cast<size_t>(hd) * n_max;
      std::fill(o, o + n_max, 0.0f);
      if (probs) {
        std::copy_n(probs + hd * stride, stride, o);
      } else {
        softmax_double_sum(s.data(), n, o);
      }
    }
  }
}

namespace {

// A layer's rows as recorded queries see them: per KV head the host's row index of each device
// segment row (order), the host's positions and kinds of those rows in the host's order, and
// the rows' stride in the scores (the most segment rows of a head plus the decode rows).
struct RecordedRows {
  std::vector<std::vector<int32_t>> order, pos;
  std::vector<std::vector<SegmentKind>> kind;
  int64_t stride = 1;
};

RecordedRows recorded_rows(const CudaKV& C, int layer) {
  const DevLayer& d = C.layers[static_cast<size_t>(layer)];
  if (!d.tail.start.empty())  // (recorded queries over groups are handed over before rows are quantized into them)
    throw InternalError("recorded attention: layer " + std::to_string(layer) + "'s decode rows were quantized in groups");
  RecordedRows r;
  r.order = segment_order(C, layer);
  r.pos.resize(static_cast<size_t>(C.NKV));
  r.kind.resize(static_cast<size_t>(C.NKV));
  for (int h = 0; h < C.NKV; ++h) {
    for (const DevSeg& s : d.segs) {
      r.pos[h].insert(r.pos[h].end(), s.pos[h].begin(), s.pos[h].end());
      r.kind[h].insert(r.kind[h].end(), s.pos[h].size(), s.kind);
    }
    if (r.pos[h].size() != r.order[h].size()) throw InternalError("recorded_attention: segment rows disagree");
    r.stride = std::max<int64_t>(r.stride, static_cast<int64_t>(r.order[h].size()) + d.tail.n);
  }
  return r;
}

// Every recorded query's raw scores by the decode's scoring kernel (query_scores), each
// against layer `layer`.
DevMem recorded_scores(Context& ctx, CudaKV& C, int layer, const Buffer& q_rows, const AttnLayout& l, int n,
                       int64_t stride) {
  if (l.n_kv_heads != C.NKV || l.head_dim != C.D) throw InternalError("recorded_attention: cache shape differs");
  if (q_rows.rows() < n || q_rows.dt != Dt::F32)
    throw InternalError("recorded_attention: " + std::to_string(n) + " fp32 query rows expected");
  return query_scores(ctx, C, q_rows, l, std::vector<int32_t>(static_cast<size_t>(n), layer), stride);
}

// How many of the cache's decode rows (the tail, ascending positions) the query at `position` saw.
int rows_seen(const std::vector<int32_t>& tail_pos, int32_t position) {
  return static_cast<int>(std::upper_bound(tail_pos.begin(), tail_pos.end(), position) - tail_pos.begin());
}

}  // namespace

DevMem kv::query_scores(Context& ctx, CudaKV& C, const Buffer& q_rows, const AttnLayout& l,
                        const std::vector<int32_t>& layer_of, int64_t stride) {
  const int n = static_cast<int>(layer_of.size());
  if (l.n_kv_heads != C.NKV || l.head_dim != C.D || q_rows.rows() < n || q_rows.dt != Dt::F32)
    throw InternalError("query scores: " + std::to_string(n) + " fp32 queries of " + std::to_string(l.n_kv_heads) +
                        " KV heads of size " + std::to_string(l.head_dim) + " against a cache of " +
                        std::to_string(C.NKV) + " of size " + std::to_string(C.D));
  C.build_tables(l.n_heads);
  const int64_t per = static_cast<int64_t>(l.n_heads) * stride, sb = std::max<int64_t>(n * per * 4, 4);
  DevMem S{ctx.alloc(sb, "query scores"), sb};
  if (n == 0) return S;
  // Each query's layer's part table and counts, gathered on the device from the cache's.
  const int64_t tb = static_cast<int64_t>(C.NKV) * C.max_parts * static_cast<int64_t>(sizeof(PartDesc)),
                nb = static_cast<int64_t>(C.NKV) * 4, ib = static_cast<int64_t>(n) * 4;
  for (int32_t x : layer_of)
    if (x < 0 || x >= C.L) throw InternalError("query scores: layer " + std::to_string(x) + " of " + std::to_string(C.L));
  DevMem T{ctx.alloc(n * (tb + nb) + ib + 4, "queries' part tables"), n * (tb + nb) + ib + 4};
  char* tables = T.as<char>();
  auto* index = reinterpret_cast<int32_t*>(tables + n * (tb + nb));
  ctx.upload(index, layer_of.data(), ib, "queries' layers");
  gather_blocks(C.table.mem.get(), tables, tb, index, n, ctx.stream);
  gather_blocks(C.nparts.mem.get(), tables + n * tb, nb, index, n, ctx.stream);
  // The scoring kernel reads its part table before its programmatic-launch wait: a copy (not a
  // kernel) between them makes it start only once the tables are gathered.
  KV_CUDA(cudaMemcpyAsync(index + n, index, 4, cudaMemcpyDeviceToDevice, ctx.stream), "queries' part tables");
  Buffer none;
  DecodeParams p = layer_params(C, q_rows, l, layer_of[0], none);
  p.B = n;
  p.q_stride = l.row_stride;
  p.parts = reinterpret_cast<const PartDesc*>(tables);
  p.n_parts = reinterpret_cast<const int32_t*>(tables + n * tb);
  p.scores_out = S.as<float>();
  p.scores_stride = stride;
  decode_scores(p, ctx.stream);
  return S;
}

void kv_recorded_attention(Context& ctx, SeqKV& kv, int layer, const Buffer& q_rows, const AttnLayout& l,
                           const std::vector<int32_t>& positions, const ScoreTransform* transform,
                           std::vector<RecordedAttention>& out) {
  CudaKV& C = as_cuda(kv.dev);
  const int n = static_cast<int>(positions.size());
  out.assign(static_cast<size_t>(n), RecordedAttention{});
  if (n == 0) return;
  const int NH = l.n_heads, NKV = C.NKV, G = NH / NKV;
  const DevLayer& d = C.layers[static_cast<size_t>(layer)];
  const RecordedRows rr = recorded_rows(C, layer);
  const int64_t stride = rr.stride, per = static_cast<int64_t>(NH) * stride;
  DevMem S = recorded_scores(ctx, C, layer, q_rows, l, n, stride);
  std::vector<float> raw(static_cast<size_t>(n * per));
  ctx.download(raw.data(), S.mem.get(), n * per * 4, "recorded decode scores");
  // In the host's order, transformed and softmaxed there: one query a task.
  const std::vector<int32_t>& tail_pos = d.tail.host_pos;
  parallel_for(n, 8, [&](int i) {
    RecordedAttention& r = out[static_cast<size_t>(i)];
    const int seen = rows_seen(tail_pos, positions[static_cast<size_t>(i)]);
    for (int h = 0; h < NKV; ++h) r.n_max = std::max(r.n_max, static_cast<int>(rr.order[h].size()) + seen);
    const size_t nm = static_cast<size_t>(r.n_max);
    r.key_pos.assign(static_cast<size_t>(NKV) * nm, -1);
    r.key_kind.assign(r.key_pos.size(), SegmentKind::Generated);
    r.scores.assign(static_cast<size_t>(NH) * nm, -INFINITY);
    r.probs.assign(r.scores.size(), 0.0f);
    for (int h = 0; h < NKV; ++h) {
      const size_t segs = rr.order[h].size();
      std::copy(rr.pos[h].begin(), rr.pos[h].end(), r.key_pos.begin() + h * nm);
      std::copy(rr.kind[h].begin(), rr.kind[h].end(), r.key_kind.begin() + h * nm);
      std::copy_n(tail_pos.begin(), seen, r.key_pos.begin() + h * nm + segs);
      const int rows = static_cast<int>(segs) + seen;
      for (int hd = h * G; hd < (h + 1) * G; ++hd) {
        const float* s = raw.data() + i * per + static_cast<int64_t>(hd) * stride;
        float* o = r.scores.data() + hd * nm;
        for (size_t j = 0; j < segs; ++j) o[rr.order[h][j]] = s[j];
        std::copy_n(s + segs, seen, o + segs);
        if (transform && transform->any()) transform->apply(layer, hd, o, r.key_kind.data() + h * nm, rows);
        softmax_double_sum(o, rows, r.probs.data() + hd * nm);
      }
    }
  });
}

bool kv_recorded_span_attention(Context& ctx, SeqKV& kv, int layer, const Buffer& q_rows, const AttnLayout& l,
                                const std::vector<int32_t>& positions, const ScoreTransform* transform, int first,
                                int n_span, std::vector<float>& out) {
  const bool cal = transform && transform->kind == ScoreTransform::Kind::Calibrate;
  if (transform && transform->any() && !cal) return false;
  CudaKV& C = as_cuda(kv.dev);
  const int n = static_cast<int>(positions.size()), NH = l.n_heads, NKV = C.NKV;
  if (n_span <= 0) throw InternalError("recorded_span_attention: an empty span");
  // (sized where the sums land, on the landing's threads: a 7B step's sums over every layer are
  // tens of MB, whose pages are first written there)
  out.clear();
  if (n == 0) return true;
  const size_t count = static_cast<size_t>(n) * NH * n_span;
  trace::Scope span("kv.recorded_span_attention", layer);
  const DevLayer& d = C.layers[static_cast<size_t>(layer)];
  const RecordedRows rr = recorded_rows(C, layer);
  const int64_t stride = rr.stride;
  DevMem S = recorded_scores(ctx, C, layer, q_rows, l, n, stride);
  // Each row's code in the device's order (segments, then the decode rows), then the segment
  // rows a KV head has, then the decode rows each query saw: one upload.
  auto code = [&](int32_t pos, SegmentKind kind) {
    const int64_t at = static_cast<int64_t>(pos) - first;
    return (kind == SegmentKind::Visual ? 1 : 0) | (at >= 0 && at < n_span ? static_cast<int32_t>(at + 1) << 1 : 0);
  };
  std::vector<int32_t> host(static_cast<size_t>(NKV) * stride + NKV + n, 0);
  for (int h = 0; h < NKV; ++h) {
    int32_t* c = host.data() + h * stride;
    const size_t segs = rr.order[h].size();
    for (size_t j = 0; j < segs; ++j) c[j] = code(rr.pos[h][rr.order[h][j]], rr.kind[h][rr.order[h][j]]);
    for (int t = 0; t < d.tail.n; ++t) c[segs + t] = code(d.tail.host_pos[t], SegmentKind::Generated);
    host[static_cast<size_t>(NKV) * stride + h] = static_cast<int32_t>(segs);
  }
  for (int i = 0; i < n; ++i)
    host[static_cast<size_t>(NKV) * stride + NKV + i] = rows_seen(d.tail.host_pos, positions[static_cast<size_t>(i)]);
  const int64_t hb = static_cast<int64_t>(host.size()) * 4, ob = static_cast<int64_t>(count) * 4;
  DevMem codes{ctx.alloc(hb, "recorded span codes"), hb};
  DevMem sums{ctx.alloc(ob, "recorded span sums"), ob};
  ctx.upload(codes.mem.get(), host.data(), hb, "recorded span codes");
  const int32_t* c = codes.as<int32_t>();
  span_softmax_sums(S.as<float>(), stride, c, c + NKV * stride, c + NKV * stride + NKV, n, NH, NKV, cal,
                    cal ? transform->tau1 : 0.0f, cal ? transform->tau2 : 0.0f, n_span, sums.as<float>(), ctx.stream);
  std::vector<float>* to = &out;
  ctx.land_later(sums.mem, ob, [to, count](const char* host) {
    const float* f = reinterpret_cast<const float*>(host);
    to->assign(f, f + count);
  });
  return true;
}

void kv_decode_attention(Context& ctx, const Buffer& qkv, const AttnLayout& l, SeqKV& kv, int layer,
                         const ScoreTransform* transform, Buffer& out, const DecodeTaps& taps) {
  float *scores = taps.scores, *probs = taps.probs;
  const int n_max = taps.n_max;
  CudaKV& C = as_cuda(kv.dev);
  if (l.n_kv_heads != C.NKV || l.head_dim != C.D) throw InternalError("decode_attention: cache shape differs");
  C.build_tables(l.n_heads);
  const int NH = l.n_heads, NKV = C.NKV, G = NH / NKV;
  DecodeParams p = layer_params(C, qkv, l, layer, out);
  const bool transforms = transform && transform->any();
  // (a ZipCache probe's row, appended before its attention: its softmax states kept, of the raw
  // scores its gap scores again — device_step_quant gives no device gaps where scores transform)
  if (C.layers[static_cast<size_t>(layer)].tail.zipped()) {
    if (transforms) throw InternalError("decode_attention: ZipCache's device gaps under a score transform");
    p.keep = C.zip.keep(layer, C.counters.as<int32_t>() + layer);
  }
  const bool in_kernel = transforms && transform->kind == ScoreTransform::Kind::Calibrate;
  if (!taps.any() && (!transforms || in_kernel)) {
    if (ctx.replay) return;
    if (in_kernel) set_calibration(p, C, *transform);
    decode_attention(p, ctx.stream);
    return;
  }
  // Materialized: scores to the host (transform, observers), back, then softmax and values.
  if (!kv.mirror) throw InternalError("decode_attention: scores on the host need the host rows");
  int n_dev = 0;
  const std::vector<std::vector<int32_t>> dev2host = host_order(C, *kv.host, layer, n_dev);
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
  if (taps.raw_scores)
    for (int hd = 0; hd < NH; ++hd) {
      float* o = taps.raw_scores + static_cast<size_t>(hd) * n_max;
      const int n = static_cast<int>(dev2host[hd / G].size());
      std::fill(o, o + n_max, -INFINITY);
      std::copy_n(sh.data() + static_cast<size_t>(hd) * stride, n, o);
    }
  if (transforms) {  // the transform reads the keys' kinds, not their rows
    std::vector<int32_t> P;
    std::vector<SegmentKind> kinds;
    for (int h = 0; h < NKV; ++h) {
      kv.host->positions(layer, h, P, kinds);
      for (int hd = h * G; hd < (h + 1) * G; ++hd)
        transform->apply(layer, hd, sh.data() + static_cast<size_t>(hd) * stride, kinds.data(),
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
  if (taps.out) {  // again, into fp32: the output before its rounding to out's dtype
    const int64_t ob = static_cast<int64_t>(NH) * C.D * 4;
    DevMem O{ctx.alloc(ob, "decode output (fp32)"), ob};
    DecodeParams p32 = p;
    p32.out = O.mem.get();
    p32.odt = Dt::F32;
    decode_attention(p32, ctx.stream);
    ctx.download(taps.out, O.mem.get(), ob, "decode output (fp32)");
  }
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


bool kv_rope_attend(Context& ctx, SeqKV& kv, int layer, Buffer& qkv, const AttnLayout& l, const Buffer& pos,
                    const int32_t* pos_host, const SegmentKind* kinds, const float* inv_freq, Buffer& out) {
  if (kinds[0] != SegmentKind::Generated || kv.mirror || !kv.dev) return false;
  CudaKV& C = as_cuda(kv.dev);
  if (l.n_kv_heads != C.NKV || l.head_dim != C.D || l.n_heads % C.NKV != 0) return false;
  // The host side of rope_append: the tail's room, then its bookkeeping once the fused kernel is
  // known to apply (else rope_append runs as a kernel of its own, with the room made here).
  Tail& t = C.layers.at(layer).tail;
  if (t.n + 1 > t.cap) C.grow_tail(layer, std::max(16, 2 * t.cap));
  C.build_tables(l.n_heads);
  // (a step that codes its row, StepQuant::k_codec, runs rope_append of its own; rows quantized
  // where they are appended take the token-wise kernel, fp16 rows beside KIVI's or ZipCache's
  // groups the mixed one, which also writes the queries ZipCache's steps keep)
  const PlainKernels k = decode_plain_kernels(C.D, C.max_parts, C.all_f16, C.tok_bits, C.mix_bits);
  const bool tok = t.packed() && k.tok;
  if (t.coded() && !t.zipped() && k.f16 && !C.launch.f16_bulk && !C.launch.f16_gqa) {
    // A coded row (TurboQuant) is appended and coded by kernels of their own; the fp16 kernel
    // then reads every row but the coded one before it waits for the coder.
    kv_rope_append(ctx, kv, layer, qkv, l, pos, pos_host, kinds, 1, inv_freq);
    if (ctx.replay) return true;
    DecodeParams p = layer_params(C, qkv, l, layer, out);
    p.rows_ready = 2;
    decode_attention(p, ctx.stream);
    return true;
  }
  // (ZipCache's kept queries are written by the mixed kernel alone)
  if (!(t.packed() ? tok : (k.f16 || k.mix)) || (t.zipped() && !k.mix) || t.coded()) return false;
  ++t.n;
  t.host_pos.push_back(pos_host[0]);
  if (ctx.replay) return true;
  DecodeParams p = layer_params(C, qkv, l, layer, out);
  const float* base = qkv.as<float>();
  p.fresh_k = base + l.k_col;
  p.fresh_v = base + l.v_col;
  p.fresh_pos = pos.as<int32_t>();
  p.inv_freq = inv_freq;
  if (t.zipped()) p.keep = C.zip.keep(layer);
  if (tok) {
    p.qtail = quant_tail(t);
  } else {
    p.tail_k = t.k.as<__half>();
    p.tail_v = t.v.as<__half>();
  }
  p.tail_pos = t.pos.as<int32_t>();
  p.tail_cap = t.cap;
  p.tail_counter = C.counters.as<int32_t>() + layer;
  p.tail_done = C.done.as<int32_t>() + layer;
  p.rows_ready = 1;  // follows the q/k/v product; the cache's rows were written by earlier steps
  decode_attention(p, ctx.stream);
  return true;
}

}  // namespace kvlens::cuda
