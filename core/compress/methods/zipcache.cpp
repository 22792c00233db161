// `zipcache` (ZipCache): mixed-precision quantization driven by token saliency.
//
// Prefill (Algorithm 2): probe queries are chosen (Sec. 4.3; default 5 % recent + 5 % random),
// their causal attention rows A_probe give each token's saliency, normalized p̃_i = Σ_k A_{k,i} /
// nnz(A_{:,i}) (Eq. 8) or accumulated p_i = Σ_k A_{k,i} (Eq. 7, H2O/MiKV); the top r of the rows
// of each KV head (ties to the earlier row) are salient and get k_h bits, the rest k_l bits.
// Saliency per KV head is the mean over the query heads that share it (per-head, as the
// authors' code ranks), or the mean over all query heads of the layer, one ranking for every
// KV head (shared).
//
// Quantization (Algorithm 2, `ranges=layer`, the default): each layer's salient rows and its
// regular rows are quantized as two wholes, whatever their token kind. Keys: ChannelQuant, one
// [α, β] per KV head and channel over the subset's rows. Values: CSTQuant (Algorithm 1) —
// channels normalised by c_i = sqrt(max|X_i|) (per KV head and channel, fp16; over each subset,
// `channel_scales=subset`, as Algorithm 2 calls CSTQuant per subset, or over the layer's rows
// before the split, `channel_scales=layer`, the authors' channel_separate_mixed_tokenwiseQ),
// then one range per token over the normalised values of every KV head that holds the token in
// that subset (`value_token_range=heads`: X ∈ R^{l×hd}, the paper's hd + 2bl parameters; with
// one ranking per layer that is exactly one range per token), or one range per token and KV head
// (`value_token_range=head`, head_dim values). `ranges=segment` quantizes each segment (system /
// visual / post-vision text) on its own, with its own subsets' ranges (finer than the paper).
//
// Storage of one quantized group (a layer's prompt, or a streaming gap), one payload shared by
// its segments: per KV head the K codes of the salient rows (one channel-wise stream) then of the
// regular rows, with fp16 scale/zero per channel and subset; V codes row by row in the same order
// (packed per row); the fp16 factors c per channel (and subset); a 1-bit salient flag per row in
// segment order; the V token ranges (fp16 scale/zero) per KV head, or once for all heads in
// `tokens` (salient tokens then regular, ascending positions). The payload's bytes are counted on
// the group's first segment; every segment counts its int32 positions.
//
// On a device backend whose cache alone holds the prompt's rows (the host store keeps their
// layout), the saliency and the flags are computed on the host from the probes' column sums, and
// every layer's groups are quantized where the rows are (Backend::zip_quantize_rows, the same
// bytes as on the host) in one call; the cache stores them packed as they were made, and they
// cross to the host only if a host reader asks (QuantPayload::land).
//
// Decode (Algorithm 3, streaming): new tokens stay dense (the cache's row storage); the queries of
// probe tokens are kept (the last round(recent_ratio·gap) of each gap, plus each other token with
// probability random_ratio, seeded). When `gap` new tokens have accumulated (at the step of the
// next one), the probes' attention over the store rows is recomputed (it equals what attention saw:
// older rows did not change since) and those gap tokens are quantized like the prompt, ranked among
// themselves. The authors' code re-compresses the whole cache at that point; kvlens quantizes only
// the new tokens, since the older rows are already dequantized values and quantizing them again
// would add error a real cache (which keeps the codes) would not have. A device decode runs the
// streaming itself from the same data (step_quant: StepQuant::zip): its steps keep the probes'
// queries and their softmax sums (what attention saw), and before the step that follows a gap it
// scores them against the gap's rows, reduces the gap's saliency as here (zipcache::gap_saliency,
// the sums in fp32 from the steps), ranks it as here (rank_gap) and quantizes the gap where its
// rows are, without waiting on the host.
//
// The authors' code also differs in ways kvlens does not model: it normalises the probes' column
// sums by T − i (every query that can see token i) rather than by the probes that see it, draws
// its random probes with replacement, and at a streaming step ranks the gap's tokens by the
// current query's attention alone, unnormalised. With per-head rankings its token-wise value
// ranges span the j-th salient row of every head (rows of different tokens); kvlens groups a
// token's rows across heads by position instead.
#include <algorithm>
#include <array>
#include <cmath>
#include <mutex>
#include <numeric>
#include <optional>

#include "core/errors.h"
#include "core/compress/quant_methods.h"
#include "core/parallel.h"
#include "core/trace.h"

namespace kvlens {

namespace {

using zipcache::Probe;
using zipcache::Saliency;
using zipcache::Flags;

struct ZipOptions {
  int hi = 4, lo = 2;
  double ratio = 0.4;
  Saliency saliency = Saliency::Normalized;
  Probe probe = Probe::RandomRecent;
  double recent = 0.05, random = 0.05;
  uint64_t seed = 0;
  bool shared = false;
  int gap = 100;
  bool segment_ranges = false;         // ranges=segment
  bool head_token_ranges = false;      // value_token_range=head
  bool layer_channel_scales = false;   // channel_scales=layer
};

using zipcache::top_flags;

// What a quantized group's segments are labelled.
std::string group_label(int hi, int lo) { return "zipcache q" + std::to_string(hi) + "/q" + std::to_string(lo); }

class ZipCachePolicy : public KVPolicy {
 public:
  explicit ZipCachePolicy(const ZipOptions& o) : o_(o) {}
  std::string name() const override { return "zipcache"; }
  bool needs_prefill_attention() const override { return true; }
  // On a device the prompt's rows are quantized where they are (Backend::zip_quantize_rows).
  bool reads_rows() const override { return false; }

  // Layers are independent (each its own probes, ranges and payload): their saliency reductions
  // prepared together, then quantized on threads of their own (the same result as in turn) or,
  // where the rows are in a device cache alone, there (every layer before one wait).
  void on_prefill(const std::vector<PrefillContext>& layers, KVStore& store) override {
    if (layers.empty()) return;
    prepare(layers);
    std::vector<Job> jobs;
    for (const PrefillContext& c : layers) jobs.push_back({&c, &store.layer(c.layer)});
    if (on_device(jobs)) {
      quantize_on_device(jobs);
      return;
    }
    parallel_for(static_cast<int>(jobs.size()), 8, [&](int i) {
      quantize_on_host(*jobs[static_cast<size_t>(i)].ctx, *jobs[static_cast<size_t>(i)].layer);
    });
  }

  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override {
    const std::vector<Job> jobs{{&ctx, &layer}};
    if (on_device(jobs))
      quantize_on_device(jobs);
    else
      quantize_on_host(ctx, layer);
  }

  // Before the first gap completes the streaming changes nothing (the probes it keeps are only
  // read then): a decode of at most `gap` new tokens runs as one that acts at prefill alone.
  bool acts_on_decode_within(int new_tokens) const override { return new_tokens > o_.gap; }
  // The streaming as data (StepQuant::zip): a device keeps the probes' queries and quantizes
  // each gap in its own steps.
  StepQuant step_quant(int) const override {
    StepQuant q;
    q.k_bits = o_.hi;
    q.v_bits = o_.lo;
    q.label = group_label(o_.hi, o_.lo);
    q.zip.gap = o_.gap;
    q.zip.accumulated = o_.saliency == Saliency::Accumulated;
    q.zip.head_token_ranges = o_.head_token_ranges;
    q.zip.layer_factors = o_.layer_channel_scales;
    const ZipOptions o = o_;
    q.zip.probes = [o](int layer, int rows) {
      zipcache::ProbeStream s(o.seed, layer, o.gap, o.recent, o.random);
      std::vector<int32_t> slot(static_cast<size_t>(std::max(rows, 0)), -1);
      int n = 0;
      for (int r = 0; r < rows; ++r) {
        if (r % o.gap == 0) n = 0;
        if (s.next(r % o.gap)) slot[static_cast<size_t>(r)] = n++;
      }
      return slot;
    };
    q.zip.ratio = o_.ratio;
    q.zip.shared_ranking = o_.shared;
    return q;
  }

  void on_decode_step(const DecodeContext& ctx, LayerKV& layer) override {
    if (layer.segments.empty() || !layer.segments.back().dense()) return;
    if (ctx.layer >= static_cast<int>(streams_.size())) streams_.resize(ctx.layer + 1);
    Stream& st = streams_[ctx.layer];
    if (!st.probes) st.probes.emplace(o_.seed, ctx.layer, o_.gap, o_.recent, o_.random);
    const int D = ctx.head_dim;
    int n = layer.segments.back().heads.at(0).n();
    if (n - 1 >= o_.gap) {  // `gap` tokens before the new one: compress them
      const size_t i = layer.segments.size() - 1;
      quant::split_segment(layer, i, std::vector<int>(layer.segments[i].heads.size(), o_.gap), D);
      compress_gap(ctx, layer, i, st);
      st.pos.clear();
      st.q.clear();
      n = layer.segments.back().heads.at(0).n();
    }
    if (st.probes->next(n - 1)) {  // (n − 1: the new token's index within the current gap)
      st.pos.push_back(ctx.position);
      st.q.insert(st.q.end(), ctx.q, ctx.q + static_cast<size_t>(ctx.n_heads) * D);
    }
  }

 private:
  struct Job {
    const PrefillContext* ctx;
    LayerKV* layer;
  };

  std::vector<int> probes(const PrefillContext& ctx) const {
    return zipcache::select_probes(o_.probe, ctx.prompt_len, ctx.token_kinds, ctx.token_ids, o_.recent, o_.random,
                                   o_.seed);
  }
  // Every layer's column sums over the probes in one pass where the capture can (the probes do
  // not depend on the layer).
  void prepare(const std::vector<PrefillContext>& layers) const {
    const PrefillContext& c = layers.front();
    if (!c.attention) return;
    std::vector<int> ls;
    for (const PrefillContext& x : layers) ls.push_back(x.layer);
    c.attention->prepare(ls, probes(c));
  }

  // The layer's salient flags (Algorithm 2's Split): each token's saliency from the probes'
  // column sums, per KV head (or shared), and the top r of every dense row of each KV head over
  // all segments. `dense` gets the dense segments' indices. Starts a new prompt's stream. `pr` and
  // `sums`: the probes and the layer's column sums over them when the caller has them already
  // (then nothing here asks the capture).
  Flags layer_flags(const PrefillContext& ctx, const LayerKV& layer, std::vector<size_t>& dense,
                    const std::vector<int>* given_probes = nullptr,
                    std::shared_ptr<const std::vector<double>> sums = nullptr) {
    const int T = ctx.prompt_len, H = ctx.n_heads, KH = ctx.n_kv_heads;
    if (!ctx.attention)
      throw InputError("zipcache: layer " + std::to_string(ctx.layer) + " has no prefill attention probabilities");
    if (KH <= 0 || H % KH != 0)
      throw InputError("zipcache: n_heads " + std::to_string(H) + " is not a multiple of n_kv_heads " + std::to_string(KH));
    if (ctx.layer < static_cast<int>(streams_.size())) streams_[ctx.layer] = Stream{};  // new prompt
    const std::vector<int> own = given_probes ? std::vector<int>{} : probes(ctx);
    const std::vector<int>& pr = given_probes ? *given_probes : own;
    // Each query head's column sums over the probes, reduced where the attention is.
    if (!sums) sums = ctx.attention->column_sums(ctx.layer, pr);
    std::vector<std::vector<double>> score(KH, std::vector<double>(T, 0.0));
    for (int h = 0; h < H; ++h) {
      const std::vector<double> s = zipcache::saliency_from_sums(sums->data() + static_cast<size_t>(h) * T, T, pr, o_.saliency);
      for (int kh = 0; kh < KH; ++kh) {
        if (!o_.shared && kh != h / (H / KH)) continue;
        const double w = o_.shared ? 1.0 / H : 1.0 / (H / KH);
        for (int i = 0; i < T; ++i) score[kh][i] += w * s[i];
      }
    }
    Flags flags(layer.segments.size(), std::vector<std::vector<char>>(KH));
    dense = dense_segments(layer);
    for (int kh = 0; kh < KH; ++kh) {
      std::vector<double> rs;
      for (size_t i : dense)
        for (int32_t p : layer.segments[i].heads.at(kh).pos) rs.push_back(p >= 0 && p < T ? score[kh][p] : 0.0);
      const std::vector<char> f = top_flags(rs, o_.ratio);
      size_t at = 0;
      for (size_t i : dense) {
        const int n = layer.segments[i].heads[kh].n();
        flags[i][kh].assign(f.begin() + static_cast<std::ptrdiff_t>(at), f.begin() + static_cast<std::ptrdiff_t>(at + n));
        at += n;
      }
    }
    return flags;
  }
  // The indices of the layer's dense segments.
  static std::vector<size_t> dense_segments(const LayerKV& layer) {
    std::vector<size_t> dense;
    for (size_t i = 0; i < layer.segments.size(); ++i)
      if (layer.segments[i].dense()) dense.push_back(i);
    return dense;
  }
  // The quantization groups of the dense segments: all of them (ranges=layer) or each alone.
  std::vector<std::vector<size_t>> groups(const std::vector<size_t>& dense) const {
    if (dense.empty()) return {};
    if (!o_.segment_ranges) return {dense};
    std::vector<std::vector<size_t>> g;
    for (size_t i : dense) g.push_back({i});
    return g;
  }
  zipcache::GroupSpec spec() const { return {o_.hi, o_.lo, o_.head_token_ranges, o_.layer_channel_scales}; }

  void quantize_on_host(const PrefillContext& ctx, LayerKV& layer) {
    std::vector<size_t> dense;
    const Flags flags = layer_flags(ctx, layer, dense);
    for (const std::vector<size_t>& g : groups(dense)) quantize_group(layer, g, flags, ctx.head_dim);
  }

  // Whether the layers' dense rows are in the device cache alone (their host segments hold the
  // layout): then they are quantized there, on a backend that can.
  static bool on_device(const std::vector<Job>& jobs) {
    bool any = false;
    for (const Job& j : jobs)
      for (const KVSegment& s : j.layer->segments) any = any || (s.dense() && s.layout_only);
    if (!any) return false;
    const PrefillContext& c = *jobs.front().ctx;
    if (!c.backend || !c.device || !c.backend->queues_reductions())
      throw InternalError("zipcache: layer " + std::to_string(c.layer) +
                          "'s rows are in the device cache alone, and its backend cannot quantize them there");
    return true;
  }

  // Every group's quantization in one call (Backend::zip_quantize_rows) that makes each layer's
  // flags where it plans the layer's groups, on its threads, and queues each group as soon as it
  // is planned; each group's payload installed with its arrays deferred. The column sums are
  // taken here first, so that the flags read nothing of the capture.
  void quantize_on_device(const std::vector<Job>& jobs) {
    struct Group {
      LayerKV* layer;
      std::vector<size_t> segs;
      std::shared_ptr<quant::QuantPayload> p;
    };
    struct Layer {
      std::vector<Group> groups;
      std::shared_ptr<const std::vector<double>> sums;
      std::once_flag marked;
    };
    std::vector<Layer> per_layer(jobs.size());
    const std::vector<int> pr = probes(*jobs.front().ctx);  // (the probes do not depend on the layer)
    for (size_t i = 0; i < jobs.size(); ++i) {
      const Job& j = jobs[i];
      Layer& l = per_layer[i];
      std::vector<size_t> dense = dense_segments(*j.layer);
      for (const std::vector<size_t>& g : groups(dense))
        l.groups.push_back({j.layer, g, std::make_shared<quant::QuantPayload>(j.ctx->n_kv_heads)});
      if (j.ctx->attention) l.sums = j.ctx->attention->column_sums(j.ctx->layer, pr);
      if (l.groups.empty()) layer_flags(*j.ctx, *j.layer, dense, &pr, l.sums);  // (checks, a new stream)
    }
    // A layer's flags and its groups' layouts, once, by whichever of its groups is planned first.
    auto mark = [&](size_t i) {
      trace::Scope span("zipcache.layer_flags");
      const Job& j = jobs[i];
      std::vector<size_t> dense;
      const Flags flags = layer_flags(*j.ctx, *j.layer, dense, &pr, per_layer[i].sums);
      for (Group& g : per_layer[i].groups) zipcache::mark_group(*j.layer, g.segs, flags, spec(), *g.p);
    };
    Backend& be = *jobs.front().ctx->backend;
    DeviceKV* device = jobs.front().ctx->device;
    std::vector<ZipRowsGroup> all;
    // (queued: once the call took them; installed also when the wait fails)
    std::vector<const Group*> groups, queued;
    for (size_t i = 0; i < jobs.size(); ++i)
      for (const Group& g : per_layer[i].groups) {
        const PrefillContext& c = *jobs[i].ctx;
        if (c.backend != &be || c.device != device)
          throw InternalError("zipcache: layers of one prefill on different backends or caches");
        ZipRowsGroup z;
        z.layer = c.layer;
        for (size_t x : g.segs) z.segs.push_back(&g.layer->segments[x]);
        z.out = g.p.get();
        z.prepare = [&per_layer, &mark, i] { std::call_once(per_layer[i].marked, mark, i); };
        all.push_back(std::move(z));
        groups.push_back(&g);
      }
    be.queue_then_keep(
        [&] {
          if (!all.empty() && !be.zip_quantize_rows(*device, all))
            throw InternalError("zipcache: the " + be.name() + " backend cannot quantize layer " +
                                std::to_string(all.front().layer) + "'s rows where they are");
          queued = groups;
        },
        [&] {
          for (const Group* g : queued) zipcache::install_group(*g->layer, g->segs, spec(), g->p);
        });
  }

  struct Stream {
    std::optional<zipcache::ProbeStream> probes;
    std::vector<int32_t> pos;  // probe positions
    std::vector<float> q;      // probe queries [n_probes][n_heads][head_dim]
  };

  // Saliency of the rows of segment `gi` from the kept probe queries (each saw the rows of the
  // segments before it and the gap's rows up to its own), then mixed quantization.
  void compress_gap(const DecodeContext& ctx, LayerKV& layer, size_t gi, const Stream& st) const {
    const int H = ctx.n_heads, KH = ctx.n_kv_heads, D = ctx.head_dim, group = H / KH;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    KVSegment& g = layer.segments[gi];
    Flags flags(layer.segments.size(), std::vector<std::vector<char>>(KH));
    std::vector<double> sal;  // [KV head][gap row]
    const int n_probes = static_cast<int>(st.pos.size());
    for (int kh = 0; kh < KH; ++kh) {
      // This head's rows older than the gap, then the gap's.
      std::vector<const float*> rows;
      for (size_t i = 0; i <= gi; ++i) {
        const HeadRows& r = layer.segments[i].heads[kh];
        for (int j = 0; j < r.n(); ++j) rows.push_back(r.k.data() + static_cast<size_t>(j) * D);
      }
      const HeadRows& gr = g.heads[kh];
      const int ng = gr.n(), before = static_cast<int>(rows.size()) - ng;
      std::vector<int> seen(static_cast<size_t>(n_probes));
      for (int k = 0; k < n_probes; ++k)
        seen[k] = static_cast<int>(std::upper_bound(gr.pos.begin(), gr.pos.end(), st.pos[k]) - gr.pos.begin());
      // scores[k][h][r] of the group's query heads
      const int64_t stride = static_cast<int64_t>(rows.size()), probe_stride = group * stride;
      std::vector<float> scores(static_cast<size_t>(n_probes * probe_stride));
      for (int k = 0; k < n_probes; ++k)
        for (int h = 0; h < group; ++h) {
          const float* q = st.q.data() + (static_cast<size_t>(k) * H + kh * group + h) * D;
          float* o = scores.data() + k * probe_stride + h * stride;
          for (int r = 0; r < before + seen[k]; ++r) {
            float s = 0;
            for (int c = 0; c < D; ++c) s += q[c] * rows[r][c];
            o[r] = s * scale;
          }
        }
      const std::vector<double> s = zipcache::gap_saliency(scores.data(), probe_stride, stride, n_probes, group, before,
                                                           seen.data(), ng, o_.saliency);
      sal.insert(sal.end(), s.begin(), s.end());
    }
    flags[gi] = zipcache::rank_gap(sal.data(), KH, g.heads.at(0).n(), o_.ratio, o_.shared);
    quantize_group(layer, {gi}, flags, D);
  }

  // The group's salient flags and bits, its quantization on the host rows, its payload.
  void quantize_group(LayerKV& layer, const std::vector<size_t>& group, const Flags& flags, int D) const {
    auto p = std::make_shared<quant::QuantPayload>(static_cast<int>(layer.segments.at(group.front()).heads.size()));
    zipcache::mark_group(layer, group, flags, spec(), *p);
    zipcache::quantize_group(layer, group, flags, D, spec(), *p);
    zipcache::install_group(layer, group, spec(), p);
  }

  ZipOptions o_;
  std::vector<Stream> streams_;
};

Probe parse_probe(const std::string& s) {
  if (s == "all") return Probe::All;
  if (s == "random") return Probe::Random;
  if (s == "special") return Probe::Special;
  if (s == "recent") return Probe::Recent;
  return Probe::RandomRecent;
}

}  // namespace

namespace zipcache {

namespace {
// One row of a group: segment index and row within the segment's head.
struct Row {
  size_t seg;
  int i;
};
}  // namespace

void mark_group(LayerKV& layer, const std::vector<size_t>& group, const Flags& flags, const GroupSpec& o,
                quant::QuantPayload& p) {
  const int KH = static_cast<int>(layer.segments.at(group.front()).heads.size());
  for (int h = 0; h < KH; ++h) {
    std::vector<uint32_t> f;
    for (size_t g : group) {
      HeadRows& r = layer.segments[g].heads[h];
      r.bits.resize(static_cast<size_t>(r.n()));
      for (int i = 0; i < r.n(); ++i) {
        const bool sal = flags.at(g).at(h).at(i) != 0;
        f.push_back(sal ? 1u : 0u);
        r.bits[static_cast<size_t>(i)] = static_cast<uint8_t>(sal ? o.hi : o.lo);
      }
    }
    p.k[h].flags.clear();
    quant::pack(f.data(), static_cast<int64_t>(f.size()), 1, p.k[h].flags);
  }
  p.layout.kind = quant::CodeLayout::Kind::ZipMixed;
  p.layout.hi_bits = o.hi;
  p.layout.lo_bits = o.lo;
  p.layout.layer_factors = o.layer_factors;
  p.layout.shared_token_ranges = !o.head_token_ranges;
}

void quantize_group(LayerKV& layer, const std::vector<size_t>& group, const Flags& flags, int D, const GroupSpec& o,
                    quant::QuantPayload& p) {
  const int KH = static_cast<int>(layer.segments.at(group.front()).heads.size());
  auto hr = [&](int h, const Row& r) -> HeadRows& { return layer.segments[r.seg].heads[h]; };
  // rows[h][s]: the rows of head h in subset s (1 salient, 0 regular), in group order.
  std::vector<std::array<std::vector<Row>, 2>> rows(KH);
  for (int h = 0; h < KH; ++h)
    for (size_t g : group)
      for (int i = 0; i < layer.segments[g].heads[h].n(); ++i)
        rows[h][flags.at(g).at(h).at(i) ? 1 : 0].push_back({g, i});
  const int bits[2] = {o.lo, o.hi};
  // Keys: one channel-wise block per head and subset.
  for (int h = 0; h < KH; ++h)
    for (int s = 1; s >= 0; --s) {
      const std::vector<Row>& R = rows[h][s];
      std::vector<float> k(R.size() * D);
      for (size_t t = 0; t < R.size(); ++t) std::copy_n(hr(h, R[t]).k.data() + static_cast<size_t>(R[t].i) * D, D, &k[t * D]);
      quant::quantize_block(k.data(), static_cast<int>(R.size()), D, {bits[s], quant::Axis::PerChannel}, p.k[h]);
      for (size_t t = 0; t < R.size(); ++t) std::copy_n(&k[t * D], D, hr(h, R[t]).k.data() + static_cast<size_t>(R[t].i) * D);
    }
  // Values: channel factors c[h][s][j] = sqrt(max |v_j|) over the subset (or the layer), fp16.
  std::vector<std::array<std::vector<float>, 2>> c(KH);
  for (int h = 0; h < KH; ++h) {
    auto factors = [&](std::initializer_list<int> subsets) {
      std::vector<float> v;
      for (int s : subsets)
        for (const Row& r : rows[h][s])
          v.insert(v.end(), hr(h, r).v.data() + static_cast<size_t>(r.i) * D, hr(h, r).v.data() + static_cast<size_t>(r.i + 1) * D);
      const std::vector<float> m = zipcache::channel_factors(v.data(), static_cast<int>(v.size() / D), D);
      for (float x : m) p.v[h].meta.push_back(quant::to_half(x));
      return m;
    };
    if (o.layer_factors) {
      if (rows[h][0].empty() && rows[h][1].empty()) continue;
      c[h][0] = c[h][1] = factors({0, 1});
    } else {
      for (int s = 1; s >= 0; --s)
        if (!rows[h][s].empty()) c[h][s] = factors({s});
    }
  }
  // The normalised row y = v / c of row r in head h, subset s.
  auto normalised = [&](int h, int s, const Row& r) {
    std::vector<float> y(D);
    const float* v = hr(h, r).v.data() + static_cast<size_t>(r.i) * D;
    for (int j = 0; j < D; ++j) y[j] = v[j] / c[h][s][j];
    return y;
  };
  // Token ranges: per KV head (each row its own range), or one per slot (quant::zip_slots: a
  // subset's position) over the rows of every head that holds the token in that subset.
  quant::ZipSlots slots;
  std::vector<quant::Affine> shared;
  if (!o.head_token_ranges) {
    std::vector<std::array<std::vector<int32_t>, 2>> pos(KH);
    for (int h = 0; h < KH; ++h)
      for (int s = 0; s < 2; ++s)
        for (const Row& r : rows[h][s]) pos[h][s].push_back(hr(h, r).pos[r.i]);
    slots = quant::zip_slots(pos);
    std::vector<float> lo(static_cast<size_t>(slots.n), INFINITY), hi(static_cast<size_t>(slots.n), -INFINITY);
    for (int h = 0; h < KH; ++h)
      for (int s = 0; s < 2; ++s)
        for (const Row& r : rows[h][s]) {
          const size_t k = static_cast<size_t>(slots.of(s, hr(h, r).pos[r.i]));
          for (float x : normalised(h, s, r)) lo[k] = std::min(lo[k], x), hi[k] = std::max(hi[k], x);
        }
    for (int64_t k = 0; k < slots.n; ++k) {
      shared.push_back(quant::make_affine(lo[static_cast<size_t>(k)], hi[static_cast<size_t>(k)], bits[k < slots.salient ? 1 : 0]));
      p.tokens.scales.push_back(quant::to_half(shared.back().scale));
      p.tokens.zeros.push_back(quant::to_half(shared.back().alpha));
    }
  }
  for (int h = 0; h < KH; ++h)
    for (int s = 1; s >= 0; --s) {
      const std::vector<Row>& R = rows[h][s];
      if (o.head_token_ranges) {  // Algorithm 1 on this head's rows of the subset
        if (R.empty()) continue;
        std::vector<float> v(R.size() * D);
        for (size_t t = 0; t < R.size(); ++t) std::copy_n(hr(h, R[t]).v.data() + static_cast<size_t>(R[t].i) * D, D, &v[t * D]);
        zipcache::cst_quantize(v.data(), static_cast<int>(R.size()), D, bits[s], p.v[h], c[h][s].data());
        for (size_t t = 0; t < R.size(); ++t) std::copy_n(&v[t * D], D, hr(h, R[t]).v.data() + static_cast<size_t>(R[t].i) * D);
        continue;
      }
      std::vector<uint32_t> codes(D);
      for (const Row& r : R) {
        const std::vector<float> y = normalised(h, s, r);
        const quant::Affine& a = shared[static_cast<size_t>(slots.of(s, hr(h, r).pos[r.i]))];
        float* v = hr(h, r).v.data() + static_cast<size_t>(r.i) * D;
        for (int j = 0; j < D; ++j) {
          codes[j] = quant::encode(y[j], a, bits[s]);
          v[j] = quant::decode(codes[j], a) * c[h][s][j];
        }
        quant::pack(codes.data(), D, bits[s], p.v[h].codes);
      }
    }
}

void install_group(LayerKV& layer, const std::vector<size_t>& group, const GroupSpec& o,
                   const std::shared_ptr<quant::QuantPayload>& p) {
  p->shrink_to_fit();
  const std::string label = group_label(o.hi, o.lo);
  for (size_t gi = 0; gi < group.size(); ++gi) {
    KVSegment& s = layer.segments[group[gi]];
    for (HeadRows& h : s.heads) quant::pad_annotations(h, 0);
    s.storage = label;
    s.payload = p;
    s.bytes = gi == 0 ? p->allocated() : KVBytes{};
    for (const HeadRows& h : s.heads) s.bytes.indices += 4LL * h.n();
  }
}

}  // namespace zipcache

MethodSpec zipcache_method() {
  MethodSpec m;
  m.name = "zipcache";
  m.family = "quantization";
  m.summary = "ZipCache: salient tokens (normalized attention of probe queries) at k_h bits, the rest at k_l";
  m.params = {
      param::choice("high_bits", {"2", "3", "4", "8"}, "4", "k_h: bits of salient tokens (Algorithm 2)"),
      param::choice("low_bits", {"1", "2", "3", "4"}, "2", "k_l: bits of the other tokens (Algorithm 2)"),
      param::real("saliency_ratio", 0, 1, "0.4", "r: share of each KV head's tokens that are salient (top r by saliency, Algorithm 2 Split)"),
      param::choice("saliency", {"normalized", "accumulated"}, "normalized",
                    "normalized p̃_i = Σ_k A_ki / nnz(A_:i) (Eq. 8) or accumulated p_i = Σ_k A_ki (Eq. 7, H2O/MiKV), k over probes"),
      param::choice("probe", {"all", "random", "special", "recent", "random+recent"}, "random+recent",
                    "probe queries whose attention rows A_probe = softmax(Q_probe Kᵀ/√d) measure saliency (Eq. 9, Table 2)"),
      param::real("recent_ratio", 0, 1, "0.05", "recent probes: the last round(ratio·T) tokens (≥ 1); decode: last ratio·gap of each gap (Alg. 3)"),
      param::real("random_ratio", 0, 1, "0.05", "random probes: round(ratio·T) tokens (≥ 1), seeded; decode: each token with this probability (Alg. 3)"),
      param::integer("seed", 0, 2147483647, "0", "seed of the random probes (Sec. 4.3 draws them at random)"),
      param::choice("saliency_heads", {"per-head", "shared"}, "per-head",
                    "saliency per KV head (mean over its query heads; the authors' code) or one per layer (mean over all heads)"),
      param::integer("gap", 1, 1000000, "100", "streaming: quantize decode tokens every `gap` new tokens (Algorithm 3: 100)"),
      param::choice("ranges", {"layer", "segment"}, "layer",
                    "layer: the layer's salient and regular subsets quantized as wholes (Algorithm 2); segment: "
                    "each token kind (system/visual/text) with its own subsets' ranges (finer than the paper)"),
      param::choice("value_token_range", {"heads", "head"}, "heads",
                    "CSTQuant token range: heads = one [α, β] per token over every KV head's normalised values "
                    "(Alg. 1 on X ∈ R^{l×hd}, hd + 2bl parameters; authors' code); head = one per token and KV head"),
      param::choice("channel_scales", {"subset", "layer"}, "subset",
                    "CSTQuant c_i = sqrt(max|X_i|) (Eq. 6) over each subset (Algorithm 2 calls CSTQuant per subset) "
                    "or over the layer before the split (authors' channel_separate_mixed_tokenwiseQ)"),
  };
  m.presets = {
      {"paper", {{"ranges", "layer"}, {"value_token_range", "heads"}, {"channel_scales", "subset"}}},
      {"official", {{"ranges", "layer"}, {"value_token_range", "heads"}, {"channel_scales", "layer"}}},
  };
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    ZipOptions o;
    o.hi = p.integer("high_bits");
    o.lo = p.integer("low_bits");
    if (o.hi < o.lo)
      throw InputError("zipcache: high_bits (" + std::to_string(o.hi) + ") must be >= low_bits (" +
                       std::to_string(o.lo) + ")");
    o.ratio = p.num("saliency_ratio");
    o.saliency = p.str("saliency") == "accumulated" ? Saliency::Accumulated : Saliency::Normalized;
    o.probe = parse_probe(p.str("probe"));
    o.recent = p.num("recent_ratio");
    o.random = p.num("random_ratio");
    o.seed = static_cast<uint64_t>(p.integer("seed"));
    o.shared = p.str("saliency_heads") == "shared";
    o.gap = p.integer("gap");
    o.segment_ranges = p.str("ranges") == "segment";
    o.head_token_ranges = p.str("value_token_range") == "head";
    o.layer_channel_scales = p.str("channel_scales") == "layer";
    return std::make_unique<ZipCachePolicy>(o);
  };
  return m;
}

}  // namespace kvlens
