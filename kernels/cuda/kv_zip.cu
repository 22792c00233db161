// ZipCache's mixed-bit quantization of a group of the cache's segments where their rows are
// (Backend::zip_quantize_rows): the rows gathered by KV head, subset and position, quantized by
// the quant_pack.cu kernels (zip_quantize), every array landing in the host payload at the
// context's next land_all and kept for the layer's next kv_sync (StagedZip, build_zip).
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

namespace kvlens::cuda {

using namespace kv;

namespace {

// Arrays laid out one after another in one allocation, each from a 256-byte boundary.
struct Layout {
  int64_t bytes = 0;
  int64_t put(int64_t n) {
    const int64_t at = bytes;
    bytes += (n + 255) / 256 * 256;
    return at;
  }
};

}  // namespace

StagedZip kv::zip_arrays(Context& ctx, const CudaKV& C, int layer, const std::vector<const KVSegment*>& group,
                         const quant::QuantPayload& out) {
  const int NKV = C.NKV, D = C.D;
  const quant::CodeLayout& L = out.layout;
  const int bits[2] = {L.lo_bits, L.hi_bits};
  const std::string what = "zipcache rows of layer " + std::to_string(layer);
  const SegmentRows rows(C, C.layers[static_cast<size_t>(layer)], group, "zip_quantize_rows: " + what);

  // The rows in order: per KV head, the salient subset then the other, each in the group's order.
  std::vector<const __half*> src, values;
  std::vector<ZipBlock> blocks;
  std::vector<ZipFactorBlock> fblocks;
  std::vector<int32_t> row_block, row_pos;
  std::vector<int64_t> code_head(NKV + 1, 0), range_head(NKV + 1, 0), factor_head(NKV + 1, 0), row_head(NKV + 1, 0);
  std::vector<std::array<std::vector<int32_t>, 2>> sub_pos(static_cast<size_t>(NKV));  // [head][subset] positions
  std::vector<int32_t> row_sub;
  int64_t code = 0, range = 0, factor = 0;
  for (int h = 0; h < NKV; ++h) {
    std::array<std::vector<std::pair<size_t, int>>, 2> sub;  // (segment, row) of each subset
    int64_t n = 0;
    for (size_t si = 0; si < group.size(); ++si) n += group[si]->heads[static_cast<size_t>(h)].n();
    const std::vector<uint8_t>& flags = out.k[static_cast<size_t>(h)].flags;
    if (static_cast<int64_t>(flags.size()) != (n + 7) / 8)
      throw InternalError("zip_quantize_rows: " + what + ", KV head " + std::to_string(h) + ": " +
                          std::to_string(flags.size()) + " bytes of salient flags for " + std::to_string(n) + " rows");
    int64_t at = 0;
    for (size_t si = 0; si < group.size(); ++si)
      for (int i = 0; i < group[si]->heads[static_cast<size_t>(h)].n(); ++i, ++at)
        sub[quant::unpack_one(flags.data(), at, 1)].push_back({si, i});
    const int64_t first_row = static_cast<int64_t>(src.size());
    for (int s = 1; s >= 0; --s) {
      if (sub[s].empty()) continue;
      ZipBlock b;
      b.row0 = static_cast<int32_t>(src.size());
      b.n = static_cast<int32_t>(sub[s].size());
      b.bits = bits[s];
      b.code = code;
      b.range = range;
      b.factor = L.layer_factors ? factor : range;
      if (!L.layer_factors) fblocks.push_back({b.row0, b.n, range});
      for (const auto& [si, i] : sub[s]) {
        const RowMap::Row r = rows.row(si, h, i);
        src.push_back(r.first);
        values.push_back(r.second);
        row_block.push_back(static_cast<int32_t>(blocks.size()));
        row_pos.push_back(group[si]->heads[static_cast<size_t>(h)].pos[static_cast<size_t>(i)]);
        row_sub.push_back(s);
        sub_pos[static_cast<size_t>(h)][static_cast<size_t>(s)].push_back(row_pos.back());
      }
      code += static_cast<int64_t>(b.n) * D * b.bits / 8;
      range += D;
      blocks.push_back(b);
    }
    if (L.layer_factors && n > 0) {
      fblocks.push_back({static_cast<int32_t>(first_row), static_cast<int32_t>(n), factor});
      factor += D;
    }
    code_head[h + 1] = code;
    range_head[h + 1] = range;
    factor_head[h + 1] = L.layer_factors ? factor : range;
    row_head[h + 1] = static_cast<int64_t>(src.size());
  }
  const int64_t N = static_cast<int64_t>(src.size());
  StagedZip z;
  z.payload = &out;
  if (N == 0) return z;
  if (N > (int64_t{1} << 30)) throw InternalError("zip_quantize_rows: " + what + ": too many rows");

  // Token-range slots: one a row, or one per (subset, position) over the heads (salient
  // positions ascending, then the others'); the rows of each slot.
  std::vector<int32_t> row_slot(static_cast<size_t>(N));
  int64_t n_slots = N;
  bool one_table = false;
  if (L.shared_token_ranges) {
    const quant::ZipSlots slots = quant::zip_slots(sub_pos);
    n_slots = slots.n;
    one_table = slots.one_table;
    for (int64_t r = 0; r < N; ++r)
      row_slot[static_cast<size_t>(r)] = slots.of(row_sub[static_cast<size_t>(r)], row_pos[static_cast<size_t>(r)]);
  } else {
    for (int64_t r = 0; r < N; ++r) row_slot[static_cast<size_t>(r)] = static_cast<int32_t>(r);
  }
  std::vector<int32_t> slot_first(static_cast<size_t>(n_slots) + 1, 0), slot_rows(static_cast<size_t>(N));
  for (int32_t s : row_slot) ++slot_first[static_cast<size_t>(s) + 1];
  for (int64_t s = 0; s < n_slots; ++s) slot_first[static_cast<size_t>(s) + 1] += slot_first[static_cast<size_t>(s)];
  {
    std::vector<int32_t> fill(slot_first.begin(), slot_first.end() - 1);
    for (int64_t r = 0; r < N; ++r) slot_rows[static_cast<size_t>(fill[static_cast<size_t>(row_slot[static_cast<size_t>(r)])]++)] = static_cast<int32_t>(r);
  }
  const bool copies = L.shared_token_ranges && !one_table;

  // The arguments in one upload.
  src.insert(src.end(), values.begin(), values.end());
  Layout in;
  const int64_t a_ptr = in.put(2 * N * static_cast<int64_t>(sizeof(void*)));
  const int64_t a_blk = in.put(static_cast<int64_t>(blocks.size() * sizeof(ZipBlock)));
  const int64_t a_fb = in.put(static_cast<int64_t>(fblocks.size() * sizeof(ZipFactorBlock)));
  const int64_t a_rb = in.put(N * 4), a_rs = in.put(N * 4), a_sf = in.put((n_slots + 1) * 4), a_sr = in.put(N * 4);
  std::vector<char> args(static_cast<size_t>(in.bytes));
  auto put = [&](int64_t at, const void* p, size_t n) { std::memcpy(args.data() + at, p, n); };
  put(a_ptr, src.data(), src.size() * sizeof(void*));
  put(a_blk, blocks.data(), blocks.size() * sizeof(ZipBlock));
  put(a_fb, fblocks.data(), fblocks.size() * sizeof(ZipFactorBlock));
  put(a_rb, row_block.data(), row_block.size() * 4);
  put(a_rs, row_slot.data(), row_slot.size() * 4);
  put(a_sf, slot_first.data(), slot_first.size() * 4);
  put(a_sr, slot_rows.data(), slot_rows.size() * 4);
  DevMem A{ctx.alloc(in.bytes, what + " arguments"), in.bytes};
  ctx.upload(A.mem.get(), args.data(), in.bytes, what + " arguments");
  DevMem X{ctx.alloc(2 * N * D * 2, what), 2 * N * D * 2};
  auto* base = static_cast<char*>(A.mem.get());
  gather_rows(reinterpret_cast<const __half* const*>(base + a_ptr), X.as<__half>(), static_cast<int>(2 * N), D, ctx.stream);

  // The results, each array's KV heads one after another as the payload holds them.
  z.one_table = one_table;
  Layout res;
  auto array = [&](int64_t bytes, const std::vector<int64_t>& first, int elem, bool per_head) {
    StagedZip::Array a;
    a.at = res.put(bytes);
    a.bytes = bytes;
    for (int h = 0; h < NKV; ++h) a.head.push_back(per_head ? first[static_cast<size_t>(h)] * elem : 0);
    return a;
  };
  z.k_codes = array(code, code_head, 1, true);
  z.v_codes = array(code, code_head, 1, true);
  z.k_scales = array(range * 2, range_head, 2, true);
  z.k_zeros = array(range * 2, range_head, 2, true);
  const int64_t n_factors = factor_head[NKV];
  z.factors = array(n_factors * 2, factor_head, 2, true);
  // (per head when a range is a row's own; one table for all heads when shared)
  z.t_scales = array(n_slots * 2, row_head, 2, !L.shared_token_ranges);
  z.t_zeros = array(n_slots * 2, row_head, 2, !L.shared_token_ranges);
  if (copies) {
    z.row_scales = array(N * 2, row_head, 2, true);
    z.row_zeros = array(N * 2, row_head, 2, true);
  }
  z.mem = {ctx.alloc(res.bytes, what + " codes and ranges"), res.bytes};
  auto* rb = static_cast<char*>(z.mem.mem.get());
  ZipQuantArgs q;
  q.x = X.as<__half>();
  q.N = static_cast<int>(N);
  q.D = D;
  q.blocks = reinterpret_cast<const ZipBlock*>(base + a_blk);
  q.n_blocks = static_cast<int>(blocks.size());
  q.factor_blocks = reinterpret_cast<const ZipFactorBlock*>(base + a_fb);
  q.n_factor_blocks = static_cast<int>(fblocks.size());
  q.row_block = reinterpret_cast<const int32_t*>(base + a_rb);
  q.row_slot = reinterpret_cast<const int32_t*>(base + a_rs);
  q.slot_first = reinterpret_cast<const int32_t*>(base + a_sf);
  q.slot_rows = reinterpret_cast<const int32_t*>(base + a_sr);
  q.n_slots = static_cast<int>(n_slots);
  q.k_codes = reinterpret_cast<uint8_t*>(rb + z.k_codes.at);
  q.v_codes = reinterpret_cast<uint8_t*>(rb + z.v_codes.at);
  q.k_scale = reinterpret_cast<__half*>(rb + z.k_scales.at);
  q.k_zero = reinterpret_cast<__half*>(rb + z.k_zeros.at);
  q.factor = reinterpret_cast<__half*>(rb + z.factors.at);
  q.t_scale = reinterpret_cast<__half*>(rb + z.t_scales.at);
  q.t_zero = reinterpret_cast<__half*>(rb + z.t_zeros.at);
  if (copies) {
    q.row_scale = reinterpret_cast<__half*>(rb + z.row_scales.at);
    q.row_zero = reinterpret_cast<__half*>(rb + z.row_zeros.at);
  }
  zip_quantize(q, ctx.stream);
  return z;
}

bool kv_zip_quantize(Context& ctx, DeviceKV& dev, int layer, const std::vector<const KVSegment*>& group,
                     quant::QuantPayload& out) {
  CudaKV& C = as_cuda(&dev);
  const int NKV = C.NKV, D = C.D;
  const quant::CodeLayout& L = out.layout;
  if (layer < 0 || layer >= C.L || group.empty() || static_cast<int>(out.k.size()) != NKV ||
      static_cast<int>(out.v.size()) != NKV)
    throw InternalError("zip_quantize_rows: layer " + std::to_string(layer) + " or the payload's KV heads do not match the cache");
  for (const KVSegment* s : group)
    if (static_cast<int>(s->heads.size()) != NKV)
      throw InternalError("zip_quantize_rows: a segment of layer " + std::to_string(layer) + " has " +
                          std::to_string(s->heads.size()) + " KV heads, the cache " + std::to_string(NKV));
  if (L.kind != quant::CodeLayout::Kind::ZipMixed || L.hi_bits < 1 || L.hi_bits > 8 || L.lo_bits < 1 ||
      L.lo_bits > 8 || D % 8 != 0)
    return false;
  StagedZip z = zip_arrays(ctx, C, layer, group, out);
  if (!z.mem.mem) return true;
  // Every array into the payload once on the host (the copies per row stay on the device).
  const bool shared = L.shared_token_ranges;
  const bool copies = shared && !z.one_table;
  const int64_t land_bytes = copies ? z.row_scales.at : z.mem.bytes;
  ctx.land_later(z.mem.mem, land_bytes, [&out, z, NKV, shared](const char* host) {
    // Array a from its byte `from` to `to`, or KV head h's part of it (up to the next head's).
    auto span = [&](const StagedZip::Array& a, int64_t from, int64_t to) {
      return std::make_pair(host + a.at + from, host + a.at + to);
    };
    auto head = [&](const StagedZip::Array& a, int h) {
      return span(a, a.head[static_cast<size_t>(h)], h + 1 < NKV ? a.head[static_cast<size_t>(h) + 1] : a.bytes);
    };
    auto bytes = [](std::pair<const char*, const char*> x) {
      return std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(x.first), reinterpret_cast<const uint8_t*>(x.second));
    };
    auto halves = [](std::pair<const char*, const char*> x) {
      return std::vector<uint16_t>(reinterpret_cast<const uint16_t*>(x.first), reinterpret_cast<const uint16_t*>(x.second));
    };
    for (int h = 0; h < NKV; ++h) {
      const size_t k = static_cast<size_t>(h);
      out.k[k].codes = bytes(head(z.k_codes, h));
      out.v[k].codes = bytes(head(z.v_codes, h));
      out.k[k].scales = halves(head(z.k_scales, h));
      out.k[k].zeros = halves(head(z.k_zeros, h));
      out.v[k].meta = halves(head(z.factors, h));
      if (!shared) {
        out.v[k].scales = halves(head(z.t_scales, h));
        out.v[k].zeros = halves(head(z.t_zeros, h));
      }
    }
    if (shared) {
      out.tokens.scales = halves(span(z.t_scales, 0, z.t_scales.bytes));
      out.tokens.zeros = halves(span(z.t_zeros, 0, z.t_zeros.bytes));
    }
  });
  // The arrays stay for the layer's next kv_sync (one entry per payload: quantizing again for
  // the same payload replaces it).
  std::vector<StagedZip>& kept = C.layers[static_cast<size_t>(layer)].zipped;
  kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const StagedZip& x) { return x.payload == &out; }), kept.end());
  kept.push_back(std::move(z));
  return true;
}

}  // namespace kvlens::cuda
