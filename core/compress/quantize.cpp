#include "core/compress/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>

#include "core/errors.h"

namespace kvlens::quant {

// ---- Eq. 3/4 ----------------------------------------------------------------------------------

uint32_t quantize(float x, float alpha, float beta, int bits) {
  if (!(beta > alpha)) return 0;
  const double L = max_code(bits);
  const double c = std::nearbyint((static_cast<double>(x) - alpha) * L / (static_cast<double>(beta) - alpha));
  return static_cast<uint32_t>(std::clamp(c, 0.0, L));
}

float dequantize(uint32_t code, float alpha, float beta, int bits) {
  return static_cast<float>(code * ((static_cast<double>(beta) - alpha) / max_code(bits)) + alpha);
}

Affine make_affine(float alpha, float beta, int bits) {
  Affine a;
  a.alpha = round_half(alpha);
  a.scale = beta > alpha ? round_half((beta - alpha) / static_cast<float>(max_code(bits))) : 0.0f;
  return a;
}

uint32_t encode(float x, const Affine& a, int bits) {
  if (!(a.scale > 0)) return 0;
  const float c = std::nearbyint((x - a.alpha) / a.scale);
  return static_cast<uint32_t>(std::clamp(c, 0.0f, static_cast<float>(max_code(bits))));
}

// ---- ranges -----------------------------------------------------------------------------------

void min_max(const float* x, int n, int d, Axis axis, std::vector<float>& lo,
             std::vector<float>& hi) {
  const int m = static_cast<int>(block_ranges(n, d, axis));
  lo.assign(m, INFINITY);
  hi.assign(m, -INFINITY);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) {
      const int r = axis == Axis::Global ? 0 : axis == Axis::PerToken ? i : j;
      const float v = x[static_cast<int64_t>(i) * d + j];
      lo[r] = std::min(lo[r], v);
      hi[r] = std::max(hi[r], v);
    }
}

void shrink_range(float& lo, float& hi, float s, bool about_zero) {
  if (s == 1.0f) return;
  const float c = about_zero ? 0.0f : 0.5f * (lo + hi);
  lo = c + s * (lo - c);
  hi = c + s * (hi - c);
}

int64_t block_ranges(int n, int d, Axis axis) {
  if (n <= 0 || d <= 0) return 0;
  return axis == Axis::Global ? 1 : axis == Axis::PerToken ? n : d;
}

int64_t block_code_bytes(int n, int d, int bits, Axis axis) {
  if (n <= 0 || d <= 0) return 0;
  if (axis == Axis::PerToken) return static_cast<int64_t>(n) * packed_size(d, bits);
  return packed_size(static_cast<int64_t>(n) * d, bits);
}

void quantize_block(float* x, int n, int d, const UniformSpec& spec, QuantBlock& out) {
  if (n <= 0 || d <= 0) return;
  if (spec.rotation > 0) {  // rotated, quantized, rotated back (the transform is its own inverse)
    if (spec.axis != Axis::PerToken || d % spec.rotation != 0)
      throw InternalError("quantize_block: a Hadamard rotation of " + std::to_string(spec.rotation) +
                          " channels needs per-token ranges and a row size it divides, got " + std::to_string(d));
    UniformSpec plain = spec;
    plain.rotation = 0;
    for (int j = 0; j < n; ++j) block_hadamard(x + static_cast<int64_t>(j) * d, d, spec.rotation);
    quantize_block(x, n, d, plain, out);
    for (int j = 0; j < n; ++j) block_hadamard(x + static_cast<int64_t>(j) * d, d, spec.rotation);
    return;
  }
  if (spec.group > 0 && spec.group < n && spec.axis != Axis::PerToken) {  // each group on its own
    UniformSpec one = spec;
    one.group = 0;
    for (int g = 0; g < n; g += spec.group)
      quantize_block(x + static_cast<int64_t>(g) * d, std::min(spec.group, n - g), d, one, out);
    return;
  }
  std::vector<float> lo, hi;
  min_max(x, n, d, spec.axis, lo, hi);
  std::vector<Affine> aff(lo.size());
  for (size_t r = 0; r < lo.size(); ++r) {
    shrink_range(lo[r], hi[r], spec.shrink, spec.shrink_about_zero);
    aff[r] = make_affine(lo[r], hi[r], spec.bits);
    out.scales.push_back(to_half(aff[r].scale));
    out.zeros.push_back(to_half(aff[r].alpha));
  }
  std::vector<uint32_t> codes(static_cast<size_t>(n) * d);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) {
      const int r = spec.axis == Axis::Global ? 0 : spec.axis == Axis::PerToken ? i : j;
      float& v = x[static_cast<int64_t>(i) * d + j];
      const uint32_t c = encode(v, aff[r], spec.bits);
      codes[static_cast<size_t>(i) * d + j] = c;
      v = decode(c, aff[r]);
    }
  if (spec.axis == Axis::PerToken) {
    for (int i = 0; i < n; ++i) pack(codes.data() + static_cast<size_t>(i) * d, d, spec.bits, out.codes);
  } else {
    pack(codes.data(), static_cast<int64_t>(n) * d, spec.bits, out.codes);
  }
}

// ---- rotations --------------------------------------------------------------------------------

bool is_pow2(int n) { return n > 0 && (n & (n - 1)) == 0; }

int next_pow2(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

namespace {
double normal_pdf(double x) { return std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI); }
double normal_cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }
// Inverse of normal_cdf by bisection (only used for the initial levels).
double normal_quantile(double p) {
  double a = -10, b = 10;
  for (int it = 0; it < 200; ++it) {
    const double m = 0.5 * (a + b);
    (normal_cdf(m) < p ? a : b) = m;
  }
  return 0.5 * (a + b);
}
}  // namespace

std::vector<float> lloyd_max_normal(int bits) {
  const int K = 1 << bits;
  std::vector<double> c(K);
  for (int i = 0; i < K; ++i) c[i] = normal_quantile((i + 0.5) / K);
  for (int it = 0; it < 10000; ++it) {
    double moved = 0;
    std::vector<double> nc(K);
    for (int i = 0; i < K; ++i) {
      // Centroid of N(0,1) on the cell [t_i, t_{i+1}]: (φ(t_i) − φ(t_{i+1})) / (Φ(t_{i+1}) − Φ(t_i)).
      const double a = i == 0 ? -INFINITY : 0.5 * (c[i - 1] + c[i]);
      const double b = i == K - 1 ? INFINITY : 0.5 * (c[i] + c[i + 1]);
      const double pa = std::isinf(a) ? 0.0 : normal_pdf(a), pb = std::isinf(b) ? 0.0 : normal_pdf(b);
      const double mass = normal_cdf(b) - normal_cdf(a);
      nc[i] = mass > 0 ? (pa - pb) / mass : c[i];
      moved = std::max(moved, std::fabs(nc[i] - c[i]));
    }
    c = nc;
    if (moved < 1e-7) break;
  }
  return std::vector<float>(c.begin(), c.end());
}

uint32_t nearest_level(const std::vector<float>& levels, float x) {
  // Boundaries are the midpoints between consecutive levels.
  uint32_t lo = 0, hi = static_cast<uint32_t>(levels.size()) - 1;
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (x > 0.5f * (levels[mid] + levels[mid + 1])) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// ---- segments ---------------------------------------------------------------------------------

void pad_annotations(HeadRows& r, int bits) {
  const size_t n = static_cast<size_t>(r.n());
  if (!r.bits.empty() && r.bits.size() < n) r.bits.resize(n, static_cast<uint8_t>(bits));
  if (!r.merged.empty() && r.merged.size() < n) r.merged.resize(n, 0);
  if (r.bits.size() > n || r.merged.size() > n)
    throw InternalError("row annotations longer than the rows they annotate");
}

void set_quantized(KVSegment& s, std::shared_ptr<QuantPayload> p, const std::string& storage,
                   int bits) {
  if (bits < 0 || bits > 32) throw InternalError("set_quantized: bits must be in [0, 32]");
  for (HeadRows& h : s.heads) {
    if (bits > 0) {
      h.bits.assign(static_cast<size_t>(h.n()), static_cast<uint8_t>(bits));
    } else if (h.bits.size() != static_cast<size_t>(h.n())) {
      throw InternalError("set_quantized(" + storage + "): " + std::to_string(h.bits.size()) +
                          " row bits for " + std::to_string(h.n()) + " rows");
    }
    pad_annotations(h, bits);
  }
  p->shrink_to_fit();
  s.storage = storage;
  s.bytes = p->allocated();
  for (const HeadRows& h : s.heads)
    s.bytes.indices += static_cast<int64_t>(h.n()) * static_cast<int64_t>(sizeof(int32_t));
  s.payload = std::move(p);
}

void split_segment(LayerKV& layer, size_t i, const std::vector<int>& cut, int head_dim) {
  KVSegment& s = layer.segments.at(i);
  if (!s.dense())
    throw InternalError("split_segment: only dense (fp32/fp16) segments can be split, got " + s.storage);
  const int bpv = s.dense_value_bytes();
  KVSegment tail;
  tail.kind = s.kind;
  tail.storage = s.storage;
  tail.layout_only = s.layout_only;
  tail.heads.resize(s.heads.size());
  for (size_t h = 0; h < s.heads.size(); ++h) {
    HeadRows& r = s.heads[h];
    pad_annotations(r, 8 * bpv);
    const int c = std::clamp(cut.at(h), 0, r.n());
    const size_t off = static_cast<size_t>(c) * head_dim;
    HeadRows& t = tail.heads[h];
    if (!s.layout_only) {  // (a layout alone has positions and annotations, no rows)
      t.k.assign(r.k.begin() + off, r.k.end());
      t.v.assign(r.v.begin() + off, r.v.end());
    }
    t.pos.assign(r.pos.begin() + c, r.pos.end());
    if (!r.bits.empty()) t.bits.assign(r.bits.begin() + c, r.bits.end()), r.bits.resize(c);
    if (!r.merged.empty()) t.merged.assign(r.merged.begin() + c, r.merged.end()), r.merged.resize(c);
    if (!s.layout_only) {
      r.k.resize(off);
      r.v.resize(off);
    }
    r.pos.resize(c);
  }
  s.bytes = s.dense_bytes(head_dim, bpv);
  tail.bytes = tail.dense_bytes(head_dim, bpv);
  layer.segments.insert(layer.segments.begin() + static_cast<std::ptrdiff_t>(i) + 1, std::move(tail));
}

namespace {
// Appends y's annotation (of ny rows) to x's (of nx rows); when only one side is set, the other
// is filled with `fill` first so the result stays one entry per row.
template <typename T>
void cat_annotation(std::vector<T>& x, size_t nx, const std::vector<T>& y, size_t ny, T fill) {
  if (x.empty() && y.empty()) return;
  if (x.empty()) x.assign(nx, fill);
  x.insert(x.end(), y.begin(), y.end());
  if (y.empty()) x.resize(nx + ny, fill);
}
}  // namespace

bool merge_last_into_previous(LayerKV& layer) {
  const size_t n = layer.segments.size();
  if (n < 2) return false;
  KVSegment& a = layer.segments[n - 2];
  KVSegment& b = layer.segments[n - 1];
  auto shared_a = std::dynamic_pointer_cast<QuantPayload>(a.payload);
  auto pb = std::dynamic_pointer_cast<QuantPayload>(b.payload);
  if (a.kind != b.kind || a.storage != b.storage || !shared_a || !pb ||
      a.heads.size() != b.heads.size())
    return false;
  for (size_t h = 0; h < a.heads.size(); ++h) {
    if (!shared_a->k[h].flags.empty() || !pb->k[h].flags.empty()) return false;
  }
  // Copies of the store (KVStore is copyable) share the payload: grow a private clone.
  auto pa = std::make_shared<QuantPayload>(*shared_a);
  auto cat = [](auto& x, const auto& y) { x.insert(x.end(), y.begin(), y.end()); };
  for (size_t h = 0; h < a.heads.size(); ++h) {
    HeadRows& ra = a.heads[h];
    const HeadRows& rb = b.heads[h];
    const size_t na = static_cast<size_t>(ra.n()), nb = static_cast<size_t>(rb.n());
    if (ra.bits.size() > na || ra.merged.size() > na || rb.bits.size() > nb || rb.merged.size() > nb)
      throw InternalError("merge_last_into_previous: row annotations longer than the rows");
    // A quantized segment has one bits entry per row (set_quantized); 0 would read as fp32.
    std::vector<uint8_t> bb = rb.bits;
    std::vector<uint16_t> mb = rb.merged;
    if (!bb.empty()) bb.resize(nb, 0);
    if (!mb.empty()) mb.resize(nb, 0);
    if (!ra.bits.empty()) ra.bits.resize(na, 0);
    if (!ra.merged.empty()) ra.merged.resize(na, 0);
    cat_annotation<uint8_t>(ra.bits, na, bb, nb, 0);
    cat_annotation<uint16_t>(ra.merged, na, mb, nb, 0);
    cat(ra.k, rb.k);
    cat(ra.v, rb.v);
    cat(ra.pos, rb.pos);
    for (int kv = 0; kv < 2; ++kv) {
      QuantBlock& x = kv ? pa->v[h] : pa->k[h];
      const QuantBlock& y = kv ? pb->v[h] : pb->k[h];
      cat(x.codes, y.codes);
      cat(x.scales, y.scales);
      cat(x.zeros, y.zeros);
      cat(x.meta, y.meta);
    }
  }
  const std::string storage = a.storage;
  set_quantized(a, pa, storage, 0);
  layer.segments.pop_back();
  return true;
}

int rows_in_head(const LayerKV& layer, int h) {
  int n = 0;
  for (const KVSegment& s : layer.segments) n += s.heads.at(h).n();
  return n;
}

PendingPayload quantize_rows_of(const PrefillContext& ctx, KVSegment& s, const UniformSpec& ks, const UniformSpec& vs,
                                bool later, const std::string& method) {
  auto p = std::make_shared<QuantPayload>(static_cast<int>(s.heads.size()));
  if (s.layout_only) {
    const bool ok = ctx.backend && ctx.device &&
                    (later ? ctx.backend->quantize_rows_later(*ctx.device, ctx.layer, s, ks, vs, *p)
                           : ctx.backend->quantize_rows(*ctx.device, ctx.layer, s, ks, vs, *p));
    if (!ok)
      throw InternalError(method + ": layer " + std::to_string(ctx.layer) +
                          "'s rows are in the device cache alone, and its backend cannot quantize them there");
    return {&s, std::move(p)};
  }
  // Heads are independent: quantized in parallel.
  const int H = static_cast<int>(s.heads.size()), D = ctx.head_dim;
  std::exception_ptr err;
#pragma omp parallel for schedule(dynamic)
  for (int h = 0; h < H; ++h) {
    try {
      HeadRows& r = s.heads[h];
      quantize_block(r.k.data(), r.n(), D, ks, p->k[h]);
      quantize_block(r.v.data(), r.n(), D, vs, p->v[h]);
    } catch (...) {
#pragma omp critical(kvlens_quantize_rows_error)
      if (!err) err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
  return {&s, std::move(p)};
}

void quantize_prefill(const std::vector<PrefillContext>& layers, KVStore& kv,
                      const std::function<void(const PrefillContext&, LayerKV&, bool later)>& quantize,
                      const std::function<void()>& store) {
  Backend* be = layers.empty() ? nullptr : layers.front().backend;
  if (!be || !be->queues_reductions()) {
    for (const PrefillContext& c : layers) {
      quantize(c, kv.layer(c.layer), false);
      store();
    }
    return;
  }
  be->queue_then_keep(
      [&] {
        for (const PrefillContext& c : layers) {
          if (c.backend != be) throw InternalError("quantize_prefill: layers of one prefill on different backends");
          quantize(c, kv.layer(c.layer), true);
        }
      },
      store);
}

}  // namespace kvlens::quant
