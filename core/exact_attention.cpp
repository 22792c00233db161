#include "core/exact_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/errors.h"
#include "core/kv_store.h"

namespace kvlens {

namespace {

// Pads per-head row lists to one count.
ExtraRows pack(const std::vector<std::vector<const float*>>& k, const std::vector<std::vector<const float*>>& v,
               const std::vector<std::vector<int32_t>>& pos, int D) {
  ExtraRows r;
  const int NKV = static_cast<int>(pos.size());
  for (const auto& p : pos) r.n = std::max(r.n, static_cast<int>(p.size()));
  r.k.assign(static_cast<size_t>(NKV) * r.n * D, 0.0f);
  r.v.assign(r.k.size(), 0.0f);
  r.pos.assign(static_cast<size_t>(NKV) * r.n, -1);
  for (int h = 0; h < NKV; ++h)
    for (size_t i = 0; i < pos[h].size(); ++i) {
      const size_t at = static_cast<size_t>(h) * r.n + i;
      r.pos[at] = pos[h][i];
      std::copy_n(k[h][i], D, r.k.begin() + at * D);
      std::copy_n(v[h][i], D, r.v.begin() + at * D);
    }
  return r;
}

}  // namespace

ExtraRows rows_from(const KVStore& store, int layer, int T) {
  const int NKV = store.n_kv_heads(), D = store.head_dim();
  std::vector<std::vector<const float*>> k(NKV), v(NKV);
  std::vector<std::vector<int32_t>> pos(NKV);
  for (const KVSegment& s : store.layer(layer).segments)
    for (int h = 0; h < NKV && h < static_cast<int>(s.heads.size()); ++h) {
      const HeadRows& r = s.heads[h];
      for (int i = 0; i < r.n(); ++i)
        if (r.pos[i] >= T) {
          if (s.layout_only)
            throw InternalError("rows_from: layer " + std::to_string(layer) + " holds the row at position " +
                                std::to_string(r.pos[i]) + " in the device cache alone");
          k[h].push_back(r.k.data() + static_cast<size_t>(i) * D);
          v[h].push_back(r.v.data() + static_cast<size_t>(i) * D);
          pos[h].push_back(r.pos[i]);
        }
    }
  return pack(k, v, pos, D);
}

ExtraRows rows_from(const float* k, const float* v, const int32_t* key_pos, int n_kv_heads, int n_k, int head_dim,
                    int T) {
  std::vector<std::vector<const float*>> K(n_kv_heads), V(n_kv_heads);
  std::vector<std::vector<int32_t>> pos(n_kv_heads);
  for (int h = 0; h < n_kv_heads; ++h)
    for (int j = 0; j < n_k; ++j) {
      const int32_t p = key_pos[static_cast<size_t>(h) * n_k + j];
      if (p < T) continue;  // the prompt's rows and padding (-1)
      const size_t at = (static_cast<size_t>(h) * n_k + j) * head_dim;
      K[h].push_back(k + at);
      V[h].push_back(v + at);
      pos[h].push_back(p);
    }
  return pack(K, V, pos, head_dim);
}

PromptRows prompt_rows(const KVStore& store, int layer, int T) {
  const int NKV = store.n_kv_heads(), D = store.head_dim();
  PromptRows r;
  r.T = T;
  r.k.assign(NKV, std::vector<const float*>(T, nullptr));
  r.v = r.k;
  for (const KVSegment& s : store.layer(layer).segments)
    for (int h = 0; h < NKV && h < static_cast<int>(s.heads.size()); ++h) {
      if (s.layout_only)
        throw InternalError("prompt_rows: layer " + std::to_string(layer) + " holds the layout of its " +
                            segment_kind_name(s.kind) + " rows only (the rows are in the device cache)");
      const HeadRows& hr = s.heads[h];
      for (int i = 0; i < hr.n(); ++i)
        if (hr.pos[i] >= 0 && hr.pos[i] < T) {
          r.k[h][hr.pos[i]] = hr.k.data() + static_cast<size_t>(i) * D;
          r.v[h][hr.pos[i]] = hr.v.data() + static_cast<size_t>(i) * D;
        }
    }
  for (int h = 0; h < NKV; ++h)
    for (int t = 0; t < T; ++t)
      if (!r.k[h][t])
        throw InternalError("prompt_rows: layer " + std::to_string(layer) + " KV head " + std::to_string(h) +
                            " holds no row at position " + std::to_string(t));
  return r;
}

std::vector<int32_t> exact_positions(int n_kv_heads, int T, const ExtraRows& extra) {
  const int n = T + extra.n;
  std::vector<int32_t> pos(static_cast<size_t>(n_kv_heads) * n, -1);
  for (int h = 0; h < n_kv_heads; ++h) {
    for (int t = 0; t < T; ++t) pos[static_cast<size_t>(h) * n + t] = t;
    std::copy_n(extra.pos.begin() + static_cast<size_t>(h) * extra.n, extra.n, pos.begin() + static_cast<size_t>(h) * n + T);
  }
  return pos;
}

ExactAttention exact_attention(const float* q, int n_heads, int head_dim, float scale, const PromptRows& prompt,
                               const ExtraRows& extra) {
  const int NKV = static_cast<int>(prompt.k.size()), D = head_dim, T = prompt.T;
  if (NKV < 1 || n_heads % NKV || prompt.v.size() != prompt.k.size() ||
      std::any_of(prompt.k.begin(), prompt.k.end(), [&](const auto& r) { return static_cast<int>(r.size()) != T; }) ||
      extra.pos.size() != static_cast<size_t>(NKV) * extra.n ||
      extra.k.size() != extra.pos.size() * D || extra.v.size() != extra.k.size())
    throw InternalError("exact_attention: prompt and extra rows disagree on the heads");
  const int G = n_heads / NKV, n = T + extra.n;
  ExactAttention x;
  x.n = n;
  x.scores.assign(static_cast<size_t>(n_heads) * n, -std::numeric_limits<float>::infinity());
  x.probs.assign(x.scores.size(), 0.0f);
  x.out.assign(static_cast<size_t>(n_heads) * D, 0.0);
  x.pos = exact_positions(NKV, T, extra);
  for (int hd = 0; hd < n_heads; ++hd) {
    const int h = hd / G;
    const float* qh = q + static_cast<size_t>(hd) * D;
    auto key = [&](int j) {
      return j < T ? prompt.k[h][j] : extra.k.data() + (static_cast<size_t>(h) * extra.n + j - T) * D;
    };
    auto value = [&](int j) {
      return j < T ? prompt.v[h][j] : extra.v.data() + (static_cast<size_t>(h) * extra.n + j - T) * D;
    };
    const int32_t* pos = x.pos.data() + static_cast<size_t>(h) * n;
    float* s = x.scores.data() + static_cast<size_t>(hd) * n;
    float* p = x.probs.data() + static_cast<size_t>(hd) * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < n; ++j) {
      if (pos[j] < 0) continue;
      const float* kj = key(j);
      float dot = 0.0f;
      for (int c = 0; c < D; ++c) dot += qh[c] * kj[c];
      s[j] = dot * scale;
      mx = std::max(mx, s[j]);
    }
    double sum = 0.0;
    for (int j = 0; j < n; ++j)
      if (pos[j] >= 0) {
        p[j] = std::exp(s[j] - mx);
        sum += p[j];
      }
    for (int j = 0; j < n; ++j)
      if (pos[j] >= 0) p[j] = static_cast<float>(p[j] / sum);
    double* o = x.out.data() + static_cast<size_t>(hd) * D;
    for (int j = 0; j < n; ++j) {
      if (pos[j] < 0) continue;
      const float* vj = value(j);
      for (int c = 0; c < D; ++c) o[c] += static_cast<double>(p[j] * vj[c]);
    }
  }
  return x;
}

void softmax_double_sum(const float* s, int n, float* o) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += (o[i] = std::exp(s[i] - mx));
  for (int i = 0; i < n; ++i) o[i] = static_cast<float>(o[i] / sum);
}

}  // namespace kvlens
