// `zipcache` (ZipCache): mixed-precision quantization driven by token saliency.
//
// Prefill (Algorithm 2): probe queries are chosen (Sec. 4.3; default 5 % recent + 5 % random),
// their causal attention rows A_probe give each token's saliency, normalized p̃_i = Σ_k A_{k,i} /
// nnz(A_{:,i}) (Eq. 8) or accumulated p_i = Σ_k A_{k,i} (Eq. 7, H2O/MiKV); the top r of the rows
// of each KV head (ties to the earlier row) are salient and get k_h bits, the rest k_l bits. Keys
// are quantized channel-wise, values with channel-separable token-wise quantization (CSTQuant,
// Algorithm 1), each subset (salient / regular) with its own ranges.
// Saliency per KV head is the mean over the query heads that share it (per-head), or the mean
// over all query heads of the layer, one ranking for every KV head (shared).
//
// Decode (Algorithm 3, streaming): new tokens stay fp32; the queries of probe tokens are kept
// (the last round(recent_ratio·gap) of each gap, plus each other token with probability
// random_ratio, seeded). When `gap` new tokens have accumulated (at the step of the next one),
// the probes' attention over the store rows is recomputed (it equals what attention saw: older
// rows did not change since) and those gap tokens are quantized like the prompt, ranked among
// themselves. The authors' code re-compresses the whole cache at that point; kvlens quantizes
// only the new tokens, since the older rows are already dequantized values and quantizing them
// again would add error a real cache (which keeps the codes) would not have.
//
// Ranges are per segment and KV head (segments have one token kind), finer than the paper's
// per-layer ranges; their bytes are counted. Storage per head: K codes of the salient rows
// (one channel-wise stream) then of the regular rows, V codes row by row in the same order, a
// 1-bit salient flag per row.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/errors.h"
#include "core/policies/quant_methods.h"

namespace kvlens {

namespace zipcache {

std::vector<double> saliency(const float* A, int T, const std::vector<int>& probes, Saliency s) {
  std::vector<double> sum(T, 0.0), cnt(T, 0.0);
  for (int k : probes)
    for (int i = 0; i <= k && i < T; ++i) {
      sum[i] += A[static_cast<int64_t>(k) * T + i];
      cnt[i] += 1;
    }
  if (s == Saliency::Normalized)
    for (int i = 0; i < T; ++i) sum[i] = cnt[i] > 0 ? sum[i] / cnt[i] : 0.0;
  return sum;
}

namespace {
// Fisher–Yates with mt19937_64 (specified by the standard), so draws match on every platform.
std::vector<int> sample(std::vector<int> pool, int k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  k = std::min<int>(k, static_cast<int>(pool.size()));
  for (int i = 0; i < k; ++i) {
    const int j = i + static_cast<int>(rng() % static_cast<uint64_t>(pool.size() - i));
    std::swap(pool[i], pool[j]);
  }
  pool.resize(k);
  return pool;
}
int at_least_one(double ratio, int T) {
  return std::clamp(static_cast<int>(std::llround(ratio * T)), 1, T);
}
}  // namespace

std::vector<int> select_probes(Probe strategy, int T, const std::vector<SegmentKind>* kinds,
                               const std::vector<int>* ids, double recent_ratio,
                               double random_ratio, uint64_t seed) {
  std::vector<int> out;
  if (T <= 0) return out;
  const int n_recent = at_least_one(recent_ratio, T);
  std::vector<int> all(T);
  std::iota(all.begin(), all.end(), 0);
  switch (strategy) {
    case Probe::All: out = all; break;
    case Probe::Recent:
      for (int i = T - n_recent; i < T; ++i) out.push_back(i);
      break;
    case Probe::Random: out = sample(all, at_least_one(random_ratio, T), seed); break;
    case Probe::RandomRecent: {
      std::vector<int> rest(all.begin(), all.end() - n_recent);
      out = sample(rest, at_least_one(random_ratio, T), seed);
      for (int i = T - n_recent; i < T; ++i) out.push_back(i);
      break;
    }
    case Probe::Special: {
      out.push_back(0);
      out.push_back(T - 1);
      if (ids)
        for (int i = 0; i < T && i < static_cast<int>(ids->size()); ++i)
          if ((*ids)[i] >= 0 && (*ids)[i] <= 2) out.push_back(i);
      if (kinds)
        for (int i = 0; i < T && i < static_cast<int>(kinds->size()); ++i) {
          const bool vis = (*kinds)[i] == SegmentKind::Visual;
          const bool prev = i > 0 && (*kinds)[i - 1] == SegmentKind::Visual;
          if (vis && !prev && i > 0) out.push_back(i - 1);  // just before a visual run
          if (!vis && prev) out.push_back(i);               // just after it
        }
      break;
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void cst_quantize(float* x, int n, int d, int bits, quant::QuantBlock& out) {
  if (n <= 0 || d <= 0) return;
  std::vector<float> c(d, 0.0f);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) c[j] = std::max(c[j], std::fabs(x[static_cast<int64_t>(i) * d + j]));
  for (int j = 0; j < d; ++j) {
    c[j] = quant::round_half(std::sqrt(c[j]));
    if (!(c[j] > 0) || !std::isfinite(c[j])) c[j] = 1.0f;
  }
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) x[static_cast<int64_t>(i) * d + j] /= c[j];
  quant::quantize_block(x, n, d, {bits, quant::Axis::PerToken}, out);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) x[static_cast<int64_t>(i) * d + j] *= c[j];
  for (int j = 0; j < d; ++j) out.meta.push_back(quant::to_half(c[j]));
}

}  // namespace zipcache

namespace {

using zipcache::Probe;
using zipcache::Saliency;

struct ZipOptions {
  int hi = 4, lo = 2;
  double ratio = 0.4;
  Saliency saliency = Saliency::Normalized;
  Probe probe = Probe::RandomRecent;
  double recent = 0.05, random = 0.05;
  uint64_t seed = 0;
  bool shared = false;
  int gap = 100;
};

// Salient flags of n rows: the top round(ratio·n) scores, ties to the earlier row.
std::vector<char> top_flags(const std::vector<double>& score, double ratio) {
  const int n = static_cast<int>(score.size());
  const int k = std::clamp(static_cast<int>(std::llround(ratio * n)), 0, n);
  std::vector<int> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return score[a] > score[b]; });
  std::vector<char> f(n, 0);
  for (int i = 0; i < k; ++i) f[idx[i]] = 1;
  return f;
}

class ZipCachePolicy : public KVPolicy {
 public:
  explicit ZipCachePolicy(const ZipOptions& o) : o_(o) {}
  std::string name() const override { return "zipcache"; }
  bool needs_prefill_attention() const override { return true; }

  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override {
    const int T = ctx.prompt_len, H = ctx.n_heads, KH = ctx.n_kv_heads, D = ctx.head_dim;
    if (!ctx.probs)
      throw InputError("zipcache: layer " + std::to_string(ctx.layer) + " has no prefill attention probabilities");
    if (KH <= 0 || H % KH != 0)
      throw InputError("zipcache: n_heads " + std::to_string(H) + " is not a multiple of n_kv_heads " + std::to_string(KH));
    if (ctx.layer < static_cast<int>(streams_.size())) streams_[ctx.layer] = Stream{};  // new prompt
    const std::vector<int> probes = zipcache::select_probes(o_.probe, T, ctx.token_kinds, ctx.token_ids,
                                                            o_.recent, o_.random, o_.seed);
    std::vector<std::vector<double>> score(KH, std::vector<double>(T, 0.0));
    for (int h = 0; h < H; ++h) {
      const std::vector<double> s = zipcache::saliency(ctx.probs + static_cast<int64_t>(h) * T * T, T, probes, o_.saliency);
      for (int kh = 0; kh < KH; ++kh) {
        if (!o_.shared && kh != h / (H / KH)) continue;
        const double w = o_.shared ? 1.0 / H : 1.0 / (H / KH);
        for (int i = 0; i < T; ++i) score[kh][i] += w * s[i];
      }
    }
    // Rank every fp32 row of each KV head over all segments, by the saliency of its token.
    std::vector<std::vector<std::vector<char>>> flags(layer.segments.size(),
                                                      std::vector<std::vector<char>>(KH));
    for (int kh = 0; kh < KH; ++kh) {
      std::vector<double> rs;
      for (const KVSegment& s : layer.segments) {
        if (!s.dense()) continue;
        for (int32_t p : s.heads.at(kh).pos) rs.push_back(p >= 0 && p < T ? score[kh][p] : 0.0);
      }
      const std::vector<char> f = top_flags(rs, o_.ratio);
      size_t at = 0;
      for (size_t i = 0; i < layer.segments.size(); ++i) {
        if (!layer.segments[i].dense()) continue;
        const int n = layer.segments[i].heads[kh].n();
        flags[i][kh].assign(f.begin() + static_cast<std::ptrdiff_t>(at), f.begin() + static_cast<std::ptrdiff_t>(at + n));
        at += n;
      }
    }
    for (size_t i = 0; i < layer.segments.size(); ++i)
      if (layer.segments[i].dense()) quantize_mixed(layer.segments[i], flags[i], D);
  }

  void on_decode_step(const DecodeContext& ctx, LayerKV& layer) override {
    if (layer.segments.empty() || !layer.segments.back().dense()) return;
    if (ctx.layer >= static_cast<int>(streams_.size())) streams_.resize(ctx.layer + 1);
    Stream& st = streams_[ctx.layer];
    if (!st.started) {
      st.rng.seed(o_.seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(ctx.layer + 1));
      st.started = true;
    }
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
    const int idx = n - 1;  // the new token's index within the current gap
    const int n_recent = static_cast<int>(std::llround(o_.recent * o_.gap));
    const double u = std::uniform_real_distribution<double>(0.0, 1.0)(st.rng);
    if (idx >= o_.gap - n_recent || u < o_.random) {
      st.pos.push_back(ctx.position);
      st.q.insert(st.q.end(), ctx.q, ctx.q + static_cast<size_t>(ctx.n_heads) * D);
    }
  }

 private:
  struct Stream {
    bool started = false;
    std::mt19937_64 rng;
    std::vector<int32_t> pos;  // probe positions
    std::vector<float> q;      // probe queries [n_probes][n_heads][head_dim]
  };

  // Saliency of the rows of segment `gi` from the kept probe queries, then mixed quantization.
  void compress_gap(const DecodeContext& ctx, LayerKV& layer, size_t gi, const Stream& st) const {
    const int H = ctx.n_heads, KH = ctx.n_kv_heads, D = ctx.head_dim, group = H / KH;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    KVSegment& g = layer.segments[gi];
    std::vector<std::vector<char>> flags(KH);
    std::vector<double> shared_sum;
    const int n_probes = static_cast<int>(st.pos.size());
    for (int kh = 0; kh < KH; ++kh) {
      // Rows of this head over all segments, and where the gap rows start among them.
      std::vector<const float*> rows;
      std::vector<int32_t> pos;
      size_t off = 0;
      for (size_t i = 0; i < layer.segments.size(); ++i) {
        if (i == gi) off = rows.size();
        const HeadRows& r = layer.segments[i].heads[kh];
        for (int j = 0; j < r.n(); ++j) {
          rows.push_back(r.k.data() + static_cast<size_t>(j) * D);
          pos.push_back(r.pos[j]);
        }
      }
      const int ng = g.heads[kh].n();
      std::vector<double> sum(ng, 0.0), cnt(ng, 0.0);
      std::vector<double> p(rows.size());
      for (int h = kh * group; h < (kh + 1) * group; ++h)
        for (int k = 0; k < n_probes; ++k) {
          const float* q = st.q.data() + (static_cast<size_t>(k) * H + h) * D;
          double mx = -INFINITY;
          for (size_t j = 0; j < rows.size(); ++j) {
            if (pos[j] > st.pos[k]) { p[j] = -INFINITY; continue; }
            float s = 0;
            for (int c = 0; c < D; ++c) s += q[c] * rows[j][c];
            p[j] = s * scale;
            mx = std::max(mx, p[j]);
          }
          double z = 0;
          for (double& x : p) z += (x = std::isinf(x) ? 0.0 : std::exp(x - mx));
          if (!(z > 0)) continue;
          for (int j = 0; j < ng; ++j) {
            if (pos[off + j] > st.pos[k]) continue;
            sum[j] += p[off + j] / z;
            cnt[j] += 1;
          }
        }
      std::vector<double> sal(ng);
      for (int j = 0; j < ng; ++j)
        sal[j] = o_.saliency == Saliency::Accumulated ? sum[j] : (cnt[j] > 0 ? sum[j] / cnt[j] : 0.0);
      if (o_.shared) {
        shared_sum.resize(ng, 0.0);
        for (int j = 0; j < ng; ++j) shared_sum[j] += sal[j];
      } else {
        flags[kh] = top_flags(sal, o_.ratio);
      }
    }
    if (o_.shared)
      for (int kh = 0; kh < KH; ++kh) flags[kh] = top_flags(shared_sum, o_.ratio);
    quantize_mixed(g, flags, D);
  }

  // K channel-wise and V CSTQuant, each subset with its own ranges; flags[h][row] = salient.
  void quantize_mixed(KVSegment& s, const std::vector<std::vector<char>>& flags, int D) const {
    auto p = std::make_shared<quant::QuantPayload>(static_cast<int>(s.heads.size()));
    for (size_t h = 0; h < s.heads.size(); ++h) {
      HeadRows& r = s.heads[h];
      const std::vector<char>& f = flags.at(h);
      std::vector<uint32_t> bits(r.n());
      for (int sal = 1; sal >= 0; --sal) {
        std::vector<int> idx;
        for (int j = 0; j < r.n(); ++j)
          if ((f[j] != 0) == (sal == 1)) idx.push_back(j);
        const int m = static_cast<int>(idx.size()), b = sal ? o_.hi : o_.lo;
        std::vector<float> k(static_cast<size_t>(m) * D), v(static_cast<size_t>(m) * D);
        for (int t = 0; t < m; ++t) {
          std::copy_n(r.k.data() + static_cast<size_t>(idx[t]) * D, D, k.data() + static_cast<size_t>(t) * D);
          std::copy_n(r.v.data() + static_cast<size_t>(idx[t]) * D, D, v.data() + static_cast<size_t>(t) * D);
        }
        quant::quantize_block(k.data(), m, D, {b, quant::Axis::PerChannel}, p->k[h]);
        zipcache::cst_quantize(v.data(), m, D, b, p->v[h]);
        for (int t = 0; t < m; ++t) {
          std::copy_n(k.data() + static_cast<size_t>(t) * D, D, r.k.data() + static_cast<size_t>(idx[t]) * D);
          std::copy_n(v.data() + static_cast<size_t>(t) * D, D, r.v.data() + static_cast<size_t>(idx[t]) * D);
        }
      }
      r.bits.resize(static_cast<size_t>(r.n()));
      for (int j = 0; j < r.n(); ++j) {
        bits[j] = f[j] ? 1u : 0u;
        r.bits[static_cast<size_t>(j)] = static_cast<uint8_t>(f[j] ? o_.hi : o_.lo);
      }
      quant::pack(bits.data(), r.n(), 1, p->k[h].flags);
    }
    // Per-row bits written above (salient rows k_h, the rest k_l).
    quant::set_quantized(s, p, "zipcache q" + std::to_string(o_.hi) + "/q" + std::to_string(o_.lo), 0);
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

MethodSpec zipcache_method() {
  MethodSpec m;
  m.name = "zipcache";
  m.family = "quantization";
  m.summary = "ZipCache: salient tokens (normalized attention of probe queries) at k_h bits, the rest at k_l";
  m.params = {
      param::choice("high_bits", {"2", "3", "4", "8"}, "4", "k_h: bits of salient tokens"),
      param::choice("low_bits", {"1", "2", "3", "4"}, "2", "k_l: bits of the other tokens"),
      param::real("saliency_ratio", 0, 1, "0.4", "r: share of each KV head's tokens that are salient (top r by saliency)"),
      param::choice("saliency", {"normalized", "accumulated"}, "normalized",
                    "normalized p̃_i = Σ_k A_ki / nnz(A_:i) (Eq. 8) or accumulated p_i = Σ_k A_ki (H2O/MiKV), k over probes"),
      param::choice("probe", {"all", "random", "special", "recent", "random+recent"}, "random+recent",
                    "probe queries whose attention rows A_probe = softmax(Q_probe Kᵀ/√d) measure saliency"),
      param::real("recent_ratio", 0, 1, "0.05", "recent probes: the last round(ratio·T) tokens (≥ 1); decode: last ratio·gap of each gap"),
      param::real("random_ratio", 0, 1, "0.05", "random probes: round(ratio·T) tokens (≥ 1), seeded; decode: each token with this probability"),
      param::integer("seed", 0, 2147483647, "0", "seed of the random probes"),
      param::choice("saliency_heads", {"per-head", "shared"}, "per-head",
                    "saliency per KV head (mean over its query heads) or one per layer (mean over all heads)"),
      param::integer("gap", 1, 1000000, "100", "streaming: quantize decode tokens every `gap` new tokens"),
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
    return std::make_unique<ZipCachePolicy>(o);
  };
  return m;
}

}  // namespace kvlens
