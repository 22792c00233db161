// The KV cache's transfers with the host: its layout and rows read back into a host store
// (kv_hydrate), a segment's rows quantized or coded where they are, the codes and ranges left
// there for the payload to land when asked (kv_quantize_rows, kv_code_rows, land_coded), and
// decode rows appended on the device alone fetched to the host store (kv_pull_rows). Copies go
// through page-locked memory, each batch before one wait.
#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

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

using namespace kv;

namespace kv {

void land_coded(const CodedRows& f, const uint8_t* kcodes, const uint8_t* vcodes, const uint16_t* norm_k,
                const uint16_t* norm_r, const uint16_t* norm_v, int64_t n, quant::QuantBlock& qk, quant::QuantBlock& qv) {
  qk.codes.assign(kcodes, kcodes + n * f.k_bytes);
  qv.codes.assign(vcodes, vcodes + n * f.v_bytes);
  qv.scales.assign(norm_v, norm_v + n);
  qk.scales.resize(static_cast<size_t>(f.qjl ? 2 * n : n));
  for (int64_t i = 0; i < n; ++i) {
    if (!f.qjl) {
      qk.scales[static_cast<size_t>(i)] = norm_k[i];
      continue;
    }
    qk.scales[static_cast<size_t>(2 * i)] = norm_k[i];
    qk.scales[static_cast<size_t>(2 * i + 1)] = norm_r[i];
  }
}

}  // namespace kv

namespace {

// The first t.n rows of each of a tail's `arrays` (each [heads][t.cap] rows of row_bytes bytes)
// into page-locked memory one array after another, before one wait; where they lie.
struct TailArray {
  const DevMem* mem;
  int64_t row_bytes;
  int heads;
};
const uint8_t* tail_to_host(Context& ctx, const Tail& t, const std::vector<TailArray>& arrays, const std::string& what) {
  const int64_t n = t.n;
  int64_t total = 0;
  for (const TailArray& a : arrays) total += a.heads * n * a.row_bytes;
  auto* staged = static_cast<uint8_t*>(ctx.staging(total, what));
  int64_t at = 0;
  for (const TailArray& a : arrays) {
    KV_CUDA(cudaMemcpy2DAsync(staged + at, static_cast<size_t>(n * a.row_bytes), a.mem->mem.get(),
                              static_cast<size_t>(t.cap * a.row_bytes), static_cast<size_t>(n * a.row_bytes), a.heads,
                              cudaMemcpyDeviceToHost, ctx.stream),
            what);
    at += a.heads * n * a.row_bytes;
  }
  ctx.sync(what);
  return staged;
}

// Row `i` of packed rows (each of D codes of `bits`, D·bits/8 bytes) with its fp16 scale and
// zero, as quant::decode reads a row (code·scale + α), into out [D]; keys of a tail that rotates
// them (rotation > 0) rotated back, as the host's Hadamard-INT4 keeps them (the transform is its
// own inverse).
void dequantize_packed_row(const uint8_t* codes, uint16_t scale, uint16_t zero, int D, int bits, int rotation,
                           uint32_t* scratch, float* out) {
  const float sc = from_half(scale), alpha = from_half(zero);
  quant::unpack(codes, D, bits, scratch);
  for (int e = 0; e < D; ++e) out[e] = static_cast<float>(scratch[e]) * sc + alpha;
  if (rotation) quant::block_hadamard(out, D, rotation);
}

// A packed decode tail (StepQuant) as the host holds such rows: a segment whose payload is each
// head's codes and per-row fp16 ranges (CodeLayout::Blocks, per-token K and V, the layout a
// per-token uniform method's on_decode_step makes), and with `rows` the dequantized rows (as
// quant::decode gives them; kernels do not read core/compress). A cache whose prompt segments
// are fp16 comes back so (tests/kernels/test_decode_quant_tail.cpp); a method's packed prompt
// segments are refused by kv_hydrate as before.
void hydrate_packed_tail(Context& ctx, const CudaKV& C, const Tail& t, KVSegment& h, bool rows) {
  const int NKV = C.NKV, D = C.D, n = t.n;
  const int64_t kr = static_cast<int64_t>(D) * t.k_bits / 8, vr = static_cast<int64_t>(D) * t.v_bits / 8;
  const int64_t kc = static_cast<int64_t>(NKV) * n * kr, vc = static_cast<int64_t>(NKV) * n * vr;
  const uint8_t* staged = tail_to_host(ctx, t, {{&t.k, kr, NKV}, {&t.v, vr, NKV}, {&t.ranges, 2, 4 * NKV}},
                                       "decode rows' codes to the host");
  const auto* ranges = reinterpret_cast<const uint16_t*>(staged + kc + vc);
  auto p = std::make_shared<quant::QuantPayload>(NKV);
  for (int k = 0; k < NKV; ++k)
    for (int side = 0; side < 2; ++side) {
      quant::QuantBlock& b = side ? p->v[k] : p->k[k];
      const int64_t rb = side ? vr : kr;
      const uint8_t* codes = staged + (side ? kc : 0) + static_cast<int64_t>(k) * n * rb;
      b.codes.assign(codes, codes + n * rb);
      const uint16_t* sc = ranges + (2 * side * static_cast<int64_t>(NKV) + k) * n;
      const uint16_t* zr = ranges + ((2 * side + 1) * static_cast<int64_t>(NKV) + k) * n;
      b.scales.assign(sc, sc + n);
      b.zeros.assign(zr, zr + n);
    }
  p->layout.kind = quant::CodeLayout::Kind::Blocks;
  p->layout.k_bits = t.k_bits;
  p->layout.v_bits = t.v_bits;
  p->layout.k_axis = p->layout.v_axis = quant::Axis::PerToken;
  if (rows)
    for (int k = 0; k < NKV; ++k)
      for (int side = 0; side < 2; ++side) {
        const quant::QuantBlock& b = side ? p->v[k] : p->k[k];
        const int bits = side ? t.v_bits : t.k_bits;
        std::vector<float>& x = side ? h.heads[k].v : h.heads[k].k;
        x.resize(static_cast<size_t>(n) * D);
        std::vector<uint32_t> c(static_cast<size_t>(D));
        for (int i = 0; i < n; ++i)
          dequantize_packed_row(b.codes.data() + static_cast<int64_t>(i) * D * bits / 8, b.scales[static_cast<size_t>(i)],
                                b.zeros[static_cast<size_t>(i)], D, bits, side ? 0 : t.rotation, c.data(),
                                x.data() + static_cast<size_t>(i) * D);
      }
  p->layout.k_rotation = t.rotation;
  // As quant::set_quantized installs a payload: every row's key bits, the bytes (tail_bytes: the
  // payload's arrays and the positions).
  for (HeadRows& r : h.heads) r.bits.assign(static_cast<size_t>(n), static_cast<uint8_t>(t.k_bits));
  h.storage = t.label;
  h.payload = std::move(p);
}

// A coded decode tail (StepQuant::k_codec) as the host's coder leaves such rows: a segment whose
// payload is each head's row codes and fp16 scales in row order (‖k‖ then ‖r‖ with QJL; ‖v‖), the
// layout only the host decodes; its rows are the tail's fp16 rows (their dequantization).
void hydrate_coded_tail(Context& ctx, const CudaKV& C, const Tail& t, KVSegment& h) {
  const int NKV = C.NKV, n = t.n;
  const int64_t kr = t.k_codec->row_code_bytes(), vr = t.v_codec->row_code_bytes();
  const int64_t kc = static_cast<int64_t>(NKV) * n * kr, vc = static_cast<int64_t>(NKV) * n * vr;
  const uint8_t* staged = tail_to_host(ctx, t, {{&t.kcodes, kr, NKV}, {&t.vcodes, vr, NKV}, {&t.cscales, 2, 3 * NKV}},
                                       "decode rows' codes to the host");
  const auto* scales = reinterpret_cast<const uint16_t*>(staged + kc + vc);
  auto p = std::make_shared<quant::QuantPayload>(NKV);
  for (int k = 0; k < NKV; ++k)
    land_coded(CodedRows(*t.k_codec, *t.v_codec), staged + static_cast<int64_t>(k) * n * kr, staged + kc + static_cast<int64_t>(k) * n * vr,
               scales + static_cast<int64_t>(k) * n, scales + (static_cast<int64_t>(NKV) + k) * n,
               scales + (2LL * NKV + k) * n, n, p->k[static_cast<size_t>(k)], p->v[static_cast<size_t>(k)]);
  p->shrink_to_fit();
  for (HeadRows& r : h.heads) r.bits.assign(static_cast<size_t>(n), static_cast<uint8_t>(t.coded_bits));
  h.storage = t.label;
  h.payload = std::move(p);
}

}  // namespace

void kv_hydrate(Context& ctx, const DeviceKV& dev, KVStore& host, bool rows) {
  trace::Scope span("kv.hydrate");
  const CudaKV& C = as_cuda(dev);
  // The device's segments hold fp16 rows: the store keeps them as fp16 (values exact in float);
  // a packed decode tail comes back as its payload (hydrate_packed_tail).
  host = KVStore(C.L, C.NKV, C.D, RowStorage::Fp16);
  for (int l = 0; l < C.L; ++l) {
    LayerKV& H = host.layer(l);
    const DevLayer& d = C.layers[l];
    // Every part of the layer is copied into page-locked memory before one wait, then widened.
    struct Part {
      const __half* k;
      const __half* v;
      int n;
      HeadRows* to;
    };
    std::vector<Part> parts;
    for (const DevSeg& s : d.segs) {
      if (!s.fp16_rows || !dense_host(s.host_storage) || s.payload)
        throw InternalError("kv_hydrate: only a cache of fp16 rows can be read back");
      KVSegment h;
      h.kind = s.kind;
      h.storage = "fp16";
      h.layout_only = !rows;
      h.heads.resize(C.NKV);
      for (int k = 0; k < C.NKV; ++k) {
        h.heads[k].pos = s.pos[k];
        h.heads[k].merged = s.merged[k];
      }
      h.bytes = s.bytes;
      H.segments.push_back(std::move(h));
    }
    if (d.tail.n) {
      KVSegment h;
      h.kind = SegmentKind::Generated;
      h.storage = "fp16";
      h.layout_only = !rows;
      h.heads.resize(C.NKV);
      for (int k = 0; k < C.NKV; ++k) h.heads[k].pos.assign(d.tail.host_pos.begin() + d.tail.first(k), d.tail.host_pos.end());
      h.bytes = tail_bytes(d.tail, d.tail.rows(C.NKV), C.D);
      if (d.tail.packed()) hydrate_packed_tail(ctx, C, d.tail, h, rows);
      if (d.tail.coded()) hydrate_coded_tail(ctx, C, d.tail, h);
      H.segments.push_back(std::move(h));
    }
    if (!rows) continue;
    for (size_t i = 0; i < d.segs.size(); ++i)
      for (int k = 0; k < C.NKV; ++k) {
        const PartDesc& p = d.segs[i].heads[k].at(0).d;
        parts.push_back({static_cast<const __half*>(p.k.data), static_cast<const __half*>(p.v.data), p.n,
                         &H.segments[i].heads[k]});
      }
    if (d.tail.n && !d.tail.packed())
      for (int k = 0; k < C.NKV; ++k) {
        const int64_t at = (static_cast<int64_t>(k) * d.tail.cap + d.tail.first(k)) * C.D;
        parts.push_back({d.tail.k.as<__half>() + at, d.tail.v.as<__half>() + at, d.tail.n - d.tail.first(k),
                         &H.segments.back().heads[k]});
      }
    int64_t total = 0;
    for (const Part& p : parts) total += 2LL * p.n * C.D;
    const std::string what = "layer " + std::to_string(l) + " KV rows to the host";
    auto* staged = static_cast<uint16_t*>(ctx.staging(total * 2, what));
    int64_t at = 0;
    for (const Part& p : parts) {
      const int64_t n = static_cast<int64_t>(p.n) * C.D;
      ctx.download_async(staged + at, p.k, n * 2, what);
      ctx.download_async(staged + at + n, p.v, n * 2, what);
      at += 2 * n;
    }
    ctx.sync(what);
    // Widened on threads of their own (core/parallel.h: the host's side of a device copy).
    std::vector<int64_t> from(parts.size());
    at = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      from[i] = at;
      at += 2LL * parts[i].n * C.D;
    }
    parallel_for(static_cast<int>(parts.size()), 8, [&](int i) {
      const Part& p = parts[static_cast<size_t>(i)];
      const int64_t n = static_cast<int64_t>(p.n) * C.D;
      p.to->k.resize(static_cast<size_t>(n));
      p.to->v.resize(static_cast<size_t>(n));
      from_half_n(staged + from[static_cast<size_t>(i)], p.to->k.data(), n);
      from_half_n(staged + from[static_cast<size_t>(i)] + n, p.to->v.data(), n);
    });
  }
}

bool kv_quantize_rows(Context& ctx, DeviceKV& dev, int layer, const KVSegment& seg, const quant::UniformSpec& ks,
                      const quant::UniformSpec& vs, quant::QuantPayload& out, bool later) {
  trace::Scope span("kv.quantize_rows");
  CudaKV& C = as_cuda(&dev);
  const int NKV = C.NKV, D = C.D;
  if (layer < 0 || layer >= C.L || static_cast<int>(seg.heads.size()) != NKV ||
      static_cast<int>(out.k.size()) != NKV || static_cast<int>(out.v.size()) != NKV)
    throw InternalError("quantize_rows: layer " + std::to_string(layer) + " or the segment's KV heads do not match the cache");
  auto supported = [D](const quant::UniformSpec& q) {
    const bool rot = q.rotation == 0 || (q.axis == quant::Axis::PerToken && quant_tail_ok(D, q.rotation));
    return q.bits >= 1 && q.bits <= 8 && (q.axis != quant::Axis::PerToken || q.shrink == 1.0f) && rot;
  };
  if (!supported(ks) || !supported(vs) || D % 8 != 0) return false;
  const std::string what = std::string("quantized ") + segment_kind_name(seg.kind) + " rows of layer " + std::to_string(layer);
  const std::vector<const KVSegment*> segs{&seg};
  const SegmentRows rows(C, C.layers[static_cast<size_t>(layer)], segs, "quantize_rows: " + what);
  std::vector<int64_t> first(static_cast<size_t>(NKV) + 1, 0);
  for (int h = 0; h < NKV; ++h)
    first[static_cast<size_t>(h) + 1] = first[static_cast<size_t>(h)] + seg.heads[static_cast<size_t>(h)].n();
  const int64_t N = first.back();
  if (N == 0) return true;
  // Every KV head with the same rows (a segment no method evicted from), ranges over channels:
  // one launch a side, the heads' slots being equally spaced. Where both sides are so and the
  // heads' rows also lie equally spaced in the cache (the prefill's layout), they are read there;
  // else every head's rows are first copied into one [N][D] block a side (by a strided copy
  // where they are so spaced, else gathered by pointer).
  bool same_rows = NKV >= 2;
  for (int h = 1; h < NKV; ++h)
    same_rows = same_rows && first[static_cast<size_t>(h) + 1] - first[static_cast<size_t>(h)] == first[1];
  auto by_heads = [&](const quant::UniformSpec& q) { return same_rows && q.axis != quant::Axis::PerToken; };
  const __half* in[2] = {nullptr, nullptr};  // each side's first head
  int64_t in_stride[2] = {0, 0};              // (0: the gathered block's heads, back to back)
  DevMem X;
  if (!(by_heads(ks) && by_heads(vs) && rows.spaced(0, in[0], in[1], in_stride[0], in_stride[1]))) {
    X = {ctx.alloc(2 * N * D * 2, what), 2 * N * D * 2};
    rows.copy_into(ctx, 0, X.as<__half>(), what);
    in[0] = X.as<__half>();
    in[1] = X.as<__half>() + N * D;
    in_stride[0] = in_stride[1] = 0;
  }
  // Per head and side: codes, then scales and zeros (one range per channel, per row or one).
  using Slot = StagedCodes::Slot;
  auto n_ranges = [&](const quant::UniformSpec& q, int64_t n) -> int64_t {
    if (n == 0) return 0;
    const int64_t groups = q.group > 0 ? (n + q.group - 1) / q.group : 1;
    return q.axis == quant::Axis::PerToken ? n : q.axis == quant::Axis::Global ? groups : groups * D;
  };
  std::vector<Slot> slots(static_cast<size_t>(2 * NKV));
  int64_t code_bytes = 0, range_count = 0;
  for (int side = 0; side < 2; ++side)
    for (int h = 0; h < NKV; ++h) {
      const quant::UniformSpec& q = side ? vs : ks;
      const int64_t n = first[static_cast<size_t>(h) + 1] - first[static_cast<size_t>(h)];
      Slot& sl = slots[static_cast<size_t>(side * NKV + h)];
      sl.codes = code_bytes;
      sl.n_codes = n * D * q.bits / 8;
      sl.ranges = range_count;
      sl.n_ranges = n_ranges(q, n);
      code_bytes += (sl.n_codes + 15) / 16 * 16;
      range_count += sl.n_ranges;
    }
  DevMem Cd{ctx.alloc(std::max<int64_t>(code_bytes, 16), what + " codes"), std::max<int64_t>(code_bytes, 16)};
  DevMem R{ctx.alloc(std::max<int64_t>(2 * range_count * 2, 16), what + " ranges"), std::max<int64_t>(2 * range_count * 2, 16)};
  __half* scales = R.as<__half>();
  __half* zeros = scales + range_count;
  // n rows of a per-token side from x: codes at `codes` bytes into Cd, ranges `ranges` into R.
  auto per_token = [&](const quant::UniformSpec& q, const __half* x, int64_t n, int64_t codes, int64_t ranges) {
    uint8_t* c = static_cast<uint8_t*>(Cd.mem.get()) + codes;
    if (q.rotation)
      quantize_token_rotated(x, static_cast<int>(n), D, q.bits, q.rotation, c, scales + ranges, zeros + ranges, ctx.stream);
    else
      quantize_token(x, static_cast<int>(n), D, q.bits, nullptr, c, scales + ranges, zeros + ranges, ctx.stream);
  };
  for (int side = 0; side < 2; ++side) {
    const quant::UniformSpec& q = side ? vs : ks;
    const int chan = q.axis == quant::Axis::PerChannel ? 1 : 0;
    if (by_heads(q)) {
      const Slot& s0 = slots[static_cast<size_t>(side * NKV)];
      const Slot& s1 = slots[static_cast<size_t>(side * NKV + 1)];
      quantize_channel_heads(in[side], in_stride[side], NKV, static_cast<int>(first[1]), D, q.bits, chan, q.shrink,
                             q.shrink_about_zero, static_cast<uint8_t*>(Cd.mem.get()) + s0.codes, s1.codes - s0.codes,
                             scales + s0.ranges, zeros + s0.ranges, s1.ranges - s0.ranges, q.group, ctx.stream);
      continue;
    }
    // A range per row: every head in one launch where their rows, codes and ranges lie back to
    // back (rows of D·bits/8 bytes, a multiple of 16, leave no padding between heads' codes).
    if (q.axis == quant::Axis::PerToken) {
      const Slot& s0 = slots[static_cast<size_t>(side * NKV)];
      bool flat = in_stride[side] == 0 || (same_rows && in_stride[side] == first[1] * D);
      for (int h = 0; h < NKV && flat; ++h) {
        const Slot& sl = slots[static_cast<size_t>(side * NKV + h)];
        const int64_t r = first[static_cast<size_t>(h)];
        flat = sl.codes == s0.codes + r * D * q.bits / 8 && sl.ranges == s0.ranges + r;
      }
      if (flat) {
        per_token(q, in[side], N, s0.codes, s0.ranges);
        continue;
      }
    }
    for (int h = 0; h < NKV; ++h) {
      const Slot& sl = slots[static_cast<size_t>(side * NKV + h)];
      const int64_t n = first[static_cast<size_t>(h) + 1] - first[static_cast<size_t>(h)];
      const __half* x = in[side] + first[static_cast<size_t>(h)] * D;
      if (q.axis == quant::Axis::PerToken)
        per_token(q, x, n, sl.codes, sl.ranges);
      else
        quantize_channel(x, static_cast<int>(n), D, q.bits, chan, q.shrink, q.shrink_about_zero,
                         static_cast<uint8_t*>(Cd.mem.get()) + sl.codes, scales + sl.ranges, zeros + sl.ranges, q.group,
                         ctx.stream);
    }
  }
  // Values the binary decode path reads channel-major are regrouped so here, once (the host's
  // payload keeps rows: a landing regroups them back).
  std::vector<int> n_rows(static_cast<size_t>(NKV));
  bool v_channel_major = true;
  for (int h = 0; h < NKV; ++h) {
    n_rows[static_cast<size_t>(h)] = static_cast<int>(first[static_cast<size_t>(h) + 1] - first[static_cast<size_t>(h)]);
    v_channel_major = v_channel_major && channel_major_values(D, ks.bits, vs.bits, ks.axis != quant::Axis::PerToken,
                                                              vs.axis != quant::Axis::PerToken, ks.group, vs.group,
                                                              n_rows[static_cast<size_t>(h)]);
  }
  if (v_channel_major) regroup_values(ctx, Cd, slots, n_rows, D, what);
  // The codes and ranges into out's blocks once on the host.
  auto land_codes = [&out, slots, NKV, n_rows, v_channel_major, D](const char* host) {
    const auto* c = reinterpret_cast<const uint8_t*>(host);
    for (int side = 0; side < 2; ++side)
      for (int h = 0; h < NKV; ++h) {
        const Slot& sl = slots[static_cast<size_t>(side * NKV + h)];
        std::vector<uint8_t>& to = (side ? out.v : out.k)[static_cast<size_t>(h)].codes;
        if (side && v_channel_major)
          to = quant::rows_from_channel_major_1bit(c + sl.codes, n_rows[static_cast<size_t>(h)], D);
        else
          to.assign(c + sl.codes, c + sl.codes + sl.n_codes);
      }
  };
  auto land_ranges = [&out, slots, NKV, range_count](const char* host) {
    const auto* hs = reinterpret_cast<const uint16_t*>(host);
    const uint16_t* hz = hs + range_count;
    for (int side = 0; side < 2; ++side)
      for (int h = 0; h < NKV; ++h) {
        const Slot& sl = slots[static_cast<size_t>(side * NKV + h)];
        quant::QuantBlock& b = side ? out.v[static_cast<size_t>(h)] : out.k[static_cast<size_t>(h)];
        b.scales.assign(hs + sl.ranges, hs + sl.ranges + sl.n_ranges);
        b.zeros.assign(hz + sl.ranges, hz + sl.ranges + sl.n_ranges);
      }
  };
  if (later) {  // (left on the device until a host reader asks)
    KVBytes codes, ranges;
    for (const Slot& sl : slots) codes.codes += sl.n_codes;
    ranges.scales = ranges.zeros = range_count * 2;
    defer_landing(ctx, out, Cd.mem, code_bytes, codes, land_codes);
    defer_landing(ctx, out, R.mem, 2 * range_count * 2, ranges, land_ranges);
  } else {
    auto* staged = static_cast<char*>(ctx.staging(code_bytes + 2 * range_count * 2, what + " to the host"));
    ctx.download_async(staged, Cd.mem.get(), code_bytes, what + " codes");
    ctx.download_async(staged + code_bytes, R.mem.get(), 2 * range_count * 2, what + " ranges");
    ctx.sync(what);
    land_codes(staged);
    land_ranges(staged + code_bytes);
  }
  // The codes stay for the layer's next kv_sync, which stores `out` from them (one entry per
  // payload: quantizing again for the same payload replaces it).
  std::vector<StagedCodes>& q = C.layers[static_cast<size_t>(layer)].quantized;
  q.erase(std::remove_if(q.begin(), q.end(), [&](const StagedCodes& x) { return x.payload == &out; }), q.end());
  q.push_back(StagedCodes{&out, std::move(Cd), std::move(R), std::move(slots), range_count, ks.bits, vs.bits, v_channel_major});
  return true;
}

bool kv_code_rows(Context& ctx, DeviceKV& dev, int layer, const KVSegment& seg, const quant::RowCodec& k,
                  const quant::RowCodec& v, quant::QuantPayload& out, bool later) {
  trace::Scope span("kv.code_rows");
  CudaKV& C = as_cuda(&dev);
  const int NKV = C.NKV, D = C.D;
  if (layer < 0 || layer >= C.L || static_cast<int>(seg.heads.size()) != NKV ||
      static_cast<int>(out.k.size()) != NKV || static_cast<int>(out.v.size()) != NKV)
    throw InternalError("code_rows: layer " + std::to_string(layer) + " or the segment's KV heads do not match the cache");
  if (!codec_fits(&k, D) || !codec_fits(&v, D) || k.dp != v.dp || v.qjl) return false;
  const std::string what = std::string("coded ") + segment_kind_name(seg.kind) + " rows of layer " + std::to_string(layer);
  DevLayer& d = C.layers[static_cast<size_t>(layer)];
  const std::vector<const KVSegment*> segs{&seg};
  const SegmentRows rows(C, d, segs, "code_rows: " + what);
  std::vector<int64_t> first(static_cast<size_t>(NKV) + 1, 0);
  for (int h = 0; h < NKV; ++h)
    first[static_cast<size_t>(h) + 1] = first[static_cast<size_t>(h)] + seg.heads[static_cast<size_t>(h)].n();
  const int64_t N = first.back();
  if (N == 0) return true;
  // The rows into X [2][N][D], keys then values, coded there in place (X then holds their
  // dequantizations).
  const CodedRows f(k, v);
  DevMem X{ctx.alloc(2 * N * D * 2, what), 2 * N * D * 2};
  rows.copy_into(ctx, 0, X.as<__half>(), what);
  const int64_t at_scales = (N * (f.k_bytes + f.v_bytes) + 15) / 16 * 16;  // codes K, codes V, then the scales [3][N]
  DevMem Cd{ctx.alloc(at_scales + 3 * N * 2, what + " codes"), at_scales + 3 * N * 2};
  uint8_t* kc = Cd.as<uint8_t>();
  uint8_t* vc = kc + N * f.k_bytes;
  auto* sc = reinterpret_cast<__half*>(kc + at_scales);
  const DevMem cm = C.codecs(k, v);
  const CodecDev kd = codec_dev(cm, k, v, 0), vd = codec_dev(cm, k, v, 1);
  codec_rows(kd, vd, static_cast<int>(N), D, X.as<__half>(), kc, vc, sc, ctx.stream);
  // Each head's rows in order, as the host's coder appends them.
  auto land = [&out, f, first, N, NKV, at_scales](const char* host) {
    const auto* c = reinterpret_cast<const uint8_t*>(host);
    const auto* norms = reinterpret_cast<const uint16_t*>(c + at_scales);
    for (int h = 0; h < NKV; ++h) {
      const int64_t a = first[static_cast<size_t>(h)], b = first[static_cast<size_t>(h) + 1];
      land_coded(f, c + a * f.k_bytes, c + N * f.k_bytes + a * f.v_bytes, norms + a, norms + N + a, norms + 2 * N + a,
                 b - a, out.k[static_cast<size_t>(h)], out.v[static_cast<size_t>(h)]);
    }
  };
  if (later) {  // (left on the device until a host reader asks)
    KVBytes coded;
    coded.codes = N * (f.k_bytes + f.v_bytes);
    coded.scales = (f.qjl ? 3 : 2) * N * 2;
    defer_landing(ctx, out, Cd.mem, Cd.bytes, coded, land);
  } else {
    auto* staged = static_cast<char*>(ctx.staging(Cd.bytes, what + " to the host"));
    ctx.download_async(staged, Cd.mem.get(), Cd.bytes, what + " to the host");
    ctx.sync(what);
    land(staged);
  }
  // The rows, for the layer's next kv_sync (the segment whose payload is `out`; coding again for
  // the same payload replaces them).
  DevLayer::Coded keep{&out, std::move(X), {}};
  for (const HeadRows& r : seg.heads) keep.pos.push_back(r.pos);
  std::vector<DevLayer::Coded>& kept = d.coded;
  kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const DevLayer::Coded& c) { return c.payload == &out; }),
             kept.end());
  kept.push_back(std::move(keep));
  return true;
}

void kv_pull_rows(Context& ctx, SeqKV& kv, const std::vector<int>& layers, const int32_t* pos_host,
                  const SegmentKind* kinds, int T) {
  trace::Scope span("kv.pull_rows");
  CudaKV& C = as_cuda(kv.dev);
  const int NKV = C.NKV, D = C.D;
  // Rows t.n − T .. t.n − 1 of every head: one strided copy an array and layer into page-locked
  // memory (copies that need not wait for each other), one wait. Of fp16 rows (a coded tail's
  // are their dequantization) both sides' rows; of packed rows their codes and ranges, the rows
  // dequantized on the host as the host's per-token quantization keeps them.
  struct Copy {
    const DevMem* mem;
    int64_t row_bytes;
    int heads;
  };
  std::vector<std::vector<Copy>> copies(layers.size());
  std::vector<int64_t> at(layers.size() + 1, 0);
  for (size_t i = 0; i < layers.size(); ++i) {
    const Tail& t = C.layers.at(layers[i]).tail;
    if (T < 1 || T > t.n)
      throw InternalError("kv_pull_rows: layer " + std::to_string(layers[i]) + " holds " + std::to_string(t.n) +
                          " decode rows, " + std::to_string(T) + " asked for");
    if (t.zipped())
      throw InternalError("kv_pull_rows: layer " + std::to_string(layers[i]) + "'s decode rows are quantized in gaps");
    if (t.packed())
      copies[i] = {{&t.k, static_cast<int64_t>(D) * t.k_bits / 8, NKV},
                   {&t.v, static_cast<int64_t>(D) * t.v_bits / 8, NKV},
                   {&t.ranges, 2, 4 * NKV}};
    else
      copies[i] = {{&t.k, static_cast<int64_t>(D) * 2, NKV}, {&t.v, static_cast<int64_t>(D) * 2, NKV}};
    at[i + 1] = at[i];
    for (const Copy& c : copies[i]) at[i + 1] += c.heads * T * c.row_bytes;
  }
  auto* staged = static_cast<uint8_t*>(ctx.staging(at.back(), "decode rows to the host"));
  for (size_t i = 0; i < layers.size(); ++i) {
    const Tail& t = C.layers.at(layers[i]).tail;
    int64_t to = at[i];
    for (const Copy& c : copies[i]) {
      const size_t pitch = static_cast<size_t>(t.cap * c.row_bytes), width = static_cast<size_t>(T * c.row_bytes);
      KV_CUDA(cudaMemcpy2DAsync(staged + to, width, c.mem->as<uint8_t>() + (t.n - T) * c.row_bytes, pitch, width,
                                c.heads, cudaMemcpyDeviceToHost, ctx.stream),
              "layer " + std::to_string(layers[i]) + " decode rows to the host");
      to += c.heads * T * c.row_bytes;
    }
  }
  ctx.sync("decode rows to the host");
  const int64_t n = static_cast<int64_t>(NKV) * T * D;
  std::vector<float> k(n), v(n);  // [T][NKV][D], as the projections lay rows out
  std::vector<uint32_t> scratch(static_cast<size_t>(D));
  for (size_t i = 0; i < layers.size(); ++i) {
    const Tail& t = C.layers.at(layers[i]).tail;
    // This layer's arrays as copied: K then V ([NKV][T] rows), and for packed rows the ranges [4][NKV][T].
    const int64_t kr = copies[i][0].row_bytes, vr = copies[i][1].row_bytes;
    const uint8_t* kc = staged + at[i];
    const uint8_t* vc = kc + NKV * T * kr;
    const auto* ranges = reinterpret_cast<const uint16_t*>(vc + NKV * T * vr);
    for (int h = 0; h < NKV; ++h)
      for (int r = 0; r < T; ++r) {
        const int64_t row = static_cast<int64_t>(h) * T + r, out = (static_cast<int64_t>(r) * NKV + h) * D;
        if (!t.packed()) {
          from_half_n(reinterpret_cast<const uint16_t*>(kc + row * kr), k.data() + out, D);
          from_half_n(reinterpret_cast<const uint16_t*>(vc + row * vr), v.data() + out, D);
          continue;
        }
        auto range = [&](int plane) { return ranges[(static_cast<int64_t>(plane) * NKV + h) * T + r]; };
        dequantize_packed_row(kc + row * kr, range(0), range(1), D, t.k_bits, t.rotation, scratch.data(), k.data() + out);
        dequantize_packed_row(vc + row * vr, range(2), range(3), D, t.v_bits, 0, scratch.data(), v.data() + out);
      }
    // (a packed tail's rows as their dequantization is, not rounded to fp16 again)
    kv.host->append(layers[i], k.data(), v.data(), pos_host, kinds, T, t.packed());
    set_host_bytes(C, *kv.host, layers[i]);
  }
  // Rows that KIVI's groups quantized since they were appended (a grouped tail's first rows):
  // their dequantization, as the device holds them.
  std::vector<int> grouped;
  for (int l : layers) {
    const Tail& t = C.layers.at(l).tail;
    for (int h = 0; h < NKV; ++h)
      if (t.n - T < t.first(h)) {
        grouped.push_back(l);
        break;
      }
  }
  if (!grouped.empty()) group_rows_to_host(ctx, C, *kv.host, grouped, pos_host[0], pos_host[T - 1]);
}

namespace kv {

void group_rows_to_host(Context& ctx, const CudaKV& C, KVStore& host, const std::vector<int>& layers, int32_t lo,
                        int32_t hi) {
  const int D = C.D;
  // The host's rows by layer, head and position (segments of decode rows that hold rows).
  using Rows = std::unordered_map<int32_t, std::pair<float*, float*>>;
  std::vector<std::vector<Rows>> held(layers.size(), std::vector<Rows>(static_cast<size_t>(C.NKV)));
  for (size_t i = 0; i < layers.size(); ++i)
    for (KVSegment& s : host.layer(layers[i]).segments) {
      if (s.layout_only || s.kind != SegmentKind::Generated) continue;
      for (int h = 0; h < C.NKV; ++h) {
        HeadRows& r = s.heads.at(static_cast<size_t>(h));
        if (r.k.size() != r.pos.size() * D) continue;
        for (size_t j = 0; j < r.pos.size(); ++j)
          if (r.pos[j] >= lo && r.pos[j] <= hi) held[i][h][r.pos[j]] = {r.k.data() + j * D, r.v.data() + j * D};
      }
    }
  // Every KIVI piece of decode rows holding such a row: keys with a range per channel, values
  // one per row.
  struct Piece {
    const Rows* rows;
    const PartDesc* p;
    const std::vector<int32_t>* pos;
    int64_t at;  // bytes into the staging: K codes, V codes, K scales, K zeros, V scales, V zeros
  };
  std::vector<Piece> pieces;
  int64_t total = 0;
  for (size_t i = 0; i < layers.size(); ++i)
    for (const DevSeg& s : C.layers.at(static_cast<size_t>(layers[i])).segs) {
      if (s.kind != SegmentKind::Generated || s.fp16_rows) continue;
      for (int h = 0; h < C.NKV; ++h) {
        const Rows& rows = held[i][h];
        const std::vector<int32_t>& pos = s.pos[static_cast<size_t>(h)];
        if (!std::any_of(pos.begin(), pos.end(), [&](int32_t x) { return rows.count(x) > 0; })) continue;
        for (const DevPart& q : s.heads[static_cast<size_t>(h)]) {
          const PartDesc& p = q.d;
          if (p.k.fmt != kChannel || p.k.group != 0 || p.k.chan_stride != 1 || p.v.fmt != kToken || p.v.factor ||
              p.k.bits != p.v.bits || p.counter || !q.order.empty() || static_cast<size_t>(p.n) != pos.size())
            throw InternalError("group_rows_to_host: layer " + std::to_string(layers[i]) +
                                "'s decode rows in a segment not laid out as KIVI's groups");
          pieces.push_back({&rows, &p, &pos, total});
          total += 2 * static_cast<int64_t>(p.n) * D * p.k.bits / 8 + (2LL * D + 2LL * p.n) * 2;
        }
      }
    }
  if (pieces.empty()) return;
  const std::string what = "grouped decode rows to the host";
  auto* staged = static_cast<uint8_t*>(ctx.staging(total, what));
  for (const Piece& x : pieces) {
    const PartDesc& p = *x.p;
    const int64_t cb = static_cast<int64_t>(p.n) * D * p.k.bits / 8;
    uint8_t* o = staged + x.at;
    ctx.download_async(o, p.k.data, cb, what);
    ctx.download_async(o + cb, p.v.data, cb, what);
    ctx.download_async(o + 2 * cb, p.k.scale, D * 2LL, what);
    ctx.download_async(o + 2 * cb + 2 * D, p.k.zero, D * 2LL, what);
    ctx.download_async(o + 2 * cb + 4 * D, p.v.scale, p.n * 2LL, what);
    ctx.download_async(o + 2 * cb + 4 * D + 2LL * p.n, p.v.zero, p.n * 2LL, what);
  }
  ctx.sync(what);
  std::vector<uint32_t> c(static_cast<size_t>(D));
  for (const Piece& x : pieces) {
    const PartDesc& p = *x.p;
    const int bits = p.k.bits;
    const int64_t rb = static_cast<int64_t>(D) * bits / 8, cb = p.n * rb;
    const uint8_t* o = staged + x.at;
    const auto* ks = reinterpret_cast<const uint16_t*>(o + 2 * cb);
    const uint16_t *kz = ks + D, *vs = kz + D, *vz = vs + p.n;
    for (int j = 0; j < p.n; ++j) {
      const auto it = x.rows->find((*x.pos)[static_cast<size_t>(j)]);
      if (it == x.rows->end()) continue;  // (a row the host does not hold)
      quant::unpack(o + j * rb, D, bits, c.data());
      for (int e = 0; e < D; ++e)
        it->second.first[e] = static_cast<float>(c[static_cast<size_t>(e)]) * from_half(ks[e]) + from_half(kz[e]);
      dequantize_packed_row(o + cb + j * rb, vs[j], vz[j], D, bits, 0, c.data(), it->second.second);
    }
  }
}

}  // namespace kv

}  // namespace kvlens::cuda
