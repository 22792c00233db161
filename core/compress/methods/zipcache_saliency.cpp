// ZipCache's saliency measure and probe selection (Sec. 4.2-4.3) and channel-separable
// token-wise quantization of one block (Algorithm 1); the policy is core/compress/methods/zipcache.cpp.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/compress/quant_methods.h"

namespace kvlens {

namespace zipcache {

std::vector<double> saliency(const float* A, int T, const std::vector<int>& probes, Saliency s) {
  std::vector<double> sum(T, 0.0);
  for (int k : probes)
    for (int i = 0; i <= k && i < T; ++i) sum[i] += A[static_cast<int64_t>(k) * T + i];
  return saliency_from_sums(sum.data(), T, probes, s);
}

std::vector<double> saliency_from_sums(const double* sums, int T, const std::vector<int>& probes, Saliency s) {
  std::vector<double> out(sums, sums + T);
  if (s != Saliency::Normalized || T <= 0) return out;
  // Each token's share of the probes that see it: those at or after it (a count of the probes at
  // each position, summed from the end).
  std::vector<int64_t> cnt(static_cast<size_t>(T) + 1, 0);
  for (int k : probes)
    if (k >= 0) ++cnt[static_cast<size_t>(std::min(k, T - 1))];
  for (int i = T - 1; i > 0; --i) cnt[static_cast<size_t>(i) - 1] += cnt[static_cast<size_t>(i)];
  for (int i = 0; i < T; ++i) {
    const int64_t c = cnt[static_cast<size_t>(i)];
    out[static_cast<size_t>(i)] = c > 0 ? out[static_cast<size_t>(i)] / static_cast<double>(c) : 0.0;
  }
  return out;
}

std::vector<char> top_flags(const std::vector<double>& score, double ratio) {
  const int n = static_cast<int>(score.size());
  const int k = std::clamp(static_cast<int>(std::llround(ratio * n)), 0, n);
  std::vector<int> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  // The k first by descending score, ties to the earlier index (what a stable sort's first k
  // are), without sorting the rest.
  if (k > 0 && k < n)
    std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(),
                     [&](int a, int b) { return score[a] > score[b] || (score[a] == score[b] && a < b); });
  std::vector<char> f(n, 0);
  for (int i = 0; i < k; ++i) f[idx[i]] = 1;
  return f;
}

std::vector<std::vector<char>> rank_gap(const double* sal, int n_kv_heads, int gap, double ratio, bool shared) {
  std::vector<std::vector<char>> f(static_cast<size_t>(n_kv_heads));
  std::vector<double> sum(static_cast<size_t>(gap), 0.0);
  for (int h = 0; h < n_kv_heads; ++h) {
    const std::vector<double> s(sal + static_cast<int64_t>(h) * gap, sal + static_cast<int64_t>(h + 1) * gap);
    if (!shared) f[static_cast<size_t>(h)] = top_flags(s, ratio);
    for (int j = 0; shared && j < gap; ++j) sum[static_cast<size_t>(j)] += s[static_cast<size_t>(j)];
  }
  for (int h = 0; shared && h < n_kv_heads; ++h) f[static_cast<size_t>(h)] = top_flags(sum, ratio);
  return f;
}

ProbeStream::ProbeStream(uint64_t seed, int layer, int gap, double recent, double random)
    : rng_(seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(layer + 1)),
      gap_(gap),
      n_recent_(static_cast<int>(std::llround(recent * gap))),
      random_(random) {}

bool ProbeStream::next(int index) {
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
  return index >= gap_ - n_recent_ || u < random_;
}

std::vector<double> gap_saliency(const float* scores, int64_t probe_stride, int64_t stride, int n_probes, int heads,
                                 int before, const int* seen, int gap, Saliency s) {
  std::vector<double> sum(static_cast<size_t>(gap), 0.0), cnt(sum.size(), 0.0);
  for (int h = 0; h < heads; ++h)
    for (int k = 0; k < n_probes; ++k) {
      const float* x = scores + k * probe_stride + h * stride;
      const int n = before + seen[k];
      double mx = -INFINITY;
      for (int r = 0; r < n; ++r) mx = std::max(mx, static_cast<double>(x[r]));
      double z = 0;
      for (int r = 0; r < n; ++r) z += std::exp(static_cast<double>(x[r]) - mx);
      if (!(z > 0)) continue;
      for (int j = 0; j < seen[k] && j < gap; ++j) {
        sum[static_cast<size_t>(j)] += std::exp(static_cast<double>(x[before + j]) - mx) / z;
        cnt[static_cast<size_t>(j)] += 1;
      }
    }
  if (s == Saliency::Normalized)
    for (size_t j = 0; j < sum.size(); ++j) sum[j] = cnt[j] > 0 ? sum[j] / cnt[j] : 0.0;
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

std::vector<float> channel_factors(const float* x, int n, int d) {
  std::vector<float> c(d, 0.0f);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) c[j] = std::max(c[j], std::fabs(x[static_cast<int64_t>(i) * d + j]));
  for (int j = 0; j < d; ++j) {
    c[j] = quant::round_half(std::sqrt(c[j]));
    if (!(c[j] > 0) || !std::isfinite(c[j])) c[j] = 1.0f;
  }
  return c;
}

void cst_quantize(float* x, int n, int d, int bits, quant::QuantBlock& out, const float* factors) {
  if (n <= 0 || d <= 0) return;
  const std::vector<float> c = factors ? std::vector<float>(factors, factors + d) : channel_factors(x, n, d);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) x[static_cast<int64_t>(i) * d + j] /= c[j];
  quant::quantize_block(x, n, d, {bits, quant::Axis::PerToken}, out);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) x[static_cast<int64_t>(i) * d + j] *= c[j];
  if (!factors)
    for (int j = 0; j < d; ++j) out.meta.push_back(quant::to_half(c[j]));
}

}  // namespace zipcache

}  // namespace kvlens
