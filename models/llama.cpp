#include "models/llama.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/errors.h"
#include "kernels/cpu/ops.h"
#include "models/activations.h"

namespace kvlens {

LlamaDecoder LlamaDecoder::load(const WeightStore& ws, const std::string& p,
                                const std::string& lm_head_name, bool tie, const LlamaConfig& cfg) {
  LlamaDecoder m;
  m.cfg = cfg;
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size;
  const int64_t QD = static_cast<int64_t>(cfg.num_attention_heads) * cfg.head_dim;
  const int64_t KD = static_cast<int64_t>(cfg.num_key_value_heads) * cfg.head_dim;
  m.embed = ws.load(p + "embed_tokens.weight", {V, H});
  m.norm = ws.load(p + "norm.weight", {H});
  if (!lm_head_name.empty()) {
    m.lm_head = ws.load(lm_head_name, {V, H});
  } else if (tie) {
    m.tied = true;
  } else {
    throw InputError(ws.dir() + ": checkpoint has no lm_head weight and tie_word_embeddings is false");
  }
  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    const std::string q = p + "layers." + std::to_string(l) + ".";
    LlamaLayer L;
    L.ln1 = ws.load(q + "input_layernorm.weight", {H});
    L.q_w = ws.load(q + "self_attn.q_proj.weight", {QD, H});
    L.k_w = ws.load(q + "self_attn.k_proj.weight", {KD, H});
    L.v_w = ws.load(q + "self_attn.v_proj.weight", {KD, H});
    L.o_w = ws.load(q + "self_attn.o_proj.weight", {H, QD});
    if (cfg.attention_bias) {
      L.q_b = ws.load(q + "self_attn.q_proj.bias", {QD});
      L.k_b = ws.load(q + "self_attn.k_proj.bias", {KD});
      L.v_b = ws.load(q + "self_attn.v_proj.bias", {KD});
      L.o_b = ws.load(q + "self_attn.o_proj.bias", {H});
    }
    L.ln2 = ws.load(q + "post_attention_layernorm.weight", {H});
    L.gate_w = ws.load(q + "mlp.gate_proj.weight", {I, H});
    L.up_w = ws.load(q + "mlp.up_proj.weight", {I, H});
    L.down_w = ws.load(q + "mlp.down_proj.weight", {H, I});
    if (cfg.mlp_bias)
      throw InputError(ws.dir() + ": text_config.mlp_bias = true is not supported");
    m.layers.push_back(std::move(L));
  }
  activation_from_name(cfg.hidden_act, "text_config.hidden_act");
  return m;
}

void LlamaDecoder::embed_tokens(const std::vector<int>& ids, float* out) const {
  const int H = cfg.hidden_size;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= cfg.vocab_size)
      throw InputError("token id " + std::to_string(ids[i]) + " is outside the vocabulary [0, " +
                       std::to_string(cfg.vocab_size) + ")");
    std::copy_n(embed.ptr() + static_cast<int64_t>(ids[i]) * H, H, out + i * H);
  }
}

std::vector<float> LlamaDecoder::logits_of(const float* h) const {
  const int H = cfg.hidden_size;
  std::vector<float> x(H), logits(cfg.vocab_size);
  cpu::rms_norm(h, x.data(), 1, H, norm.ptr(), static_cast<float>(cfg.rms_norm_eps));
  cpu::linear(x.data(), 1, H, tied ? embed.ptr() : lm_head.ptr(), cfg.vocab_size, nullptr, logits.data());
  return logits;
}

namespace {
const float* ptr_or_null(const Tensor& t) { return t.data.empty() ? nullptr : t.ptr(); }
}  // namespace

std::vector<float> LlamaDecoder::prefill(const Tensor& x0, const std::vector<SegmentKind>& kinds,
                                         KVStore& store, const std::vector<AttentionObserver*>& observers,
                                         PrefillCapture* capture) const {
  const int T = static_cast<int>(x0.dim(0)), H = cfg.hidden_size, I = cfg.intermediate_size;
  const int NH = cfg.num_attention_heads, NKV = cfg.num_key_value_heads, D = cfg.head_dim;
  const int QD = NH * D, KD = NKV * D, G = NH / NKV;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  const cpu::Act act = activation_from_name(cfg.hidden_act, "text_config.hidden_act");
  std::vector<float> h = x0.data, x(static_cast<size_t>(T) * H), q(static_cast<size_t>(T) * QD),
                     k(static_cast<size_t>(T) * KD), v(k.size()), a(q.size()),
                     g(static_cast<size_t>(T) * I), u(g.size());
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; ++t) pos[t] = t;
  const bool want_attn = !observers.empty() || (capture && capture->keep);
  std::vector<float> scores, probs;
  if (want_attn) {
    scores.resize(static_cast<size_t>(NH) * T * T);
    probs.resize(scores.size());
  }
  if (capture && capture->keep) {
    capture->q.assign(cfg.num_hidden_layers, {});
    capture->scores.assign(cfg.num_hidden_layers, {});
    capture->probs.assign(cfg.num_hidden_layers, {});
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    const LlamaLayer& L = layers[l];
    cpu::rms_norm(h.data(), x.data(), T, H, L.ln1.ptr(), eps);
    cpu::linear(x.data(), T, H, L.q_w.ptr(), QD, ptr_or_null(L.q_b), q.data());
    cpu::linear(x.data(), T, H, L.k_w.ptr(), KD, ptr_or_null(L.k_b), k.data());
    cpu::linear(x.data(), T, H, L.v_w.ptr(), KD, ptr_or_null(L.v_b), v.data());
    cpu::rope(q.data(), T, NH, D, pos.data(), static_cast<float>(cfg.rope_theta));
    cpu::rope(k.data(), T, NKV, D, pos.data(), static_cast<float>(cfg.rope_theta));
    store.append(l, k.data(), v.data(), pos.data(), kinds.data(), T);
#pragma omp parallel for if (cpu::parallel_heads(NH, T, T, D))
    for (int hd = 0; hd < NH; ++hd) {
      const int kv = hd / G;
      cpu::AttnHeadArgs args;
      args.q = q.data() + hd * D; args.q_stride = QD;
      args.k = k.data() + kv * D; args.v = v.data() + kv * D; args.kv_stride = KD;
      args.out = a.data() + hd * D; args.o_stride = QD;
      args.Tq = T; args.Tk = T; args.D = D; args.scale = scale;
      args.query_pos = pos.data(); args.key_pos = pos.data();
      if (want_attn) {
        args.scores = scores.data() + static_cast<size_t>(hd) * T * T;
        args.probs = probs.data() + static_cast<size_t>(hd) * T * T;
      }
      cpu::attention_head(args);
    }
    if (!observers.empty()) {
      std::vector<int32_t> key_pos(static_cast<size_t>(NKV) * T);
      std::vector<SegmentKind> key_kind(key_pos.size());
      std::vector<float> keys(static_cast<size_t>(NKV) * T * D), vals(keys.size());
      for (int kv = 0; kv < NKV; ++kv)
        for (int t = 0; t < T; ++t) {
          key_pos[kv * T + t] = t;
          key_kind[kv * T + t] = kinds[t];
          std::copy_n(k.data() + (static_cast<size_t>(t) * NKV + kv) * D, D,
                      keys.data() + (static_cast<size_t>(kv) * T + t) * D);
          std::copy_n(v.data() + (static_cast<size_t>(t) * NKV + kv) * D, D,
                      vals.data() + (static_cast<size_t>(kv) * T + t) * D);
        }
      AttentionEvent e;
      e.phase = Phase::Prefill; e.layer = l; e.n_heads = NH; e.n_kv_heads = NKV;
      e.n_q = T; e.n_k = T; e.scores = scores.data(); e.probs = probs.data();
      e.query_pos = pos.data(); e.key_pos = key_pos.data(); e.key_kind = key_kind.data();
      e.q = q.data(); e.k = keys.data(); e.v = vals.data(); e.head_dim = D;
      for (AttentionObserver* o : observers) o->on_attention(e);
    }
    if (capture && capture->keep) {
      capture->q[l] = q;
      capture->scores[l] = scores;
      capture->probs[l] = probs;
    }
    cpu::linear(a.data(), T, QD, L.o_w.ptr(), H, ptr_or_null(L.o_b), x.data());
    cpu::add(h.data(), x.data(), static_cast<int64_t>(T) * H);
    cpu::rms_norm(h.data(), x.data(), T, H, L.ln2.ptr(), eps);
    cpu::linear(x.data(), T, H, L.gate_w.ptr(), I, nullptr, g.data());
    cpu::linear(x.data(), T, H, L.up_w.ptr(), I, nullptr, u.data());
    cpu::activate(g.data(), static_cast<int64_t>(T) * I, act);
    cpu::mul(g.data(), u.data(), static_cast<int64_t>(T) * I);
    cpu::linear(g.data(), T, I, L.down_w.ptr(), H, nullptr, x.data());
    cpu::add(h.data(), x.data(), static_cast<int64_t>(T) * H);
    check_finite(h.data(), static_cast<int64_t>(T) * H, "text layer " + std::to_string(l) + " output (prefill)");
  }
  return logits_of(h.data() + static_cast<size_t>(T - 1) * H);
}

std::vector<float> LlamaDecoder::decode(const float* x0, int position, int step, KVStore& store,
                                        KVPolicy* policy,
                                        const std::vector<AttentionObserver*>& observers) const {
  const int H = cfg.hidden_size, I = cfg.intermediate_size;
  const int NH = cfg.num_attention_heads, NKV = cfg.num_key_value_heads, D = cfg.head_dim;
  const int QD = NH * D, KD = NKV * D, G = NH / NKV;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  const cpu::Act act = activation_from_name(cfg.hidden_act, "text_config.hidden_act");
  std::vector<float> h(x0, x0 + H), x(H), q(QD), k(KD), v(KD), a(QD), g(I), u(I);
  const int32_t pos = position;
  const SegmentKind gen = SegmentKind::Generated;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float ninf = -std::numeric_limits<float>::infinity();
  const bool transform = policy && policy->has_score_transform();
  std::vector<std::vector<float>> K(NKV), Vv(NKV);
  std::vector<std::vector<int32_t>> P(NKV);
  std::vector<std::vector<SegmentKind>> S(NKV);
  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    const LlamaLayer& L = layers[l];
    cpu::rms_norm(h.data(), x.data(), 1, H, L.ln1.ptr(), eps);
    cpu::linear(x.data(), 1, H, L.q_w.ptr(), QD, ptr_or_null(L.q_b), q.data());
    cpu::linear(x.data(), 1, H, L.k_w.ptr(), KD, ptr_or_null(L.k_b), k.data());
    cpu::linear(x.data(), 1, H, L.v_w.ptr(), KD, ptr_or_null(L.v_b), v.data());
    cpu::rope(q.data(), 1, NH, D, &pos, static_cast<float>(cfg.rope_theta));
    cpu::rope(k.data(), 1, NKV, D, &pos, static_cast<float>(cfg.rope_theta));
    store.append(l, k.data(), v.data(), &pos, &gen, 1);
    if (policy) {
      DecodeContext ctx;
      ctx.layer = l; ctx.step = step; ctx.position = position; ctx.n_heads = NH;
      ctx.n_kv_heads = NKV; ctx.head_dim = D; ctx.q = q.data();
      policy->on_decode_step(ctx, store.layer(l));
    }
    int n_max = 0;
    for (int kv = 0; kv < NKV; ++kv) {
      store.gather(l, kv, K[kv], Vv[kv], P[kv], &S[kv]);
      n_max = std::max(n_max, static_cast<int>(P[kv].size()));
    }
    std::vector<float> scores, probs;
    const bool want = !observers.empty();
    if (want) {
      scores.assign(static_cast<size_t>(NH) * n_max, ninf);
      probs.assign(scores.size(), 0.0f);
    }
#pragma omp parallel for if (cpu::parallel_heads(NH, 1, n_max, D))
    for (int hd = 0; hd < NH; ++hd) {
      const int kv = hd / G, n = static_cast<int>(P[kv].size());
      std::vector<float> s(n);
      const float* qh = q.data() + hd * D;
      for (int j = 0; j < n; ++j) {
        const float* kj = K[kv].data() + static_cast<size_t>(j) * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += qh[d] * kj[d];
        s[j] = dot * scale;
      }
      if (transform) policy->transform_scores(l, hd, s.data(), S[kv].data(), n);
      if (want) std::copy(s.begin(), s.end(), scores.begin() + static_cast<size_t>(hd) * n_max);
      cpu::softmax_rows(s.data(), 1, n);
      if (want) std::copy(s.begin(), s.end(), probs.begin() + static_cast<size_t>(hd) * n_max);
      float* o = a.data() + hd * D;
      std::fill(o, o + D, 0.0f);
      for (int j = 0; j < n; ++j) {
        const float* vj = Vv[kv].data() + static_cast<size_t>(j) * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) o[d] += s[j] * vj[d];
      }
    }
    if (want) {
      std::vector<int32_t> key_pos(static_cast<size_t>(NKV) * n_max, -1);
      std::vector<SegmentKind> key_kind(key_pos.size(), SegmentKind::Generated);
      std::vector<float> keys(static_cast<size_t>(NKV) * n_max * D, 0.0f), vals(keys.size(), 0.0f);
      for (int kv = 0; kv < NKV; ++kv) {
        std::copy(P[kv].begin(), P[kv].end(), key_pos.begin() + static_cast<size_t>(kv) * n_max);
        std::copy(S[kv].begin(), S[kv].end(), key_kind.begin() + static_cast<size_t>(kv) * n_max);
        std::copy(K[kv].begin(), K[kv].end(), keys.begin() + static_cast<size_t>(kv) * n_max * D);
        std::copy(Vv[kv].begin(), Vv[kv].end(), vals.begin() + static_cast<size_t>(kv) * n_max * D);
      }
      AttentionEvent e;
      e.phase = Phase::Decode; e.layer = l; e.step = step; e.n_heads = NH; e.n_kv_heads = NKV;
      e.n_q = 1; e.n_k = n_max; e.scores = scores.data(); e.probs = probs.data();
      e.query_pos = &pos; e.key_pos = key_pos.data(); e.key_kind = key_kind.data();
      e.q = q.data(); e.k = keys.data(); e.v = vals.data(); e.head_dim = D;
      for (AttentionObserver* o : observers) o->on_attention(e);
    }
    cpu::linear(a.data(), 1, QD, L.o_w.ptr(), H, ptr_or_null(L.o_b), x.data());
    cpu::add(h.data(), x.data(), H);
    cpu::rms_norm(h.data(), x.data(), 1, H, L.ln2.ptr(), eps);
    cpu::linear(x.data(), 1, H, L.gate_w.ptr(), I, nullptr, g.data());
    cpu::linear(x.data(), 1, H, L.up_w.ptr(), I, nullptr, u.data());
    cpu::activate(g.data(), I, act);
    cpu::mul(g.data(), u.data(), I);
    cpu::linear(g.data(), 1, I, L.down_w.ptr(), H, nullptr, x.data());
    cpu::add(h.data(), x.data(), H);
    check_finite(h.data(), H, "text layer " + std::to_string(l) + " output (decode step " + std::to_string(step) + ")");
  }
  return logits_of(h.data());
}

}  // namespace kvlens
