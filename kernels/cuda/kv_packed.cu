// Packed segments of the GPU KV cache (kv_cache.h): a quantizing policy's payload stored as the
// decode kernel reads it — uploaded once, or taken from where kv_quantize_rows made it — and
// ZipCache's mixed-bit groups (uploaded, or taken from where kv_zip_quantize made them).
#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/kv_format.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/kv_cache.h"

namespace kvlens::cuda::kv {

namespace {

// One device allocation per array kind of a payload, every KV head's array concatenated.
struct HeadArrays {
  std::vector<int64_t> off;  // bytes
  DevMem mem;
  // Head h's array, `bytes` into it (null when nothing was uploaded).
  const void* at(int h, int64_t bytes = 0) const {
    return mem.mem ? static_cast<const char*>(mem.mem.get()) + off[static_cast<size_t>(h)] + bytes : nullptr;
  }
  const __half* half_at(int h, int64_t elems = 0) const { return static_cast<const __half*>(at(h, elems * 2)); }
};
// A ZipMixed group's arrays as the decode reads them, each with every KV head's offset: key and
// value codes, key ranges, V token ranges (a row each: the heads' rows of one subset and position
// copied per row where heads differ), CST factors, salient flags.
struct ZipArrays {
  HeadArrays kc, vc, ks, kz, vs, vz, vm, kf;
};
// get(h): head h's vector (elements of `elem` bytes).
template <class Get>
HeadArrays upload_heads(Context& ctx, int NKV, Get get, int elem, const std::string& what) {
  HeadArrays a;
  int64_t total = 0;
  for (int h = 0; h < NKV; ++h) {
    a.off.push_back(total);
    total += static_cast<int64_t>(get(h).size()) * elem;
  }
  if (total == 0) return a;
  a.mem = {ctx.alloc(total, what), total};
  // The heads' arrays side by side on the host, then one copy.
  std::vector<char> all(static_cast<size_t>(total));
  for (int h = 0; h < NKV; ++h)
    if (!get(h).empty())
      std::memcpy(all.data() + a.off[static_cast<size_t>(h)], get(h).data(), get(h).size() * static_cast<size_t>(elem));
  ctx.upload(a.mem.mem.get(), all.data(), total, what);
  return a;
}

// Device segment d's parts of a ZipMixed group: per KV head h its salient rows (n[h][1] at
// bits[1]) then the others (n[h][0] at bits[0]), each subset its own part (none where empty) in
// the order the arrays hold them; the arrays' bytes counted on d. The parts' `order` is left empty.
void zip_parts(DevSeg& d, const ZipArrays& a, const std::vector<std::array<int64_t, 2>>& n, const int bits[2],
               bool layer_factors, int D) {
  for (size_t h = 0; h < n.size(); ++h) {
    const int k = static_cast<int>(h);
    int64_t code = 0, ranges = 0, rows = 0;
    for (int sal = 1; sal >= 0; --sal) {
      const int64_t m = n[h][static_cast<size_t>(sal)];
      if (m == 0) continue;
      d.heads[h].push_back(zip_part(m, bits[sal], 0, a.kc.at(k, code), a.vc.at(k, code), a.ks.half_at(k, ranges),
                                    a.kz.half_at(k, ranges), a.vs.half_at(k, rows), a.vz.half_at(k, rows),
                                    a.vm.half_at(k, layer_factors ? 0 : ranges)));
      code += m * D * bits[sal] / 8;
      ranges += D;
      rows += m;
    }
  }
  for (const HeadArrays* x : {&a.kc, &a.vc, &a.ks, &a.kz, &a.vs, &a.vz, &a.vm, &a.kf})
    if (x->mem.mem) d.mem.push_back(x->mem);
  d.bytes.codes += a.kc.mem.bytes + a.vc.mem.bytes;
  d.bytes.scales += a.ks.mem.bytes + a.vs.mem.bytes;
  d.bytes.zeros += a.kz.mem.bytes + a.vz.mem.bytes;
  d.bytes.meta += a.vm.mem.bytes + a.kf.mem.bytes;
}

}  // namespace

// Whether `q` holds the payload's codes and ranges as kv_quantize_rows made them for it: the same
// payload, bits and array sizes, and no other arrays.
bool staged_for(const StagedCodes& q, const KVSegment& s, const quant::QuantPayload& p) {
  const size_t NKV = s.heads.size();
  if (q.payload != &p || q.k_bits != p.layout.k_bits || q.v_bits != p.layout.v_bits || q.slots.size() != 2 * NKV)
    return false;
  // (arrays the payload defers are these: kv_quantize_rows deferred them from the same slots)
  if (p.deferred()) return true;
  for (size_t side = 0; side < 2; ++side)
    for (size_t h = 0; h < NKV; ++h) {
      const quant::QuantBlock& b = side ? p.v[h] : p.k[h];
      const StagedCodes::Slot& sl = q.slots[side * NKV + h];
      if (static_cast<int64_t>(b.codes.size()) != sl.n_codes || static_cast<int64_t>(b.scales.size()) != sl.n_ranges ||
          static_cast<int64_t>(b.zeros.size()) != sl.n_ranges || !b.meta.empty() || !b.flags.empty())
        return false;
    }
  return true;
}

void regroup_values(Context& ctx, const DevMem& codes, const std::vector<StagedCodes::Slot>& slots,
                    const std::vector<int>& n, int D, const std::string& what) {
  const int NKV = static_cast<int>(n.size());
  if (NKV == 0) return;
  const int64_t first = slots[static_cast<size_t>(NKV)].codes, end = codes.bytes;
  DevMem T{ctx.alloc(end - first, what + " V codes (channel-major)"), end - first};
  auto off = [&](int h) { return slots[static_cast<size_t>(NKV + h)].codes; };
  bool spaced = NKV > 1;  // (kv_quantize_rows spaces equal slots equally)
  for (int h = 1; h < NKV; ++h) spaced = spaced && off(h) - off(h - 1) == off(1) - off(0) && n[static_cast<size_t>(h)] == n[0];
  const auto* src = static_cast<const uint8_t*>(codes.mem.get());
  auto* dst = static_cast<uint8_t*>(T.mem.get());
  if (spaced)
    channel_major_1bit(src + first, NKV, n[0], D, off(1) - off(0), dst, ctx.stream);
  else
    for (int h = 0; h < NKV; ++h)
      channel_major_1bit(src + off(h), 1, n[static_cast<size_t>(h)], D, 0, dst + (off(h) - first), ctx.stream);
  KV_CUDA(cudaMemcpyAsync(static_cast<uint8_t*>(codes.mem.get()) + first, dst, static_cast<size_t>(end - first),
                          cudaMemcpyDeviceToDevice, ctx.stream),
          what + " V codes (channel-major)");
}

// Whether the payload's arrays have the sizes its layout implies (else it is read on the host);
// a payload whose arrays are still deferred has those of the arrays it defers.
bool packed_ok(const quant::QuantPayload& p, const KVSegment& s, int D, int q_rotation) {
  using K = quant::CodeLayout::Kind;
  const auto& L = p.layout;
  if (L.k_rotation != q_rotation) return false;
  auto bits_ok = [](int b) { return b >= 1 && b <= 8; };
  if (p.deferred()) return L.kind == K::Fp16 || (L.kind == K::Blocks && bits_ok(L.k_bits) && bits_ok(L.v_bits));
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
    } else {
      return false;
    }
  }
  return true;
}

// A segment whose payload the decode kernel reads as it is: every array uploaded once, or, when
// `staged` holds them (staged_for), taken from where they were made.
DevSeg build_packed(Context& ctx, const CudaKV& C, const KVSegment& s, const quant::QuantPayload& p,
                    const StagedCodes* staged) {
  using K = quant::CodeLayout::Kind;
  const int NKV = C.NKV, D = C.D;
  const auto& L = p.layout;
  DevSeg d = mirror(s, "packed " + s.storage, NKV, false);
  d.k_rotation = L.k_rotation;
  const std::string what = std::string("KV ") + segment_kind_name(s.kind) + " segment " + s.storage;
  // One allocation per array kind (all heads concatenated), exactly the payload's bytes.
  // 1-bit channel-wise keys and values with ranges over the whole part (CalibQuant's visual
  // segment) at head size 128: the values go up channel-major by groups of 32 rows, the layout
  // of the binary tensor-core decode path (kChannelT, the same bytes).
  const bool chan_k = L.k_axis != quant::Axis::PerToken, chan_v = L.v_axis != quant::Axis::PerToken;
  bool channel_major = L.kind == K::Blocks;
  for (int h = 0; h < NKV; ++h)
    channel_major = channel_major && channel_major_values(D, L.k_bits, L.v_bits, chan_k, chan_v, L.k_group, L.v_group,
                                                          s.heads[static_cast<size_t>(h)].n());
  HeadArrays kc, vc, ks, kz, vs, vz, km, vm, kf, vf;
  if (staged && L.kind == K::Blocks) {
    // Every array where kv_quantize_rows made it: head h's K codes at slot h, V codes at slot
    // NKV + h, each slot's scales and zeros in the two halves of the ranges.
    auto from = [&](const DevMem& m, int side, auto offset) {
      HeadArrays a;
      a.mem = m;
      for (int h = 0; h < NKV; ++h) a.off.push_back(offset(staged->slots[static_cast<size_t>(side * NKV + h)]));
      return a;
    };
    using Slot = StagedCodes::Slot;
    const int64_t zeros_at = staged->range_count * 2;
    kc = from(staged->codes, 0, [](const Slot& x) { return x.codes; });
    vc = from(staged->codes, 1, [](const Slot& x) { return x.codes; });
    ks = from(staged->ranges, 0, [](const Slot& x) { return x.ranges * 2; });
    vs = from(staged->ranges, 1, [](const Slot& x) { return x.ranges * 2; });
    kz = from(staged->ranges, 0, [&](const Slot& x) { return zeros_at + x.ranges * 2; });
    vz = from(staged->ranges, 1, [&](const Slot& x) { return zeros_at + x.ranges * 2; });
    if (staged->v_channel_major && !channel_major)
      throw InternalError("kv_sync: " + what + ": values made channel-major for a layout that reads them by rows");
    if (channel_major && !staged->v_channel_major) {  // the values regrouped where they lie
      p.land();  // (a deferred landing reads the codes as they were made)
      std::vector<int> n;
      for (const HeadRows& r : s.heads) n.push_back(r.n());
      regroup_values(ctx, staged->codes, staged->slots, n, D, what);
    }
  } else {
    p.land();
    std::vector<std::vector<uint8_t>> v_groups;
    if (channel_major)
      for (int h = 0; h < NKV; ++h) v_groups.push_back(quant::channel_major_1bit(p.v[h].codes.data(), s.heads[h].n(), D));
    auto up = [&](auto get, int elem, const char* name) { return upload_heads(ctx, NKV, get, elem, what + " " + name); };
    using B = const std::vector<uint8_t>&;
    using H = const std::vector<uint16_t>&;
    kc = up([&](int h) -> B { return p.k[h].codes; }, 1, "K codes");
    vc = up([&](int h) -> B { return v_groups.empty() ? p.v[h].codes : v_groups[h]; }, 1, "V codes");
    ks = up([&](int h) -> H { return p.k[h].scales; }, 2, "K scales");
    kz = up([&](int h) -> H { return p.k[h].zeros; }, 2, "K zeros");
    vs = up([&](int h) -> H { return p.v[h].scales; }, 2, "V scales");
    vz = up([&](int h) -> H { return p.v[h].zeros; }, 2, "V zeros");
    km = up([&](int h) -> H { return p.k[h].meta; }, 2, "K factors");
    vm = up([&](int h) -> H { return p.v[h].meta; }, 2, "V factors");
    kf = up([&](int h) -> B { return p.k[h].flags; }, 1, "K flags");
    vf = up([&](int h) -> B { return p.v[h].flags; }, 1, "V flags");
  }
  std::vector<int32_t> pos;
  for (int h = 0; h < NKV; ++h) pos.insert(pos.end(), s.heads[h].pos.begin(), s.heads[h].pos.end());
  DevMem P;
  if (!pos.empty()) {
    P = {ctx.alloc(static_cast<int64_t>(pos.size()) * 4, what + " positions"), static_cast<int64_t>(pos.size()) * 4};
    ctx.upload(P.mem.get(), pos.data(), P.bytes, what + " positions");
  }
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
      q.d.k.data = kc.at(h);
      q.d.v.data = vc.at(h);
      d.heads[h].push_back(q);
    } else if (L.kind == K::Blocks) {
      auto side = [&](int bits, quant::Axis a, int group, const HeadArrays& c, const HeadArrays& sc, const HeadArrays& z) {
        KvSide k;
        k.fmt = a == quant::Axis::PerToken ? kToken : kChannel;
        k.bits = bits;
        k.group = group;
        k.chan_stride = a == quant::Axis::Global ? 0 : 1;
        k.data = c.at(h);
        k.scale = sc.half_at(h);
        k.zero = z.half_at(h);
        return k;
      };
      DevPart q;
      q.d.n = n;
      q.d.visual = vis;
      q.d.k = side(L.k_bits, L.k_axis, L.k_group, kc, ks, kz);
      q.d.v = side(L.v_bits, L.v_axis, L.v_group, vc, vs, vz);
      if (channel_major) q.d.v.fmt = kChannelT;
      d.heads[h].push_back(q);
    }
  }
  for (const HeadArrays* a : {&kc, &vc, &ks, &kz, &vs, &vz, &km, &vm, &kf, &vf})
    if (a->mem.mem && std::none_of(d.mem.begin(), d.mem.end(), [&](const DevMem& m) { return m.mem == a->mem.mem; }))
      d.mem.push_back(a->mem);
  if (P.mem) d.mem.push_back(P);
  d.bytes = p.allocated();
  d.bytes.indices += static_cast<int64_t>(pos.size()) * 4;
  return d;
}

// ZipCache's payload (CodeLayout::ZipMixed) over its group of consecutive host segments, one
// DevSeg per segment: the first holds every part of the group — per KV head its salient rows
// across the group's segments, then the others, `order` indexing the group's rows in segment
// order — and the others only their positions. With token ranges shared by the KV heads, the
// kernel reads a range per row of each part: when every head holds each position in the same
// subset (one ranking for all heads) the shared table is that, and every head reads it; else,
// and always in a streamed gap (generated rows), each head gets its rows' ranges copied into its
// own array, and the device holds (and reports) those copies instead of the shared table. Empty
// when the payload is not what the layout says (the group is then held as fp16 values).
std::vector<DevSeg> build_zip(Context& ctx, const CudaKV& C, const std::vector<const KVSegment*>& g,
                              const quant::QuantPayload& p, const StagedZip* staged) {
  const int NKV = C.NKV, D = C.D;
  const auto& L = p.layout;
  if (static_cast<int>(p.k.size()) != NKV || static_cast<int>(p.v.size()) != NKV || L.hi_bits < 1 || L.hi_bits > 8 ||
      L.lo_bits < 1 || L.lo_bits > 8)
    return {};
  const int bits[2] = {L.lo_bits, L.hi_bits};
  // Arrays made on the device for this payload: the sizes are theirs (the payload's own may not
  // have landed, or never will: a streamed gap's payload holds only its flags).
  const bool made_for_p = staged && staged->payload == &p;
  if (!made_for_p) p.land();  // (its arrays are uploaded from the host)
  // sub[h][s]: head h's rows (indices into the group's rows) in subset s (1: salient).
  std::vector<std::array<std::vector<int32_t>, 2>> sub(NKV);
  std::vector<std::vector<int32_t>> gpos(NKV);
  for (int h = 0; h < NKV; ++h) {
    for (const KVSegment* s : g) gpos[h].insert(gpos[h].end(), s->heads[h].pos.begin(), s->heads[h].pos.end());
    const int64_t n = static_cast<int64_t>(gpos[h].size());
    const quant::QuantBlock &k = p.k[h], &v = p.v[h];
    if (static_cast<int64_t>(k.flags.size()) != (n + 7) / 8) return {};
    for (int64_t i = 0; i < n; ++i) sub[h][quant::unpack_one(k.flags.data(), i, 1)].push_back(static_cast<int32_t>(i));
    if (made_for_p) continue;
    const int64_t nh = static_cast<int64_t>(sub[h][1].size()), nl = n - nh;
    const int64_t codes = (nh * D * bits[1] + nl * D * bits[0]) / 8, ranges = (nh ? D : 0) + (nl ? D : 0);
    if (static_cast<int64_t>(k.codes.size()) != codes || static_cast<int64_t>(v.codes.size()) != codes) return {};
    if (static_cast<int64_t>(k.scales.size()) != ranges || static_cast<int64_t>(k.zeros.size()) != ranges) return {};
    if (static_cast<int64_t>(v.meta.size()) != (L.layer_factors ? (n ? D : 0) : ranges)) return {};
    if (!L.shared_token_ranges && (static_cast<int64_t>(v.scales.size()) != n || static_cast<int64_t>(v.zeros.size()) != n))
      return {};
  }
  std::vector<std::array<std::vector<int32_t>, 2>> sub_pos(static_cast<size_t>(NKV));  // [head][subset] positions
  quant::ZipSlots slots;
  bool one_table = false;
  if (L.shared_token_ranges) {
    for (int h = 0; h < NKV; ++h)
      for (int s = 0; s < 2; ++s)
        for (int32_t i : sub[h][s]) sub_pos[static_cast<size_t>(h)][static_cast<size_t>(s)].push_back(gpos[h][static_cast<size_t>(i)]);
    slots = quant::zip_slots(sub_pos);
    if (!made_for_p &&
        (static_cast<int64_t>(p.tokens.scales.size()) != slots.n || static_cast<int64_t>(p.tokens.zeros.size()) != slots.n))
      return {};
    // (a streamed gap's ranges copied per row always, as the device's own gaps hold them: whether
    // its heads' rows agree is the ranking's, which the host does not wait for there)
    one_table = slots.one_table && g.front()->kind != SegmentKind::Generated;
  }
  // Arrays made on the device for this payload (in the same layout) are taken where they are.
  const bool take = made_for_p && staged->one_table == one_table;
  if (made_for_p && !take) return {};
  // Else, with heads whose rows of a position differ, each head's ranges copied row by row.
  std::vector<std::vector<uint16_t>> vs(NKV), vz(NKV);
  for (int h = 0; h < NKV && L.shared_token_ranges && !one_table && !take; ++h)
    for (int s = 1; s >= 0; --s)
      for (int32_t x : sub_pos[static_cast<size_t>(h)][static_cast<size_t>(s)]) {
        const int32_t r = slots.of(s, x);
        vs[h].push_back(p.tokens.scales[static_cast<size_t>(r)]);
        vz[h].push_back(p.tokens.zeros[static_cast<size_t>(r)]);
      }
  const KVSegment& s0 = *g.front();
  const bool copies = L.shared_token_ranges && !one_table;
  const std::string label = "packed " + s0.storage + (copies ? " (V token ranges per KV head)" : "");
  const std::string what = "KV mixed-bit group of " + std::to_string(g.size()) + " segment(s) " + s0.storage;
  auto up = [&](auto get, int elem, const char* name) { return upload_heads(ctx, NKV, get, elem, what + " " + name); };
  using B = const std::vector<uint8_t>&;
  using H = const std::vector<uint16_t>&;
  const bool own = !L.shared_token_ranges;
  // The shared table once, every head at its start.
  auto shared = [&](const std::vector<uint16_t>& x, const char* name) {
    HeadArrays a;
    a.off.assign(static_cast<size_t>(NKV), 0);
    const int64_t b = static_cast<int64_t>(x.size()) * 2;
    if (b == 0) return a;
    a.mem = {ctx.alloc(b, what + " " + name), b};
    ctx.upload(a.mem.mem.get(), x.data(), b, what + " " + name);
    return a;
  };
  auto made = [&](const StagedZip::Array& a) {
    HeadArrays h;
    h.off = a.head;
    if (a.bytes > 0) h.mem = part_of(staged->mem, a.at, a.bytes);
    return h;
  };
  const HeadArrays kc = take ? made(staged->k_codes) : up([&](int h) -> B { return p.k[h].codes; }, 1, "K codes");
  const HeadArrays vc = take ? made(staged->v_codes) : up([&](int h) -> B { return p.v[h].codes; }, 1, "V codes");
  const HeadArrays ks = take ? made(staged->k_scales) : up([&](int h) -> H { return p.k[h].scales; }, 2, "K scales");
  const HeadArrays kz = take ? made(staged->k_zeros) : up([&](int h) -> H { return p.k[h].zeros; }, 2, "K zeros");
  const HeadArrays vsa = take ? made(copies ? staged->row_scales : staged->t_scales)
                         : one_table ? shared(p.tokens.scales, "V token scales")
                                     : up([&](int h) -> H { return own ? p.v[h].scales : vs[h]; }, 2, "V token scales");
  const HeadArrays vza = take ? made(copies ? staged->row_zeros : staged->t_zeros)
                         : one_table ? shared(p.tokens.zeros, "V token zeros")
                                     : up([&](int h) -> H { return own ? p.v[h].zeros : vz[h]; }, 2, "V token zeros");
  const HeadArrays vm = take ? made(staged->factors) : up([&](int h) -> H { return p.v[h].meta; }, 2, "V channel factors");
  // (the flags and positions too where they came up with the arrays)
  const bool with_meta = take && !staged->flags.head.empty();
  const HeadArrays kf = with_meta ? made(staged->flags) : up([&](int h) -> B { return p.k[h].flags; }, 1, "salient flags");
  // Every segment's positions in one upload, each segment holding its own part.
  std::vector<DevSeg> out(g.size());
  std::vector<int32_t> pos;
  std::vector<int64_t> first_pos;
  for (size_t i = 0; i < g.size(); ++i) {
    const KVSegment& s = *g[i];
    DevSeg& d = out[i];
    d = mirror(s, label, NKV, false);
    first_pos.push_back(static_cast<int64_t>(pos.size()));
    for (int h = 0; h < NKV; ++h) {
      d.pos[h] = s.heads[h].pos;
      d.merged[h] = s.heads[h].merged;
      pos.insert(pos.end(), s.heads[h].pos.begin(), s.heads[h].pos.end());
    }
  }
  first_pos.push_back(static_cast<int64_t>(pos.size()));
  DevMem all_pos;
  if (with_meta && staged->pos.bytes == static_cast<int64_t>(pos.size()) * 4) {
    if (!pos.empty()) all_pos = part_of(staged->mem, staged->pos.at, staged->pos.bytes);
  } else if (!pos.empty()) {
    all_pos = {ctx.alloc(static_cast<int64_t>(pos.size()) * 4, what + " positions"), static_cast<int64_t>(pos.size()) * 4};
    ctx.upload(all_pos.mem.get(), pos.data(), all_pos.bytes, what + " positions");
  }
  for (size_t i = 0; i < g.size(); ++i) {
    const int64_t n = first_pos[i + 1] - first_pos[i];
    if (n > 0) out[i].mem.push_back(part_of(all_pos, first_pos[i] * 4, n * 4));
    out[i].bytes.indices = n * 4;
  }
  DevSeg& first = out.front();
  std::vector<std::array<int64_t, 2>> counts(static_cast<size_t>(NKV));
  for (int h = 0; h < NKV; ++h)
    for (int sal = 0; sal < 2; ++sal) counts[static_cast<size_t>(h)][static_cast<size_t>(sal)] = static_cast<int64_t>(sub[h][sal].size());
  zip_parts(first, {kc, vc, ks, kz, vsa, vza, vm, kf}, counts, bits, L.layer_factors, D);
  for (int h = 0; h < NKV; ++h) {
    size_t part = 0;
    for (int sal = 1; sal >= 0; --sal)
      if (!sub[h][sal].empty()) first.heads[h].at(part++).order = sub[h][sal];
  }
  return out;
}

}  // namespace kvlens::cuda::kv
