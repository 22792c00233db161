// ZipCache's mixed-bit quantization of groups of the cache's segments where their rows are: the
// rows gathered by KV head, subset and position and quantized by the quant_pack.cu kernels
// (zip_quantize) — a prompt's groups one by one (Backend::zip_quantize_rows; a decode's streamed
// gaps are planned on the device instead, kv_zip_gap.cu), every array landing in its host payload at the context's next land_all and kept for the layer's next
// kv_sync (StagedZip, build_zip).
#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.h"
#include "core/kv_format.h"
#include "core/parallel.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/zip_kernels.h"
#include "kernels/cuda/kv_cache.h"
#include "core/trace.h"

namespace kvlens::cuda {

using namespace kv;

namespace {

// The host's part of the quantization of some groups (plan_zip: the cache's layout read, nothing
// launched, so several groups' plans can be made side by side): every group's rows in order —
// per KV head the salient subset then the other, each in the group's order — with offsets into
// arrays shared by the groups (the kernels take them as one), and the kernels' arguments as one
// upload.
struct ZipPlan {
  struct Span {
    int64_t code0 = 0, range0 = 0, factor0 = 0, slot0 = 0, row0 = 0, n_slots = 0, flags_end = 0, pos0 = 0, n_pos = 0;
    std::vector<int64_t> code_head, range_head, factor_head, row_head, flag_head;
    bool one_table = false, shared = false;
  };
  std::vector<Span> spans;
  std::vector<char> meta;  // each group's salient flags (per head), then its positions (4-aligned)
  int64_t N = 0, code = 0, range = 0, factor = 0, slots = 0;
  bool copies = false;
  int64_t n_blocks = 0, n_fblocks = 0;
  std::vector<char> args;  // row pointers, blocks, factor blocks, row blocks, row slots, slot lists
  int64_t a_ptr = 0, a_blk = 0, a_fb = 0, a_rb = 0, a_rs = 0, a_sf = 0, a_sr = 0;
  // args and meta moved to page-locked memory (Context::upload_room; null: uploaded from the
  // vectors), and their sizes.
  const char* room_args = nullptr;
  const char* room_meta = nullptr;
  int64_t args_bytes = 0, meta_bytes = 0;
  // args and meta into the context's upload room where it has some left (their vectors freed;
  // args_bytes and meta_bytes, set by plan_zip, stay).
  void to_room(Context& ctx) {
    const int64_t at = (args_bytes + 15) / 16 * 16;
    char* room = args_bytes > 0 ? ctx.upload_room(at + meta_bytes) : nullptr;
    if (!room) return;
    std::memcpy(room, args.data(), static_cast<size_t>(args_bytes));
    std::memcpy(room + at, meta.data(), static_cast<size_t>(meta_bytes));
    room_args = room;
    room_meta = room + at;
    std::vector<char>().swap(args);
    std::vector<char>().swap(meta);
  }
  const char* args_src() const { return room_args ? room_args : args.data(); }
  const char* meta_src() const { return room_meta ? room_meta : meta.data(); }
};

ZipPlan plan_zip(const CudaKV& C, const std::vector<ZipGroup>& groups) {
  const int NKV = C.NKV, D = C.D;
  ZipPlan zp;
  std::vector<const __half*> src, values;
  std::vector<ZipBlock> blocks;
  std::vector<ZipFactorBlock> fblocks;
  std::vector<int32_t> row_block, row_slot;
  std::vector<char>& meta = zp.meta;
  std::vector<ZipPlan::Span>& spans = zp.spans;
  spans.resize(groups.size());
  int64_t code = 0, range = 0, factor = 0, slots = 0;
  bool copies = false;
  // Each group's rows, every KV head's: the row lists made at their final sizes.
  std::vector<size_t> group_rows(groups.size(), 0);
  for (size_t gi = 0; gi < groups.size(); ++gi)
    for (const KVSegment* s : groups[gi].segs)
      for (const HeadRows& hr : s->heads) group_rows[gi] += static_cast<size_t>(hr.n());
  const size_t all_rows = std::accumulate(group_rows.begin(), group_rows.end(), size_t{0});
  for (auto* v : {&src, &values}) v->reserve(all_rows);
  for (auto* v : {&row_block, &row_slot}) v->reserve(all_rows);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const ZipGroup& g = groups[gi];
    const quant::QuantPayload& out = *g.payload;
    const quant::CodeLayout& L = out.layout;
    const int bits[2] = {L.lo_bits, L.hi_bits};
    const std::string what = "zipcache rows of layer " + std::to_string(g.layer);
    const SegmentRows rows(C, C.layers[static_cast<size_t>(g.layer)], g.segs, "zip_quantize_rows: " + what);
    ZipPlan::Span& sp = spans[gi];
    sp.code0 = code;
    sp.range0 = range;
    sp.factor0 = factor;
    sp.slot0 = slots;
    sp.row0 = static_cast<int64_t>(src.size());
    sp.shared = L.shared_token_ranges;
    std::vector<std::array<std::vector<int32_t>, 2>> sub_pos(static_cast<size_t>(NKV));  // [head][subset] positions
    std::vector<int32_t> row_sub, row_pos;
    row_sub.reserve(group_rows[gi]);
    row_pos.reserve(group_rows[gi]);
    for (int h = 0; h < NKV; ++h) {
      sp.code_head.push_back(code - sp.code0);
      sp.range_head.push_back(range - sp.range0);
      sp.factor_head.push_back(factor - sp.factor0);
      sp.row_head.push_back(static_cast<int64_t>(src.size()) - sp.row0);
      std::array<std::vector<std::pair<size_t, int>>, 2> sub;  // (segment, row) of each subset
      int64_t n = 0;
      for (const KVSegment* s : g.segs) n += s->heads[static_cast<size_t>(h)].n();
      const std::vector<uint8_t>& flags = out.k[static_cast<size_t>(h)].flags;
      if (static_cast<int64_t>(flags.size()) != (n + 7) / 8)
        throw InternalError("zip_quantize_rows: " + what + ", KV head " + std::to_string(h) + ": " +
                            std::to_string(flags.size()) + " bytes of salient flags for " + std::to_string(n) + " rows");
      sp.flag_head.push_back(static_cast<int64_t>(meta.size()));
      meta.insert(meta.end(), flags.begin(), flags.end());
      int64_t at = 0;
      for (size_t si = 0; si < g.segs.size(); ++si)
        for (int i = 0; i < g.segs[si]->heads[static_cast<size_t>(h)].n(); ++i, ++at)
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
        b.factor = factor;  // (per layer: the head's one slice, after its blocks)
        if (!L.layer_factors) {
          fblocks.push_back({b.row0, b.n, factor});
          factor += D;
        }
        for (const auto& [si, i] : sub[s]) {
          const RowMap::Row r = rows.row(si, h, i);
          src.push_back(r.first);
          values.push_back(r.second);
          row_block.push_back(static_cast<int32_t>(blocks.size()));
          row_pos.push_back(g.segs[si]->heads[static_cast<size_t>(h)].pos[static_cast<size_t>(i)]);
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
    }
    sp.flags_end = static_cast<int64_t>(meta.size());
    // Token-range slots: one a row, or one per (subset, position) over the heads (salient
    // positions ascending, then the others').
    const int64_t n_rows = static_cast<int64_t>(src.size()) - sp.row0;
    if (L.shared_token_ranges) {
      const quant::ZipSlots zs = quant::zip_slots(sub_pos);
      sp.n_slots = zs.n;
      sp.one_table = zs.one_table;
      for (int64_t r = 0; r < n_rows; ++r)
        row_slot.push_back(static_cast<int32_t>(slots + zs.of(row_sub[static_cast<size_t>(r)], row_pos[static_cast<size_t>(r)])));
    } else {
      sp.n_slots = n_rows;
      for (int64_t r = 0; r < n_rows; ++r) row_slot.push_back(static_cast<int32_t>(slots + r));
    }
    slots += sp.n_slots;
    copies = copies || (L.shared_token_ranges && !sp.one_table);
    // The group's positions as build_zip lays them out: segment by segment, each head's in turn.
    while (meta.size() % 4) meta.push_back(0);
    sp.pos0 = static_cast<int64_t>(meta.size());
    for (const KVSegment* s : g.segs)
      for (const HeadRows& hr : s->heads) {
        const char* p = reinterpret_cast<const char*>(hr.pos.data());
        meta.insert(meta.end(), p, p + hr.pos.size() * 4);
        sp.n_pos += static_cast<int64_t>(hr.pos.size());
      }
  }
  const int64_t N = static_cast<int64_t>(src.size());
  zp.N = N, zp.code = code, zp.range = range, zp.factor = factor, zp.slots = slots, zp.copies = copies;
  zp.meta_bytes = static_cast<int64_t>(meta.size());
  if (N == 0) return zp;
  if (N > (int64_t{1} << 30)) throw InternalError("zip_quantize_rows: too many rows (" + std::to_string(N) + ")");
  std::vector<int32_t> slot_first(static_cast<size_t>(slots) + 1, 0), slot_rows(static_cast<size_t>(N));
  for (int32_t s : row_slot) ++slot_first[static_cast<size_t>(s) + 1];
  for (int64_t s = 0; s < slots; ++s) slot_first[static_cast<size_t>(s) + 1] += slot_first[static_cast<size_t>(s)];
  {
    std::vector<int32_t> fill(slot_first.begin(), slot_first.end() - 1);
    for (int64_t r = 0; r < N; ++r) slot_rows[static_cast<size_t>(fill[static_cast<size_t>(row_slot[static_cast<size_t>(r)])]++)] = static_cast<int32_t>(r);
  }
  // The arguments as one upload.
  src.insert(src.end(), values.begin(), values.end());
  ArrayLayout in;
  zp.a_ptr = in.put(2 * N * static_cast<int64_t>(sizeof(void*)));
  zp.a_blk = in.put(static_cast<int64_t>(blocks.size() * sizeof(ZipBlock)));
  zp.a_fb = in.put(static_cast<int64_t>(fblocks.size() * sizeof(ZipFactorBlock)));
  zp.a_rb = in.put(N * 4), zp.a_rs = in.put(N * 4), zp.a_sf = in.put((slots + 1) * 4), zp.a_sr = in.put(N * 4);
  zp.args.resize(static_cast<size_t>(in.bytes));
  auto put = [&](int64_t at, const void* p, size_t n) { std::memcpy(zp.args.data() + at, p, n); };
  put(zp.a_ptr, src.data(), src.size() * sizeof(void*));
  put(zp.a_blk, blocks.data(), blocks.size() * sizeof(ZipBlock));
  put(zp.a_fb, fblocks.data(), fblocks.size() * sizeof(ZipFactorBlock));
  put(zp.a_rb, row_block.data(), row_block.size() * 4);
  put(zp.a_rs, row_slot.data(), row_slot.size() * 4);
  put(zp.a_sf, slot_first.data(), slot_first.size() * 4);
  put(zp.a_sr, slot_rows.data(), slot_rows.size() * 4);
  zp.n_blocks = static_cast<int64_t>(blocks.size());
  zp.n_fblocks = static_cast<int64_t>(fblocks.size());
  zp.args_bytes = static_cast<int64_t>(zp.args.size());
  return zp;
}

// The device's part of a group's quantization: the plan's arguments uploaded, the rows gathered and quantized.
std::vector<StagedZip> launch_zip(Context& ctx, const CudaKV& C, const std::vector<ZipGroup>& groups,
                                  const ZipPlan& zp) {
  const int NKV = C.NKV, D = C.D;
  std::vector<StagedZip> made(groups.size());
  for (size_t gi = 0; gi < groups.size(); ++gi) made[gi].payload = groups[gi].payload;
  const int64_t N = zp.N, code = zp.code, range = zp.range, factor = zp.factor, slots = zp.slots;
  const std::vector<ZipPlan::Span>& spans = zp.spans;
  if (N == 0) return made;
  const std::string what = "zipcache rows of " + std::to_string(groups.size()) + " group(s)";
  const int64_t arg_bytes = zp.args_bytes;
  DevMem A{ctx.alloc(arg_bytes, what + " arguments"), arg_bytes};
  ctx.upload(A.mem.get(), zp.args_src(), arg_bytes, what + " arguments");
  DevMem X{ctx.alloc(2 * N * D * 2, what), 2 * N * D * 2};
  auto* base = static_cast<char*>(A.mem.get());
  gather_rows(reinterpret_cast<const __half* const*>(base + zp.a_ptr), X.as<__half>(), static_cast<int>(2 * N), D, ctx.stream);

  // The results: each array of every group one after another, each group's KV heads one after
  // another as its payload holds them, with the ranges copied per row where some group's heads
  // hold a position's rows in different subsets; then the flags and positions (uploaded).
  ArrayLayout res;
  const ZipOutputs outs(res, code, range, factor, slots, zp.copies ? N : 0);
  const int64_t r_meta = res.put(zp.meta_bytes);
  DevMem R{ctx.alloc(res.bytes, what + " codes and ranges"), res.bytes};
  if (zp.meta_bytes > 0) ctx.upload(R.as<char>() + r_meta, zp.meta_src(), zp.meta_bytes, what + " flags and positions");
  auto* rb = R.as<char>();
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const ZipPlan::Span& sp = spans[gi];
    const int64_t rows = (gi + 1 < groups.size() ? spans[gi + 1].row0 : N) - sp.row0;
    const int64_t codes = (gi + 1 < groups.size() ? spans[gi + 1].code0 : code) - sp.code0;
    const int64_t ranges = (gi + 1 < groups.size() ? spans[gi + 1].range0 : range) - sp.range0;
    const int64_t factors = (gi + 1 < groups.size() ? spans[gi + 1].factor0 : factor) - sp.factor0;
    auto array = [&](int64_t at, int64_t bytes, const std::vector<int64_t>& first, int elem, bool per_head) {
      StagedZip::Array a;
      a.at = at;
      a.bytes = bytes;
      for (int h = 0; h < NKV; ++h) a.head.push_back(per_head ? first[static_cast<size_t>(h)] * elem : 0);
      return a;
    };
    StagedZip& z = made[gi];
    z.mem = R;
    z.one_table = sp.one_table;
    z.k_codes = array(outs.kc + sp.code0, codes, sp.code_head, 1, true);
    z.v_codes = array(outs.vc + sp.code0, codes, sp.code_head, 1, true);
    z.k_scales = array(outs.ks + sp.range0 * 2, ranges * 2, sp.range_head, 2, true);
    z.k_zeros = array(outs.kz + sp.range0 * 2, ranges * 2, sp.range_head, 2, true);
    z.factors = array(outs.f + sp.factor0 * 2, factors * 2, sp.factor_head, 2, true);
    // (per head when a range is a row's own; one table for all heads when shared)
    z.t_scales = array(outs.ts + sp.slot0 * 2, sp.n_slots * 2, sp.row_head, 2, !sp.shared);
    z.t_zeros = array(outs.tz + sp.slot0 * 2, sp.n_slots * 2, sp.row_head, 2, !sp.shared);
    if (sp.shared && !sp.one_table) {
      z.row_scales = array(outs.rs + sp.row0 * 2, rows * 2, sp.row_head, 2, true);
      z.row_zeros = array(outs.rz + sp.row0 * 2, rows * 2, sp.row_head, 2, true);
    }
    std::vector<int64_t> flag_head;
    for (int64_t f : sp.flag_head) flag_head.push_back(f - sp.flag_head.front());
    z.flags = array(r_meta + sp.flag_head.front(), sp.flags_end - sp.flag_head.front(), flag_head, 1, true);
    z.pos = array(r_meta + sp.pos0, sp.n_pos * 4, {}, 4, false);
  }
  ZipQuantArgs q;
  q.x = X.as<__half>();
  q.N = static_cast<int>(N);
  q.D = D;
  q.blocks = reinterpret_cast<const ZipBlock*>(base + zp.a_blk);
  q.n_blocks = static_cast<int>(zp.n_blocks);
  q.factor_blocks = reinterpret_cast<const ZipFactorBlock*>(base + zp.a_fb);
  q.n_factor_blocks = static_cast<int>(zp.n_fblocks);
  q.row_block = reinterpret_cast<const int32_t*>(base + zp.a_rb);
  q.row_slot = reinterpret_cast<const int32_t*>(base + zp.a_rs);
  q.slot_first = reinterpret_cast<const int32_t*>(base + zp.a_sf);
  q.slot_rows = reinterpret_cast<const int32_t*>(base + zp.a_sr);
  q.n_slots = static_cast<int>(slots);
  outs.point(q, rb);
  zip_quantize(q, ctx.stream);
  return made;
}

}  // namespace

bool kv_zip_quantize(Context& ctx, DeviceKV& dev, const std::vector<ZipRowsGroup>& groups) {
  trace::Scope span("kv.zip_quantize");
  CudaKV& C = as_cuda(&dev);
  const int NKV = C.NKV, D = C.D;
  // A payload whose layout these kernels do not make: false before anything is queued, an
  // error once a group prepared on a planner thread shows it.
  auto makes = [&](const quant::QuantPayload& out) {
    const quant::CodeLayout& L = out.layout;
    return L.kind == quant::CodeLayout::Kind::ZipMixed && L.hi_bits >= 1 && L.hi_bits <= 8 && L.lo_bits >= 1 &&
           L.lo_bits <= 8 && D % 8 == 0;
  };
  auto check_heads = [&](const ZipRowsGroup& g) {
    if (static_cast<int>(g.out->k.size()) != NKV || static_cast<int>(g.out->v.size()) != NKV)
      throw InternalError("zip_quantize_rows: layer " + std::to_string(g.layer) + ": the payload's KV heads (" +
                          std::to_string(g.out->k.size()) + ") do not match the cache's " + std::to_string(NKV));
  };
  if (D % 8 != 0) return false;
  std::vector<ZipGroup> all;
  for (const ZipRowsGroup& g : groups) {
    if (g.layer < 0 || g.layer >= C.L || g.segs.empty() || !g.out)
      throw InternalError("zip_quantize_rows: layer " + std::to_string(g.layer) + " of " + std::to_string(C.L) +
                          ", or a group without segments or payload");
    for (const KVSegment* s : g.segs)
      if (static_cast<int>(s->heads.size()) != NKV)
        throw InternalError("zip_quantize_rows: a segment of layer " + std::to_string(g.layer) + " has " +
                            std::to_string(s->heads.size()) + " KV heads, the cache " + std::to_string(NKV));
    if (!g.prepare) {
      check_heads(g);
      if (!makes(*g.out)) return false;
    }
    all.push_back({g.layer, g.segs, g.out});
  }
  // Group by group (a prompt's groups are large): the groups prepared (ZipRowsGroup::prepare) and
  // planned (the host's bookkeeping, the most of the work) side by side on threads of their own,
  // each group launched here as soon as its plan is ready, its arrays deferred in its payload and
  // kept for its layer's next kv_sync (one entry per payload: quantizing again for the same
  // payload replaces it).
  const size_t n = all.size();
  std::vector<ZipPlan> plans(n);
  std::vector<char> ready(n, 0);  // (under mu) 1: planned, 2: failed
  std::vector<std::exception_ptr> errors(n);
  std::mutex mu;
  std::condition_variable planned;
  // (a core left to this thread, which launches each group as soon as it is planned: with every
  // core planning, its wake-up waits for one)
  const int planners = std::max(1, product_threads() - 1);
  std::thread planner([&] {
    parallel_for(static_cast<int>(n), planners, [&](int x) {
      const size_t i = static_cast<size_t>(x);
      char state = 1;
      try {
        if (groups[i].prepare) {
          groups[i].prepare();
          check_heads(groups[i]);
          if (!makes(*groups[i].out))
            throw InternalError("zip_quantize_rows: layer " + std::to_string(groups[i].layer) +
                                "'s group was prepared with a layout other than ZipCache's mixed bits of 1 to 8");
        }
        trace::Scope plan_span("kv.zip_plan", x);
        plans[i] = plan_zip(C, {all[i]});
        plans[i].to_room(ctx);
      } catch (...) {
        errors[i] = std::current_exception();
        state = 2;
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        ready[i] = state;
      }
      planned.notify_all();
    });
  });
  struct Join {  // (the planner reads this frame: joined however the launches end)
    std::thread& t;
    ~Join() { t.join(); }
  } join{planner};
  for (size_t i = 0; i < n; ++i) {
    {
      std::unique_lock<std::mutex> lock(mu);
      planned.wait(lock, [&] { return ready[i] != 0; });
    }
    if (errors[i]) std::rethrow_exception(errors[i]);
    trace::Scope launch_span("kv.zip_launch", static_cast<int>(i));
    StagedZip z = std::move(launch_zip(ctx, C, {all[i]}, plans[i]).front());
    plans[i] = ZipPlan{};  // (its host arrays freed as the groups go)
    if (!z.mem.mem) continue;
    quant::QuantPayload* out = groups[i].out;
    // What the landing adds to the payload (its flags are the host's already).
    KVBytes counted;
    counted.codes = z.k_codes.bytes + z.v_codes.bytes;
    counted.scales = z.k_scales.bytes + z.t_scales.bytes;
    counted.zeros = z.k_zeros.bytes + z.t_zeros.bytes;
    counted.meta = z.factors.bytes;
    defer_landing(ctx, *out, z.mem.mem, z.mem.bytes, counted, [out, z, NKV](const char* host) {
      const bool shared = out->layout.shared_token_ranges;
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
        out->k[k].codes = bytes(head(z.k_codes, h));
        out->v[k].codes = bytes(head(z.v_codes, h));
        out->k[k].scales = halves(head(z.k_scales, h));
        out->k[k].zeros = halves(head(z.k_zeros, h));
        out->v[k].meta = halves(head(z.factors, h));
        if (!shared) {
          out->v[k].scales = halves(head(z.t_scales, h));
          out->v[k].zeros = halves(head(z.t_zeros, h));
        }
      }
      if (shared) {
        out->tokens.scales = halves(span(z.t_scales, 0, z.t_scales.bytes));
        out->tokens.zeros = halves(span(z.t_zeros, 0, z.t_zeros.bytes));
      }
    });
    std::vector<StagedZip>& kept = C.layers[static_cast<size_t>(groups[i].layer)].zipped;
    kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const StagedZip& x) { return x.payload == out; }), kept.end());
    kept.push_back(std::move(z));
  }
  return true;
}

}  // namespace kvlens::cuda
