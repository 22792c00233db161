// The GPU KV cache's data structures, shared by kv_cache.cu (append, mirroring), kv_transfer.cu
// (rows and codes to and from the host) and kv_decode.cu (decode attention over it). See kv_cache.cu for what the cache holds.
#pragma once
#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "core/kv_format.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/zip_kernels.h"

namespace kvlens::cuda::kv {

struct DevPart {
  PartDesc d;
  std::vector<int32_t> order;  // host row (within the segment's head) of each device row; empty = same
};

// The code width of a part holding token-wise codes of one width on both sides (a range per
// row, no CST factors), its codes aligned for the token-wise decode kernel's loads; else 0.
inline int tok_width(const PartDesc& d) {
  if (d.k.fmt != kToken || d.v.fmt != kToken || d.k.bits != d.v.bits || d.k.factor || d.v.factor) return 0;
  const uintptr_t at = reinterpret_cast<uintptr_t>(d.k.data) | reinterpret_cast<uintptr_t>(d.v.data);
  return at % static_cast<uintptr_t>(d.k.bits) == 0 ? d.k.bits : 0;
}

// 16 for a part of fp16 rows; the code width of one of channel-wise keys (a range per channel
// and group of rows) beside token-wise values of that width, with or without CST factors (KIVI's,
// ZipCache's; factors a group of rows only as the keys' ranges are grouped), aligned for the mixed
// decode kernel's loads; else 0.
inline int mix_width(const PartDesc& d) {
  if (d.k.fmt == kF16 && d.v.fmt == kF16) return 16;
  if (d.k.fmt != kChannel || d.k.chan_stride != 1 || d.v.fmt != kToken || d.k.bits != d.v.bits) return 0;
  auto grouped = [&](int g) { return g > 0 && g < d.n ? g : 0; };
  if (d.v.factor && grouped(d.v.group) != grouped(d.k.group)) return 0;
  const uintptr_t at = reinterpret_cast<uintptr_t>(d.k.data) | reinterpret_cast<uintptr_t>(d.v.data);
  const uintptr_t ranges = reinterpret_cast<uintptr_t>(d.k.scale) | reinterpret_cast<uintptr_t>(d.k.zero) |
                           reinterpret_cast<uintptr_t>(d.v.factor);
  return at % static_cast<uintptr_t>(d.k.bits) == 0 && ranges % 16 == 0 ? d.k.bits : 0;
}

// Widths added one by one: the one they all have, else 0 (none added, or several).
struct OneWidth {
  int w = -1;
  void add(int x) { w = w < 0 || w == x ? x : 0; }
  int get() const { return w < 0 ? 0 : w; }
  bool any() const { return w >= 0; }
};

struct DevSeg {
  SegmentKind kind = SegmentKind::System;
  std::string storage = "fp16";
  int k_rotation = 0;  // the keys' codes are of rotated keys (CodeLayout::k_rotation)
  std::vector<std::vector<DevPart>> heads;  // [kv head][part]
  std::vector<std::vector<int32_t>> pos;    // [kv head] positions, host order
  std::vector<DevMem> mem;
  KVBytes bytes;
  bool fp16_rows = true;  // one kF16 part per head in host order (rows can be gathered)
  // The host segment it mirrors.
  std::string host_storage = "fp32";
  const void* payload = nullptr;
  std::vector<std::vector<uint16_t>> merged;
  // Rows ranked on the device (ZipCache's streamed gaps): [kv head][rows] each device row's host
  // row within the segment, in the parts' order, held on the device alone (the parts' `order`
  // empty); segment_order fetches it.
  DevMem order_dev;
  // A layer's streamed ZipCache gaps where the gaps' store holds them (kv_zip_gap.cu): `gaps` of
  // `gap` rows (k salient a KV head), each head's salient rows of every gap then its others,
  // order_dev the store's row orders [kv head][room][gap]. Their rows were the tail's, whose
  // capacity counts them (build_tables). gaps 0: not such a segment.
  struct Gaps {
    int gaps = 0, gap = 0, k = 0, room = 0;
  } zip;
};

// The decode rows of a layer: fp16 rows, or (packed) each row's K and V quantized with its own
// range where it was appended (StepQuant, rope_quant_append). Grouped (StepQuant::group, KIVI):
// fp16 rows of which each KV head's first start[h] were quantized into segments of their own
// (kv_before_step) and are no longer read here.
struct Tail {
  DevMem k, v, pos;  // [kv head][cap][D·bits/8] bytes (fp16: bits 16), [kv head][cap] positions
  DevMem ranges;     // packed: [4][kv head][cap] halves — K scales, K zeros, V scales, V zeros
  int cap = 0, n = 0;
  // The rows' storage (StepQuant): bits a side (16: fp16 rows), the keys' Hadamard block (0:
  // none) and what the method labels a segment of such rows.
  int k_bits = 16, v_bits = 16;
  int rotation = 0;
  std::string label = "fp16";
  std::vector<int32_t> host_pos;
  // Grouped (or zipped): what kv_before_step quantizes (StepQuant: bits, group, residual, label;
  // or zip) and, per KV head, the rows already quantized (empty: none).
  StepQuant groups;
  std::vector<int> start;
  // Coded (StepQuant::k_codec, TurboQuant): fp16 rows, each replaced where it was appended by its
  // dequantization (codec_tail_rows), its codes in kcodes / vcodes [kv head][cap][row bytes] and
  // its fp16 scales in cscales [3][kv head][cap] (‖k‖, ‖r‖ with QJL, ‖v‖); codec_mem holds both
  // codecs for the kernel (codec_dev); coded_bits the bits a row counts.
  std::shared_ptr<const quant::RowCodec> k_codec, v_codec;
  int coded_bits = 0;
  DevMem kcodes, vcodes, cscales, codec_mem;
  bool coded() const { return k_codec != nullptr; }
  bool packed() const { return k_bits < 16; }
  bool grouped() const { return groups.group > 0; }
  bool zipped() const { return groups.zip.gap > 0; }  // (ZipCache's streamed gaps, zip_gap)
  int first(int h) const { return start.empty() ? 0 : start[static_cast<size_t>(h)]; }
  // The rows of every KV head read here.
  int64_t rows(int NKV) const {
    int64_t r = static_cast<int64_t>(n) * NKV;
    for (int s : start) r -= s;
    return r;
  }
  // An empty tail of the same storage.
  Tail empty_like() const {
    Tail u;
    u.k_bits = k_bits;
    u.v_bits = v_bits;
    u.rotation = rotation;
    u.label = label;
    u.groups = groups;
    u.k_codec = k_codec;
    u.v_codec = v_codec;
    u.coded_bits = coded_bits;
    u.codec_mem = codec_mem;
    return u;
  }
  // The rows' bookkeeping of t (after its rows were copied here).
  void keep_rows_of(const Tail& t) {
    n = t.n;
    host_pos = t.host_pos;
    start = t.start;
  }
};
// The bytes of `rows` decode rows (over every KV head) stored as t stores them, as the host
// counts a segment of them (quant::set_quantized: codes, one fp16 scale and zero per row and
// side, int32 positions). A coded tail counts its fp16 rows too (the host's coder counts only
// the codes and scales; the device reads the rows).
inline KVBytes tail_bytes(const Tail& t, int64_t rows, int D) {
  KVBytes b;
  if (t.coded()) {  // what the device holds: the fp16 rows, and beside them their codes and fp16 scales
    b.codes = rows * (static_cast<int64_t>(D) * 2 * 2 + t.k_codec->row_code_bytes() + t.v_codec->row_code_bytes());
    b.scales = rows * (t.k_codec->scales_per_row() + t.v_codec->scales_per_row()) * 2;
    b.indices = rows * 4;
    return b;
  }
  b.codes = rows * D * (t.k_bits + t.v_bits) / 8;
  if (t.packed()) b.scales = b.zeros = rows * 2 * 2;
  b.indices = rows * 4;
  return b;
}
// The tail's packed arrays as rope_quant_append writes them.
inline QuantTail quant_tail(const Tail& t) {
  QuantTail q;
  q.k = t.k.as<uint8_t>();
  q.v = t.v.as<uint8_t>();
  q.ranges = t.ranges.as<__half>();
  q.pos = t.pos.as<int32_t>();
  q.cap = t.cap;
  q.k_bits = t.k_bits;
  q.v_bits = t.v_bits;
  q.rotation = t.rotation;
  return q;
}

// Whether the CUDA kernels code rows by c at head size D (a power of two dp ≥ D up to
// kMaxCodecDp, 0 to 8 code bits, a codebook or a sketch).
bool codec_fits(const quant::RowCodec* c, int D);
// Codecs k and v (the same dp) in one device array, as codec_dev reads it: each side's signs
// [dp] and levels [256], then k's S and Sᵀ [d][d].
DevMem codec_upload(Context& ctx, const quant::RowCodec& k, const quant::RowCodec& v);
// The codec of `side` (0: k, 1: v) in `mem` (codec_upload of k and v).
inline CodecDev codec_dev(const DevMem& mem, const quant::RowCodec& k, const quant::RowCodec& v, int side) {
  const quant::RowCodec& c = side ? v : k;
  const float* base = mem.as<float>();
  const int64_t per_side = k.dp + 256;
  CodecDev d;
  d.signs = base + side * per_side;
  d.levels = d.signs + c.dp;
  d.S = c.qjl ? base + 2 * per_side : nullptr;
  d.St = c.qjl ? d.S + static_cast<int64_t>(c.d) * c.d : nullptr;
  d.d = c.d;
  d.dp = c.dp;
  d.mse_bits = c.mse_bits;
  d.qjl = c.qjl ? 1 : 0;
  d.row_bytes = static_cast<int>(c.row_code_bytes());
  return d;
}
// What landing a pair of row codecs' codes needs of them: a row's code bytes a side, and whether
// the keys carry QJL's residual norm.
struct CodedRows {
  int64_t k_bytes = 0, v_bytes = 0;
  bool qjl = false;
  CodedRows(const quant::RowCodec& k, const quant::RowCodec& v)
      : k_bytes(k.row_code_bytes()), v_bytes(v.row_code_bytes()), qjl(k.qjl) {}
};
// Rows [0, n) of one KV head as the host's coder keeps them (QuantBlock): the codes of keys and
// values (rows of f.k_bytes / f.v_bytes) and the fp16 scales, each row's ‖k‖ then ‖r‖ (QJL) for
// keys, ‖v‖ for values, from the planes norm_k, norm_r, norm_v.
void land_coded(const CodedRows& f, const uint8_t* kcodes, const uint8_t* vcodes, const uint16_t* norm_k,
                const uint16_t* norm_r, const uint16_t* norm_v, int64_t n, quant::QuantBlock& qk, quant::QuantBlock& qv);
// A coded tail's codec of `side`.
inline CodecDev codec_dev(const Tail& t, int side) { return codec_dev(t.codec_mem, *t.k_codec, *t.v_codec, side); }

// fp16 rows already on the device, by KV head and position (positions are token indices, so
// a table per head indexed by position), for gathering.
struct RowMap {
  using Row = std::pair<const __half*, const __half*>;
  std::vector<std::vector<Row>> by_head;  // [kv head][position]; {null, null}: not on the device
  void put(int h, int32_t pos, Row r) {
    if (pos < 0) return;
    std::vector<Row>& t = by_head[static_cast<size_t>(h)];
    if (static_cast<size_t>(pos) >= t.size()) t.resize(static_cast<size_t>(pos) + 1 + t.size() / 2, Row{nullptr, nullptr});
    t[static_cast<size_t>(pos)] = r;
  }
  const Row* find(int h, int32_t pos) const {
    const std::vector<Row>& t = by_head[static_cast<size_t>(h)];
    if (pos < 0 || static_cast<size_t>(pos) >= t.size() || !t[static_cast<size_t>(pos)].first) return nullptr;
    return &t[static_cast<size_t>(pos)];
  }
};
// Rows a method merged where they are (kv_lookm_merge), waiting for the layer's next kv_sync to
// store them in place of the kept rows of the same KV head and position. LOOK-M's merge stages
// every kept row of the layer (merged, or copied as it was), KV head after head: head h's rows
// from row first[h] of k and v, at positions pos[h] in order — a host segment that lists a run
// of them is stored where they lie.
struct Staged {
  DevMem k, v;
  RowMap rows;
  std::vector<int64_t> first;
  std::vector<std::vector<int32_t>> pos;
  bool empty() const { return !k.mem; }
};

// Codes and ranges a method made where the rows are (kv_quantize_rows) and copied into the host
// payload `payload`, kept for the layer's next kv_sync: a host segment whose payload is that one
// is stored from these instead of from an upload of the same bytes.
struct StagedCodes {
  const void* payload = nullptr;
  DevMem codes, ranges;  // every slot's codes; scales [range_count] then zeros [range_count]
  struct Slot {
    int64_t codes = 0, n_codes = 0, ranges = 0, n_ranges = 0;  // bytes into codes; halves into each range array
  };
  std::vector<Slot> slots;  // [side: K, V][kv head]
  int64_t range_count = 0;
  int k_bits = 0, v_bits = 0;
  // The V codes regrouped channel-major where they lie (the binary decode path's layout,
  // quant::channel_major_1bit): 1-bit channel-wise keys and values with ranges over each whole
  // part at head size 128 (channel_major_values).
  bool v_channel_major = false;
};
// Whether a part of 1-bit values beside 1-bit keys is read channel-major by the binary decode
// path: both sides channel-wise (or global) with ranges over the whole part, head size 128.
inline bool channel_major_values(int D, int k_bits, int v_bits, bool k_channel, bool v_channel, int k_group,
                                 int v_group, int n) {
  auto whole = [n](int group) { return group <= 0 || group >= n; };
  return D == 128 && k_bits == 1 && v_bits == 1 && k_channel && v_channel && whole(k_group) && whole(v_group);
}

// ZipCache's arrays a method made where the rows are (kv_zip_quantize) and copied into the host
// payload `payload`, kept for the layer's next kv_sync: the group is stored from them instead of
// from an upload of the same bytes. Every array lies in `mem`, from `at` (bytes), each KV head's
// part from head[h] bytes into it.
struct StagedZip {
  const void* payload = nullptr;
  DevMem mem;
  struct Array {
    int64_t at = 0, bytes = 0;
    std::vector<int64_t> head;
  };
  // K and V codes, K scales and zeros, V channel factors, V token ranges (one per slot: a row, or
  // a subset's position over the heads), and those copied per row (when the heads' rows of a
  // position differ).
  Array k_codes, v_codes, k_scales, k_zeros, factors, t_scales, t_zeros, row_scales, row_zeros;
  // The salient flags (per head, as the payload packs them) and the group's positions (segment by
  // segment, each head's in turn), uploaded with the arrays (bytes 0: not there).
  Array flags, pos;
  bool one_table = false;  // the slot table read by every head from its start
};
// A group of segments of one layer that ZipCache quantizes together, its flags and layout in
// `payload` (zipcache::mark_group).
struct ZipGroup {
  int layer = 0;
  std::vector<const KVSegment*> segs;
  const quant::QuantPayload* payload = nullptr;
};

struct DevLayer {
  std::vector<DevSeg> segs;
  Tail tail;
  Staged merged;  // (not copied by clone: it belongs to the decode that merged)
  std::vector<StagedCodes> quantized;  // (nor these)
  std::vector<StagedZip> zipped;
  // Rows a row codebook coded where they are (kv_code_rows), one entry a coded segment: their
  // fp16 dequantizations, every KV head's in the segment's order, for the host segment whose
  // payload is `payload`. The layer's next kv_sync makes them that segment's rows.
  struct Coded {
    const void* payload = nullptr;
    DevMem rows;                             // [2: K, V][n][D] halves, each KV head's in turn
    std::vector<std::vector<int32_t>> pos;  // [kv head] the rows' positions
  };
  std::vector<Coded> coded;  // (nor these)
};

// The device segment that mirrors host segment s, labelled `storage`, with an empty slot per KV
// head for its parts, positions and merge counts.
DevSeg mirror(const KVSegment& s, std::string storage, int NKV, bool fp16_rows);

inline KVBytes fp16_bytes(int64_t rows, int D) {
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
      Tail& u = c->layers[l].tail;
      u = t.empty_like();
      if (t.cap == 0) continue;
      c->alloc_tail(u, t.cap, l);
      copy_tail(t, u);
      u.keep_rows_of(t);
    }
    ctx->upload(c->counters.mem.get(), n.data(), static_cast<int64_t>(L) * 4, "KV tail counters");
    c->q_rotation = q_rotation;
    return c;
  }
  KVBytes bytes(int l) const override {
    KVBytes b;
    for (const DevSeg& s : layers.at(l).segs) b += s.bytes;
    b += tail_bytes(layers[l].tail, layers[l].tail.rows(NKV), D);
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
      for (const DevMem* m : {&d.tail.k, &d.tail.v, &d.tail.pos, &d.tail.ranges, &d.tail.kcodes, &d.tail.vcodes,
                              &d.tail.cscales, &d.tail.codec_mem, &d.merged.k, &d.merged.v})
        if (m->mem) seen[m->mem.get()] = m->bytes;
      for (const StagedCodes& q : d.quantized)
        for (const DevMem* m : {&q.codes, &q.ranges}) seen[m->mem.get()] = m->bytes;
      for (const StagedZip& q : d.zipped) seen[q.mem.mem.get()] = q.mem.bytes;
      for (const DevLayer::Coded& c : d.coded) seen[c.rows.mem.get()] = c.rows.bytes;
      if (codec_mem.mem) seen[codec_mem.mem.get()] = codec_mem.bytes;
    }
    int64_t t = 0;
    for (const auto& kv : seen) t += kv.second;
    return t;
  }
  uint64_t version() const override { return step_ver; }
  std::vector<std::string> storage(int l) const override {
    std::vector<std::string> r;
    for (const DevSeg& s : layers.at(l).segs) r.push_back(s.storage);
    const Tail& t = layers[l].tail;
    if (t.n && !t.packed() && !t.coded()) r.push_back("fp16 (decode tail)");
    if (t.n && (t.packed() || t.coded())) r.push_back(t.label + " (decode tail)");
    return r;
  }

  void changed() {
    dirty = true;
    relaid = true;
    ++ver;
    ++step_ver;
  }
  // Rows moved between parts of the same layout (ZipCache's gaps into the gaps' store): the
  // tables change, the kernels' launch does not, so a captured step reads the new tables
  // (uploaded in stream order before it) and stays fresh (version() kept) — unless build_tables
  // finds the launch changed after all.
  void rows_moved() {
    dirty = true;
    ++ver;
  }
  // Allocates t's arrays for cap rows a head, in t's storage (k_bits, v_bits).
  void alloc_tail(Tail& t, int cap, int l) {
    const int64_t rows = static_cast<int64_t>(NKV) * cap;
    const std::string what = "layer " + std::to_string(l) + " decode rows (" + std::to_string(cap) + " per head)";
    const int64_t kb = rows * D * t.k_bits / 8, vb = rows * D * t.v_bits / 8;
    t.k = {ctx->alloc(kb, what + " K"), kb};
    t.v = {ctx->alloc(vb, what + " V"), vb};
    t.pos = {ctx->alloc(rows * 4, what + " positions"), rows * 4};
    t.ranges = t.packed() ? DevMem{ctx->alloc(rows * 4 * 2, what + " ranges"), rows * 4 * 2} : DevMem{};
    if (t.coded()) {
      const int64_t kc = rows * t.k_codec->row_code_bytes(), vc = rows * t.v_codec->row_code_bytes();
      t.kcodes = {ctx->alloc(std::max<int64_t>(kc, 16), what + " K codes"), kc};
      t.vcodes = {ctx->alloc(std::max<int64_t>(vc, 16), what + " V codes"), vc};
      t.cscales = {ctx->alloc(rows * 3 * 2, what + " code scales"), rows * 3 * 2};
    }
    t.cap = cap;
  }
  // Copies the first t.n rows of every head of t into u (u.cap >= t.n, the same storage).
  void copy_tail(const Tail& t, Tail& u) const {
    if (t.n == 0) return;
    auto rows = [&](const DevMem& from, DevMem& to, int64_t row_bytes, int heads, const char* what) {
      KV_CUDA(cudaMemcpy2DAsync(to.mem.get(), static_cast<size_t>(u.cap * row_bytes), from.mem.get(),
                                static_cast<size_t>(t.cap * row_bytes), static_cast<size_t>(t.n * row_bytes), heads,
                                cudaMemcpyDeviceToDevice, ctx->stream),
              what);
    };
    rows(t.k, u.k, static_cast<int64_t>(D) * t.k_bits / 8, NKV, "decode rows K");
    rows(t.v, u.v, static_cast<int64_t>(D) * t.v_bits / 8, NKV, "decode rows V");
    rows(t.pos, u.pos, 4, NKV, "decode rows positions");
    if (t.packed()) rows(t.ranges, u.ranges, 2, 4 * NKV, "decode rows ranges");
    if (t.coded()) {
      rows(t.kcodes, u.kcodes, t.k_codec->row_code_bytes(), NKV, "decode rows K codes");
      rows(t.vcodes, u.vcodes, t.v_codec->row_code_bytes(), NKV, "decode rows V codes");
      rows(t.cscales, u.cscales, 2, 3 * NKV, "decode rows code scales");
    }
  }
  void grow_tail(int l, int cap) {
    Tail& t = layers[l].tail;
    if (cap <= t.cap) return;
    if (ctx->replay || ctx->capturing) throw InternalError("KV cache: decode rows grew inside a captured step");
    Tail u = t.empty_like();
    alloc_tail(u, cap, l);
    copy_tail(t, u);
    u.keep_rows_of(t);
    t = std::move(u);
    changed();
  }
  void reset_tail(int l) {
    Tail& t = layers[l].tail;
    if (t.n == 0) return;
    t.n = 0;
    t.host_pos.clear();
    t.start.clear();
    KV_CUDA(cudaMemsetAsync(counters.as<int32_t>() + l, 0, 4, ctx->stream), "KV tail counter");
    changed();
  }

  // Decode tables: parts of every (layer, kv head), uploaded when the layout changed (kv_cache.cu);
  // a rebuild after rows_moved alone that changes the launch marks captured steps stale.
  void build_tables(int n_heads);
  std::vector<int64_t> launch_signature() const;

  std::shared_ptr<Context> ctx;
  int L, NKV, D;
  std::vector<DevLayer> layers;
  // Per layer, what kv_decode_deferred kept on the device for kv_collect_deferred: the scores
  // before the transform in the device's row order [n_heads][stride]; the same in the host
  // store's row order and, without a transform, their softmax (`taps`: [n_heads][stride] each);
  // and the fp32 output. `map` holds the device → host row of each KV head's segment rows
  // [NKV][map_stride], then their counts [NKV] (seg_rows), for the layout of version map_ver.
  struct Deferred {
    DevMem scores, out, taps, map;
    uint64_t map_ver = 0;
    int64_t map_stride = 0;
    std::vector<int32_t> seg_rows, tail_first;  // per KV head: segment rows; tail rows not read (Tail::first)
    int64_t stride = 0, taps_used = 0;  // taps_used: the bytes of `taps` this step wrote
    int n_heads = 0, tail_rows = 0;
    bool pending = false, probs = false;
    const float* host = nullptr;  // the taps, then the output, once fetched (in taps_host)
  };
  std::vector<Deferred> deferred;
  std::shared_ptr<void> taps_host;  // page-locked: every pending layer's taps, fetched in one wait
  int64_t taps_host_bytes = 0;
  DevMem counters, done;
  DevMem table, nparts, part_o, part_md, vis_range, vis_scores, md_out, sem, claim;
  int64_t vis_stride = 0;
  DecodeLaunch launch;  // the decode kernel's split count and choices for the current layout
  int max_parts = 1, nh = 0, lut_bits = 0, all_f16 = 1, all_mma = 0, has_b1 = 0;
  int tok_bits = 0, mix_bits = 0;  // DecodeParams::tok_bits, mix_bits
  // The Hadamard block the decode steps rotate the query by (StepQuant::rotation, kv_reserve):
  // every key of the cache is then stored rotated. 0: none.
  int q_rotation = 0;
  // The row codecs k and v on the device (codec_upload), uploaded once for the coded tail and the
  // prompt's coding alike (the last pair asked for is kept).
  DevMem codecs(const quant::RowCodec& k, const quant::RowCodec& v) {
    if (!codec_k || !(*codec_k == k) || !(*codec_v == v)) {
      codec_mem = codec_upload(*ctx, k, v);
      codec_k = std::make_shared<const quant::RowCodec>(k);
      codec_v = std::make_shared<const quant::RowCodec>(v);
    }
    return codec_mem;
  }
  std::shared_ptr<const quant::RowCodec> codec_k, codec_v;
  DevMem codec_mem;
  // ZipCache's probes (StepQuant::zip, made by kv_reserve): each layer's probe slot of every
  // decode row (−1: none; a gap's probes take slots from 0) on the host and, [L][rows], on the
  // device, and the queries the steps keep there, [L][slots][n_heads·D] fp32 (rope_append's
  // KeptQueries). Not copied by clone: a decode's own.
  struct ZipProbes {
    DevMem q, slot;
    DevMem md;  // [L][slots][n_heads] (max, sum): each probe's softmax states (KeptQueries::md)
    float scale = 0;  // the steps' attention scale, which the states are at (StepZip::scale)
    int slots = 0, rows = 0, n_heads = 0;
    int64_t width = 0;  // a query's floats (n_heads · D)
    std::vector<std::vector<int32_t>> slot_of_row;
    // The gaps' blocks (zip_gap_layout, the same for every gap: made at the first) and, on the
    // device, its blocks, factor blocks and row blocks.
    ZipGapLayout layout;
    DevMem blocks;
    // The gaps' store (zip_store_layout, made at the first gap for every gap the reserved rows
    // hold), the runs that copy a gap's arrays into it, the gaps quantized so far and the decode
    // row the first began at.
    ZipStoreLayout store_at;
    DevMem store, runs;
    int gaps = 0, first_row = 0;
    // Layer `layer`'s kept queries and states; `counter`: its tail's row count, for a step whose
    // row is appended before its attention.
    KeptQueries keep(int layer, const int32_t* counter = nullptr) const {
      if (!slot.mem) return {};
      const int64_t at = static_cast<int64_t>(layer) * slots;
      return {q.as<float>() + at * width, slot.as<int32_t>() + static_cast<int64_t>(layer) * rows, rows,
              md.as<float>() + at * n_heads * 2, counter};
    }
  } zip;
  bool dirty = true;
  bool relaid = true;  // (changed() since the tables were last built)
  uint64_t ver = 1;       // the layout (host bookkeeping keyed on it: segment_map)
  uint64_t step_ver = 1;  // what a captured step reads beyond the tables' contents (version())
};

CudaKV& as_cuda(DeviceKV* d);
const CudaKV& as_cuda(const DeviceKV& d);

// Shared by the cache's mirroring (kv_cache.cu) and its transfers to and from the host
// (kv_transfer.cu).
// The rows of layer d on the device by KV head and position: its fp16 segments' unmerged rows, the
// decode rows, and over them the merged rows waiting for kv_sync (d.merged).
RowMap device_rows(const CudaKV& C, const DevLayer& d);
// Whether host segment s lists exactly the fp16 rows of device segment d (as a prefill's layout
// does): then head h's rows are d's part of head h, in order.
bool mirrors(const KVSegment& s, const DevSeg& d, int NKV);
// Where the device holds the rows of host segments `segs` of layer d (for an op that reads them
// there): each segment's rows where they run, head by head, in one fp16 device segment (the one
// it mirrors, or one it was cut from; nothing merged in the layer since), else found by KV head
// and position. `segs` must outlive it; `what` names the rows in
// an error.
class SegmentRows {
 public:
  SegmentRows(const CudaKV& C, const DevLayer& d, const std::vector<const KVSegment*>& segs, std::string what);
  // Row i of KV head h of segs[seg]; InternalError where the device has none.
  RowMap::Row row(size_t seg, int h, int i) const;
  // Whether every KV head's rows of segs[seg] run in one device segment, as many rows a head and
  // equally spaced (a prefill's layout, or a cut of it): then head h's rows are k + h·k_stride
  // and v + h·v_stride (halves), read where they are.
  bool spaced(size_t seg, const __half*& k, const __half*& v, int64_t& k_stride, int64_t& v_stride) const;
  // segs[seg]'s rows into out [2: K, V][N][D] (N: its rows), each KV head's in turn: one strided
  // copy a side where they are spaced, else gathered by pointer (the list uploaded).
  void copy_into(Context& ctx, size_t seg, __half* out, const std::string& what) const;

 private:
  const std::vector<const KVSegment*>& segs_;
  std::string what_;
  int D_;
  std::vector<const DevSeg*> whole_;
  std::vector<std::vector<int64_t>> at_;  // [seg][kv head]: where the segment's rows start in whole_'s part
  RowMap have_;
};
// The host store's copies (in segments of decode rows that hold rows) of the decode rows at
// positions lo .. hi that KIVI's groups quantized on the device in layers `layers`
// (kv_before_step: generated rows in segments of keys with a range per channel and values with
// one per row), replaced by their dequantization as the device holds them (code·scale + zero, as
// quant::decode reads KIVI's payload): the arrays of every such segment holding one copied out
// before one wait (kv_transfer.cu); nothing when the host holds none. (The prompt's rows a
// group takes stay as they are on the host: an exact attention reads the prompt from its capture.)
void group_rows_to_host(Context& ctx, const CudaKV& C, KVStore& host, const std::vector<int>& layers, int32_t lo,
                        int32_t hi);
// Host segment i of layer l ↔ device segment i (or the tail for the last host segment): the
// host reports what the device holds. A layer whose device segments do not pair with the host's
// so (a grouped tail's segments the host holds as its decode rows) keeps the host's bytes.
void set_host_bytes(CudaKV& C, KVStore& host, int l);
// Dense rows as the host store keeps them (fp32, or fp16 values: the store's row storage), no payload.
bool dense_host(const std::string& storage);

// Packed segments (kv_packed.cu). Whether the payload's arrays have the sizes its layout implies
// (else the segment is held as dequantized fp16 rows).
// Rotated keys (CodeLayout::k_rotation) are read directly only by a cache whose query is rotated
// by the same blocks (q_rotation).
bool packed_ok(const quant::QuantPayload& p, const KVSegment& s, int D, int q_rotation);
// Whether `q` holds payload p's codes and ranges as kv_quantize_rows made them for it: the same
// payload, bits and array sizes, and no other arrays.
bool staged_for(const StagedCodes& q, const KVSegment& s, const quant::QuantPayload& p);
// The V codes of `slots` (slot NKV + h: KV head h's n[h] rows) in `codes` regrouped channel-major
// where they lie (quant::channel_major_1bit, through a scratch copy).
void regroup_values(Context& ctx, const DevMem& codes, const std::vector<StagedCodes::Slot>& slots,
                    const std::vector<int>& n, int D, const std::string& what);
// Host segment s with payload p as the decode kernel reads it: every array uploaded once, or,
// with `staged` (staged_for), taken from where the codes were made.
DevSeg build_packed(Context& ctx, const CudaKV& C, const KVSegment& s, const quant::QuantPayload& p,
                    const StagedCodes* staged);
// ZipCache's streamed gap (kv_zip_gap.cu): whether every layer's decode rows hold a whole gap
// not yet quantized, and its quantization (the probes' saliency and the ranking on the device,
// the rows quantized where they are into the gaps' store, a segment before the decode rows).
bool zip_gap_due(const CudaKV& C);
void zip_gap(Context& ctx, CudaKV& C);
// Raw scaled scores [n][n_heads][stride] by the decode's scoring kernel of n fp32 queries (row b
// of q_rows, laid out as l, at l.scale) each against layer layer_of[b] of the cache as it is: the
// layer's rows in the decode's order (segments' parts, then the decode rows), `stride` at least
// the most any KV head holds (kv_decode.cu).
DevMem query_scores(Context& ctx, CudaKV& C, const Buffer& q_rows, const AttnLayout& l,
                    const std::vector<int32_t>& layer_of, int64_t stride);
// A ZipMixed subset's part (ZipCache's salient or regular rows of one KV head): n rows of
// `bits`-bit codes kc / vc, keys a range per channel (ks, kz: D each) and values one per row (vs,
// vz) with CST factors f (D each), ranges and factors a group of `group` rows (0: the part's).
inline DevPart zip_part(int64_t n, int bits, int group, const void* kc, const void* vc, const __half* ks, const __half* kz,
                        const __half* vs, const __half* vz, const __half* f) {
  DevPart q;
  q.d.n = static_cast<int32_t>(n);
  q.d.k.fmt = kChannel;
  q.d.v.fmt = kToken;
  q.d.k.bits = q.d.v.bits = bits;
  q.d.k.group = q.d.v.group = group;
  q.d.k.data = kc;
  q.d.k.scale = ks;
  q.d.k.zero = kz;
  q.d.v.data = vc;
  q.d.v.scale = vs;
  q.d.v.zero = vz;
  q.d.v.factor = f;
  return q;
}
// ZipCache's group of consecutive host segments sharing payload p (CodeLayout::ZipMixed), one
// DevSeg per segment; empty when the payload is not what its layout says. With `staged` (made
// for p by kv_zip_quantize), its arrays are taken from where they were made. Shared V token
// ranges are read from one table by every head where the heads' rows agree, except in a
// streamed gap (generated rows), whose ranges are copied per row as kv_zip_gap.cu holds them.
std::vector<DevSeg> build_zip(Context& ctx, const CudaKV& C, const std::vector<const KVSegment*>& g,
                              const quant::QuantPayload& p, const StagedZip* staged);


// The copies of one kv_sync, made together once every layer's new layout is known: the rows
// gathered into the new fp16 segments (from rows on the device, or from host rows uploaded with
// them) and the segments' positions — one upload and one launch for every segment of every
// layer (gather_segments). The segments and staged rows the sync replaces are held until the
// gathers are queued (their memory goes back to the pool in stream order, after the reads).
struct SyncBatch {
  // (first: into src; k null: the rows are where they are, the positions alone copied;
  // pos_first: into pos)
  using Gather = RowGather;
  std::vector<const __half*> src;  // keys of every gather, then (index + rows) values
  std::vector<std::pair<size_t, size_t>> up_at;  // the src slots of each uploaded row's key and value
  std::vector<uint16_t> upk, upv;  // the uploaded rows' halves
  std::vector<int32_t> pos;
  std::vector<Gather> gathers;
  std::vector<DevSeg> retired;
  std::vector<Staged> retired_rows;
  std::vector<DevMem> targets;  // the gathers' destinations (held even when a later layer fails)

  // o's copies after these (o's indices moved past this batch's).
  void append(SyncBatch&& o);
  // The one upload and the one launch.
  void run(Context& ctx, int D);
};

// Head h of host segment s as device segment d's one fp16 part, its rows back to back at k and v,
// with s's positions and merge counts.
void place_head(DevSeg& d, const KVSegment& s, int h, const __half* k, const __half* v);
// A segment of fp16 rows: rows found on the device are gathered there, the others uploaded (the
// copies queued in `batch`). A merged row is gathered from the rows merged on the device
// (`merged`), else uploaded. `whole`: the device segment whose rows s lists, in order (s only
// moves out of a shared allocation); `have` (the layer's rows by position) is not read then.
DevSeg build_fp16(const CudaKV& C, const KVSegment& s, const RowMap& have, const Staged& merged_rows,
                  const std::string& label, bool from_host_only, SyncBatch& batch, const DevSeg* whole = nullptr);
// The coded rows kept for host segment s's payload (kv_code_rows), if any.
const DevLayer::Coded* coded_for(const DevLayer& d, const KVSegment& s);
// Whether s lists, head by head, the rows c coded in their order (a segment no method edited
// since it was coded; merged rows were coded as merged).
bool lists_coded(const KVSegment& s, const DevLayer::Coded& c);
// Where the positions p run, one after another, within q: the index of p's first in q, or −1 (an
// empty p runs at 0).
int64_t run_within(const std::vector<int32_t>& p, const std::vector<int32_t>& q);
// Host segment s as fp16 rows already on the device, head h's from at[h] (keys) and at[h].second
// (values), held by `mem`: no copy of the rows, their positions copied with the batch.
DevSeg adopt_rows(const CudaKV& C, const KVSegment& s, const std::string& label, const std::vector<RowMap::Row>& at,
                  std::vector<DevMem> mem, SyncBatch& batch);
// Host segment s as the fp16 rows c coded for it, where they lie: no copy of the rows, their
// positions copied with the batch.
DevSeg adopt_coded(const CudaKV& C, const KVSegment& s, const DevLayer::Coded& c, const std::string& label,
                   SyncBatch& batch);
// Whether host segment s lists, head by head, a run of the rows a merge staged (Staged::pos):
// then head h's rows start at row at[h] of st.k and st.v.
bool merged_run(const Staged& st, const KVSegment& s, int NKV, std::vector<int64_t>& at);
// Host segment s as the rows a merge staged, where they lie (`at`: merged_run's): no copy of the
// rows, their positions copied with the batch.
DevSeg adopt_merged(const CudaKV& C, const KVSegment& s, const Staged& st, const std::vector<int64_t>& at,
                    SyncBatch& batch);

}  // namespace kvlens::cuda::kv
