// ZipCache's streamed gaps on the GPU (StepQuant::zip; the host's twin is ZipCache's
// on_decode_step). The steps keep each layer's probe queries after RoPE and each probe's softmax
// states over the rows it read (KeptQueries, slots planned by kv_reserve from the method's
// StepZip::probes). Before the step whose row follows `gap` dense decode rows, every layer's gap
// is quantized in launches queued behind the steps, the host waiting for none of them: the gap
// rows' saliency is reduced from the probes' scores over the gap's rows under those states in
// one launch (zip_gap_saliency: the rows older than the gap, which each probe's step read, are
// never re-quantized, so its states are the host's softmax sums) and ranked (zip_rank_gap, as
// the method ranks it), the ranked rows are laid out (zip_gap_plan), gathered and quantized
// (zip_quantize, the prompt's kernels) and copied into the gaps' store (zip_store_gap), laid out
// at the first gap for every gap the decode rows have room for: per layer and KV head a salient
// part and a regular part whose rows grow by a gap's subset each time, a range group and CST
// factors a gap. Each layer's gaps are one segment before the decode rows, its parts' row counts
// moved at every gap without a new layout (rows_moved: the steps stay captured). Which rows are
// salient is the ranking's and stays on the device; how many is not (round(ratio · gap) a KV
// head), so the parts, sizes and bytes are known here. A gap's V token ranges are copied per row
// (build_zip lays the host loop's gaps out so too).
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/trace.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/zip_kernels.h"
#include "kernels/cuda/kv_cache.h"

namespace kvlens::cuda {

using namespace kv;

namespace {

// Every layer's probes of this gap (slot k saw the gap's rows up to its own), as zip_gap_saliency
// takes them: n_probes [L], seen [L][S]; `probes` the probes in all.
struct GapProbes {
  std::vector<int32_t> args;
  int probes = 0;
};
GapProbes gap_probes(const CudaKV& C, int g0, int gap) {
  const int L = C.L, S = C.zip.slots;
  GapProbes g;
  g.args.assign(static_cast<size_t>(L + L * S), 0);
  int32_t* n_probes = g.args.data();
  int32_t* seen = n_probes + L;
  for (int l = 0; l < L; ++l) {
    const std::vector<int32_t>& slot = C.zip.slot_of_row[static_cast<size_t>(l)];
    for (int r = g0; r < g0 + gap; ++r) {
      const int k = slot[static_cast<size_t>(r)];
      if (k < 0) continue;
      seen[l * S + k] = r - g0 + 1;
      n_probes[l] = std::max(n_probes[l], k + 1);
    }
    g.probes += n_probes[l];
  }
  return g;
}

// The saliency of every layer's gap rows, sal [L][NKV][gap] (0 where no probe saw a row, as on
// the host): each probe's queries scored against the gap's rows it saw, under the softmax states
// its own step kept (the rows older than the gap are what that step read: never re-quantized
// since).
void gap_saliency(Context& ctx, CudaKV& C, const GapProbes& g, const ZipGapRows& rows, int gap, bool accumulated,
                  double* sal) {
  trace::Scope span("kv.zip_gap.saliency");
  const int L = C.L, NKV = C.NKV, D = C.D;
  const CudaKV::ZipProbes& P = C.zip;
  if (g.probes == 0) {
    KV_CUDA(cudaMemsetAsync(sal, 0, static_cast<size_t>(L) * NKV * gap * 8, ctx.stream), "ZipCache gap saliency");
    return;
  }
  const int64_t ab = static_cast<int64_t>(g.args.size()) * 4;
  DevMem A{ctx.alloc(ab, "ZipCache gap probes"), ab};
  ctx.upload(A.mem.get(), g.args.data(), ab, "ZipCache gap probes");
  const auto* a = A.as<int32_t>();
  // (at the scale of the steps that kept the states: 1/√D, as the host's streaming scores, for
  // every model kvlens runs)
  zip_gap_saliency(P.q.as<float>(), P.md.as<float2>(), rows, D, P.scale, L, P.slots, P.n_heads, NKV, gap, a, a + L,
                   accumulated, sal, ctx.stream);
}

// Where zip_gap_layout's blocks, factor blocks and row blocks lie in CudaKV::ZipProbes::blocks.
struct BlockArrays {
  int64_t blocks = 0, factors = 0, rows = 0, bytes = 0;
};
BlockArrays block_arrays(const ZipGapLayout& Z) {
  ArrayLayout in;
  BlockArrays a;
  a.blocks = in.put(static_cast<int64_t>(Z.blocks.size() * sizeof(ZipBlock)));
  a.factors = in.put(static_cast<int64_t>(Z.factor_blocks.size() * sizeof(ZipFactorBlock)));
  a.rows = in.put(static_cast<int64_t>(Z.row_block.size()) * 4);
  a.bytes = in.bytes;
  return a;
}

}  // namespace

bool kv::zip_gap_due(const CudaKV& C) {
  const Tail& t = C.layers.front().tail;
  return t.zipped() && t.n - t.first(0) >= t.groups.zip.gap;
}

void kv::zip_gap(Context& ctx, CudaKV& C) {
  if (C.L == 0 || !zip_gap_due(C)) return;
  trace::Scope span("kv.zip_gap");
  const int L = C.L, NKV = C.NKV, D = C.D;
  const Tail& t0 = C.layers.front().tail;
  const StepQuant& q = t0.groups;
  const StepZip& z = q.zip;
  const int gap = z.gap, g0 = t0.first(0);
  const int k = std::clamp(static_cast<int>(std::llround(z.ratio * gap)), 0, gap);
  for (int l = 0; l < L; ++l) {
    const Tail& t = C.layers[static_cast<size_t>(l)].tail;
    bool same = t.zipped() && t.n == t0.n && t.groups.zip.gap == gap && t.cap == t0.cap && !t.packed();
    for (int h = 0; h < NKV && same; ++h) same = t.first(h) == g0;
    if (!same) throw InternalError("ZipCache gaps: layer " + std::to_string(l) + "'s decode rows differ from layer 0's");
  }
  CudaKV::ZipProbes& P = C.zip;
  if (!P.slot.mem || g0 + gap > P.rows)
    throw InternalError("ZipCache gaps: no probe schedule for decode rows " + std::to_string(g0) + " to " +
                        std::to_string(g0 + gap - 1));
  const int64_t N = static_cast<int64_t>(L) * NKV * gap, per = static_cast<int64_t>(NKV) * gap;
  const bool shared_ranges = !z.head_token_ranges;
  const int64_t n_slots = shared_ranges ? static_cast<int64_t>(L) * 2 * gap : N;
  const int fb = (gap + 7) / 8;
  if (N * 2 >= (int64_t{1} << 31))
    throw InternalError("ZipCache gaps: " + std::to_string(N) + " rows over the layers' KV heads (fewer than 2^30)");

  // The blocks, the same every gap: made and uploaded once.
  if (!P.blocks.mem) {
    P.layout = zip_gap_layout(L, NKV, gap, k, D, q.k_bits, q.v_bits, z.layer_factors);
    const ZipGapLayout& Z = P.layout;
    const BlockArrays at = block_arrays(Z);
    std::vector<char> host(static_cast<size_t>(at.bytes), 0);
    std::copy_n(reinterpret_cast<const char*>(Z.blocks.data()), Z.blocks.size() * sizeof(ZipBlock), host.begin() + at.blocks);
    std::copy_n(reinterpret_cast<const char*>(Z.factor_blocks.data()), Z.factor_blocks.size() * sizeof(ZipFactorBlock),
                host.begin() + at.factors);
    std::copy_n(reinterpret_cast<const char*>(Z.row_block.data()), Z.row_block.size() * 4, host.begin() + at.rows);
    P.blocks = {ctx.alloc(at.bytes, "ZipCache gap blocks"), at.bytes};
    ctx.upload(P.blocks.mem.get(), host.data(), at.bytes, "ZipCache gap blocks");
  }
  const ZipGapLayout& Z = P.layout;
  const BlockArrays blocks_at = block_arrays(Z);
  if (static_cast<int64_t>(Z.row_block.size()) != N)
    throw InternalError("ZipCache gaps: blocks made for " + std::to_string(Z.row_block.size()) + " rows, the gap has " +
                        std::to_string(N));

  // Scratch: the saliency and ranking key, salient marks, the layers' tail pointers, the plan,
  // the gathered rows.
  ArrayLayout sc;
  const int64_t s_sal = sc.put(N * 8), s_key = sc.put(N * 8), s_mark = sc.put(N), s_ptr = sc.put(3LL * L * 8),
                s_src = sc.put(2 * N * 8), s_rs = sc.put(N * 4), s_sf = sc.put((n_slots + 1) * 4), s_sr = sc.put(N * 4),
                s_x = sc.put(2 * N * D * 2);
  DevMem W{ctx.alloc(sc.bytes, "ZipCache gap scratch"), sc.bytes};
  char* w = W.as<char>();
  // The gap's arrays, every layer's one after another in each (copied into the gaps' store).
  ArrayLayout rs;
  const ZipOutputs outs(rs, Z.code, Z.range, Z.factor, n_slots, shared_ranges ? N : 0);
  ZipGapResult res{outs};
  res.flags = rs.put(static_cast<int64_t>(L) * NKV * fb);
  res.pos = rs.put(N * 4);
  res.order = rs.put(N * 4);
  DevMem R{ctx.alloc(rs.bytes, "ZipCache gap codes and ranges"), rs.bytes};
  char* r = R.as<char>();

  // The gaps' store, made at the first gap for every gap the decode rows have room for.
  if (!P.store.mem) {
    P.store_at = zip_store_layout(Z, res, L, NKV, gap, k, D, q.k_bits, q.v_bits, z.layer_factors, t0.cap / gap);
    const ZipStoreLayout& S = P.store_at;
    P.store = {ctx.alloc(S.bytes, "ZipCache gaps' store"), S.bytes};
    const int64_t rb = static_cast<int64_t>(S.runs.size() * sizeof(ZipStoreRun));
    P.runs = {ctx.alloc(rb, "ZipCache gaps' store runs"), rb};
    ctx.upload(P.runs.mem.get(), S.runs.data(), rb, "ZipCache gaps' store runs");
    P.gaps = 0;
    P.first_row = g0;
  }
  const ZipStoreLayout& S = P.store_at;
  const int gi = P.gaps;
  if (gi >= S.gaps || g0 != P.first_row + gi * gap)
    throw InternalError("ZipCache gaps: gap " + std::to_string(gi) + " at decode row " + std::to_string(g0) +
                        ", the store made for " + std::to_string(S.gaps) + " gaps from row " + std::to_string(P.first_row));

  // The layers' decode rows.
  std::vector<const void*> ptrs(3 * static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    const Tail& t = C.layers[static_cast<size_t>(l)].tail;
    ptrs[static_cast<size_t>(l)] = t.k.mem.get();
    ptrs[static_cast<size_t>(L + l)] = t.v.mem.get();
    ptrs[static_cast<size_t>(2 * L + l)] = t.pos.mem.get();
  }
  ctx.upload(w + s_ptr, ptrs.data(), 3LL * L * 8, "ZipCache gap rows");
  ZipGapRows rows;
  const auto* const* tails = reinterpret_cast<const void* const*>(w + s_ptr);
  rows.k = reinterpret_cast<const __half* const*>(tails);
  rows.v = reinterpret_cast<const __half* const*>(tails + L);
  rows.pos = reinterpret_cast<const int32_t* const*>(tails + 2 * L);
  rows.cap = t0.cap;
  rows.first = g0;
  gap_saliency(ctx, C, gap_probes(C, g0, gap), rows, gap, z.accumulated, reinterpret_cast<double*>(w + s_sal));
  {
    trace::Scope plan_span("kv.zip_gap.quantize");
    auto* order = reinterpret_cast<int32_t*>(r + res.order);
    const auto* mark = reinterpret_cast<const uint8_t*>(w + s_mark);
    zip_rank_gap(reinterpret_cast<const double*>(w + s_sal), L, NKV, gap, k, z.shared_ranking,
                 reinterpret_cast<double*>(w + s_key), reinterpret_cast<uint8_t*>(w + s_mark), order,
                 reinterpret_cast<uint8_t*>(r + res.flags), ctx.stream);
    auto* src = reinterpret_cast<const __half**>(w + s_src);
    zip_gap_plan(rows, L, NKV, gap, k, D, shared_ranges, order, mark, src, reinterpret_cast<int32_t*>(w + s_rs),
                 reinterpret_cast<int32_t*>(w + s_sf), reinterpret_cast<int32_t*>(w + s_sr),
                 reinterpret_cast<int32_t*>(r + res.pos), ctx.stream);
    auto* x = reinterpret_cast<__half*>(w + s_x);
    gather_rows(src, x, static_cast<int>(2 * N), D, ctx.stream);
    const char* b = P.blocks.as<char>();
    ZipQuantArgs a;
    a.x = x;
    a.N = static_cast<int>(N);
    a.D = D;
    a.blocks = reinterpret_cast<const ZipBlock*>(b + blocks_at.blocks);
    a.n_blocks = static_cast<int>(Z.blocks.size());
    a.factor_blocks = reinterpret_cast<const ZipFactorBlock*>(b + blocks_at.factors);
    a.n_factor_blocks = static_cast<int>(Z.factor_blocks.size());
    a.row_block = reinterpret_cast<const int32_t*>(b + blocks_at.rows);
    a.row_slot = reinterpret_cast<const int32_t*>(w + s_rs);
    a.slot_first = reinterpret_cast<const int32_t*>(w + s_sf);
    a.slot_rows = reinterpret_cast<const int32_t*>(w + s_sr);
    a.n_slots = static_cast<int>(n_slots);
    a.max_block_rows = std::max(k, gap - k);
    outs.point(a, r);
    zip_quantize(a, ctx.stream);
    zip_store_gap(P.runs.as<ZipStoreRun>(), static_cast<int>(S.runs.size()), r, P.store.as<char>(), gi, ctx.stream);
  }

  // Each layer's gaps one segment read from the store: per KV head the salient rows of every gap
  // (a range group and CST factors a gap), then the others; the segment replaced at every gap.
  trace::Scope layout_span("kv.zip_gap.layout");
  const int G = gi + 1;
  KVBytes per_gap;  // (a layer's, as build_zip counts a group's arrays)
  per_gap.codes = 2 * Z.layer_code;
  per_gap.scales = per_gap.zeros = Z.layer_range * 2 + per * 2;
  per_gap.meta = Z.layer_factor * 2 + NKV * static_cast<int64_t>(fb);
  per_gap.indices = per * 4;
  const std::string label = "packed " + q.label + (shared_ranges ? " (V token ranges per KV head)" : "");
  char* store = P.store.as<char>();
  for (int l = 0; l < L; ++l) {
    DevLayer& d = C.layers[static_cast<size_t>(l)];
    DevSeg s;
    s.kind = SegmentKind::Generated;
    s.storage = label;
    s.host_storage = q.label;
    s.fp16_rows = false;
    s.heads.resize(static_cast<size_t>(NKV));
    const auto from = d.tail.host_pos.begin() + P.first_row;
    s.pos.assign(static_cast<size_t>(NKV), std::vector<int32_t>(from, from + static_cast<int64_t>(G) * gap));
    s.merged.resize(static_cast<size_t>(NKV));
    for (int h = 0; h < NKV; ++h)
      for (int sal = 1; sal >= 0; --sal) {
        const ZipStoreLayout::Subset& x = S.sub[static_cast<size_t>(l) * NKV + h][static_cast<size_t>(sal)];
        if (x.kc < 0) continue;
        auto half_at = [&](int64_t at) { return reinterpret_cast<const __half*>(store + at); };
        s.heads[static_cast<size_t>(h)].push_back(zip_part(static_cast<int64_t>(G) * S.n[sal], S.bits[sal], S.n[sal],
                                                           store + x.kc, store + x.vc, half_at(x.ks), half_at(x.kz),
                                                           half_at(x.vs), half_at(x.vz), half_at(x.f)));
      }
    s.mem.push_back(P.store);
    for (int i = 0; i < G; ++i) s.bytes += per_gap;
    s.order_dev = part_of(P.store, S.order[static_cast<size_t>(l)], static_cast<int64_t>(NKV) * S.gaps * gap * 4);
    s.zip = {G, gap, k, S.gaps};
    if (gi == 0) {
      d.segs.push_back(std::move(s));
    } else {
      if (d.segs.empty() || d.segs.back().zip.gaps != gi)
        throw InternalError("ZipCache gaps: layer " + std::to_string(l) + "'s last segment is not its " +
                            std::to_string(gi) + " gaps");
      d.segs.back() = std::move(s);
    }
    d.tail.start.assign(static_cast<size_t>(NKV), g0 + gap);
  }
  P.gaps = G;
  // The first gap adds the store's parts (a new layout); later ones move rows between parts.
  if (gi == 0) {
    C.changed();
  } else {
    C.rows_moved();
    if (C.nh > 0) C.build_tables(C.nh);
  }
}

}  // namespace kvlens::cuda
