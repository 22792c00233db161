// ZipCache's streamed gaps on the GPU (StepQuant::zip; the host's twin is ZipCache's
// on_decode_step). The steps keep each layer's probe queries after RoPE (rope_append's
// KeptQueries, slots planned by kv_reserve from the method's StepZip::probes). Before the step
// whose row follows `gap` dense decode rows, every layer's probes are scored against the cache as
// it is (the rows each probe saw have not changed since: older rows are never re-quantized) in
// one launch of the decode's scoring kernel, the gap rows' saliency is reduced on the device
// (zip_gap_saliency), and only that crosses to the host, where the method ranks it
// (StepZip::rank, as its host hook does); every layer's gap is then quantized where its rows are
// by one upload and one launch (zip_arrays, the prompt's kernels), each into a segment of its own
// before the decode rows.
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
#include "kernels/cuda/kv_cache.h"

namespace kvlens::cuda {

using namespace kv;

namespace {

// A gap's payload before its arrays: each KV head's salient flags (1 bit a row, as
// zipcache::mark_group packs them) and the layout the kernels make (CodeLayout::ZipMixed).
void gap_payload(const std::vector<std::vector<char>>& flags, const StepQuant& q, quant::QuantPayload& p) {
  for (size_t h = 0; h < flags.size(); ++h) {
    std::vector<uint32_t> f(flags[h].begin(), flags[h].end());
    for (uint32_t& x : f) x = x ? 1u : 0u;
    p.k[h].flags.clear();
    quant::pack(f.data(), static_cast<int64_t>(f.size()), 1, p.k[h].flags);
  }
  p.layout.kind = quant::CodeLayout::Kind::ZipMixed;
  p.layout.hi_bits = q.k_bits;
  p.layout.lo_bits = q.v_bits;
  p.layout.layer_factors = q.zip.layer_factors;
  p.layout.shared_token_ranges = !q.zip.head_token_ranges;
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
  const StepZip& z = t0.groups.zip;
  const int gap = z.gap, g0 = t0.first(0);
  const CudaKV::ZipProbes& P = C.zip;
  for (int l = 0; l < L; ++l) {
    const Tail& t = C.layers[static_cast<size_t>(l)].tail;
    bool same = t.zipped() && t.n == t0.n && t.groups.zip.gap == gap;
    for (int h = 0; h < NKV && same; ++h) same = t.first(h) == g0;
    if (!same) throw InternalError("ZipCache gaps: layer " + std::to_string(l) + "'s decode rows differ from layer 0's");
  }
  if (!P.slot.mem || g0 + gap > P.rows)
    throw InternalError("ZipCache gaps: no probe schedule for decode rows " + std::to_string(g0) + " to " +
                        std::to_string(g0 + gap - 1));
  const int NH = P.n_heads, S = P.slots;

  // Each layer's probes of this gap (slot k saw the gap's rows up to its own), and each KV
  // head's rows older than the gap: the arguments of the reduction, in one upload.
  std::vector<int32_t> args(static_cast<size_t>(L + L * S + L * NKV), 0);
  int32_t* n_probes = args.data();
  int32_t* seen = n_probes + L;
  int32_t* before = seen + L * S;
  int64_t stride = 1;
  int probes = 0;
  for (int l = 0; l < L; ++l) {
    const std::vector<int32_t>& slot = P.slot_of_row[static_cast<size_t>(l)];
    for (int r = g0; r < g0 + gap; ++r) {
      const int k = slot[static_cast<size_t>(r)];
      if (k < 0) continue;
      seen[l * S + k] = r - g0 + 1;
      n_probes[l] = std::max(n_probes[l], k + 1);
    }
    probes += n_probes[l];
    const DevLayer& d = C.layers[static_cast<size_t>(l)];
    for (int h = 0; h < NKV; ++h) {
      int64_t rows = 0;
      for (const DevSeg& s : d.segs) rows += static_cast<int64_t>(s.pos[h].size());
      before[l * NKV + h] = static_cast<int32_t>(rows);
      stride = std::max(stride, rows + gap);
    }
  }
  std::vector<double> sal(static_cast<size_t>(L) * NKV * gap, 0.0);
  if (probes > 0) {  // (else no row is seen: every saliency is 0, as on the host)
    trace::Scope sal_span("kv.zip_gap.saliency");
    AttnLayout lay;
    lay.n_heads = NH;
    lay.n_kv_heads = NKV;
    lay.head_dim = D;
    lay.row_stride = P.width;
    lay.scale = 1.0f / std::sqrt(static_cast<float>(D));  // (as the host's streaming scores)
    Buffer q;
    q.name = "ZipCache probe queries";
    q.shape = {static_cast<int64_t>(L) * S, P.width};
    q.dt = Dt::F32;
    q.data = P.q.mem.get();
    std::vector<int32_t> layer_of(static_cast<size_t>(L) * S);
    for (size_t b = 0; b < layer_of.size(); ++b) layer_of[b] = static_cast<int32_t>(b / static_cast<size_t>(S));
    const DevMem scores = query_scores(ctx, C, q, lay, layer_of, stride);
    const int64_t ab = static_cast<int64_t>(args.size()) * 4, sb = static_cast<int64_t>(sal.size()) * 8;
    DevMem A{ctx.alloc(sb + ab, "ZipCache gap saliency"), sb + ab};  // the saliency, then the arguments
    auto* out = A.as<double>();
    const auto* a = reinterpret_cast<const int32_t*>(A.as<char>() + sb);
    ctx.upload(A.as<char>() + sb, args.data(), ab, "ZipCache gap probes");
    zip_gap_saliency(scores.as<float>(), stride, L, S, NH, NKV, gap, a, a + L, a + L + L * S, z.accumulated, out,
                     ctx.stream);
    ctx.download(sal.data(), out, sb, "ZipCache gap saliency");
  }

  // Each layer's gap: flags ranked here, every layer's rows quantized where they are by one
  // launch, each gap a segment of its own.
  std::vector<LayerKV> gaps(static_cast<size_t>(L));
  std::vector<quant::QuantPayload> payloads(static_cast<size_t>(L), quant::QuantPayload(NKV));
  std::vector<ZipGroup> groups;
  for (int l = 0; l < L; ++l) {
    trace::Scope rank_span("kv.zip_gap.rank", l);
    const Tail& t = C.layers[static_cast<size_t>(l)].tail;
    LayerKV& gap_rows = gaps[static_cast<size_t>(l)];
    gap_rows.segments.resize(1);
    KVSegment& s = gap_rows.segments[0];
    s.kind = SegmentKind::Generated;
    s.storage = t.groups.label;
    s.layout_only = true;
    s.heads.resize(static_cast<size_t>(NKV));
    for (HeadRows& h : s.heads) h.pos.assign(t.host_pos.begin() + g0, t.host_pos.begin() + g0 + gap);
    const std::vector<std::vector<char>> flags = z.rank(sal.data() + static_cast<int64_t>(l) * NKV * gap, NKV, gap);
    bool sized = static_cast<int>(flags.size()) == NKV;
    for (const std::vector<char>& f : flags) sized = sized && static_cast<int>(f.size()) == gap;
    if (!sized) throw InternalError("ZipCache gaps: layer " + std::to_string(l) + "'s ranking is not one flag a row");
    gap_payload(flags, t0.groups, payloads[static_cast<size_t>(l)]);
    groups.push_back({l, {&s}, &payloads[static_cast<size_t>(l)]});
  }
  const std::vector<StagedZip> made = zip_arrays(ctx, C, groups);
  trace::Scope layout_span("kv.zip_gap.layout");
  for (int l = 0; l < L; ++l) {
    DevLayer& d = C.layers[static_cast<size_t>(l)];
    std::vector<DevSeg> built = build_zip(ctx, C, groups[static_cast<size_t>(l)].segs, payloads[static_cast<size_t>(l)],
                                          &made[static_cast<size_t>(l)]);
    if (built.size() != 1)
      throw InternalError("ZipCache gaps: layer " + std::to_string(l) + "'s gap was not laid out as the kernels read it");
    built[0].payload = nullptr;  // (no host segment mirrors it)
    d.segs.push_back(std::move(built[0]));
    d.tail.start.assign(static_cast<size_t>(NKV), g0 + gap);
  }
  C.changed();
}

}  // namespace kvlens::cuda
