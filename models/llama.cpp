#include "models/llama.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>

#include "core/errors.h"
#include "core/parallel.h"
#include "models/activations.h"
#include "core/trace.h"

namespace kvlens {

namespace {
const Buffer* or_null(const Buffer& b) { return b.empty() ? nullptr : &b; }
}  // namespace

LlamaDecoder LlamaDecoder::load(const WeightStore& ws, const std::string& p, const std::string& lm_head_name,
                                bool tie, const LlamaConfig& cfg, std::shared_ptr<Backend> be) {
  LlamaDecoder m;
  m.cfg = cfg;
  m.be = be;
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size;
  const int64_t QD = static_cast<int64_t>(cfg.num_attention_heads) * cfg.head_dim;
  const int64_t KD = static_cast<int64_t>(cfg.num_key_value_heads) * cfg.head_dim;
  if (cfg.mlp_bias) throw InputError(ws.dir() + ": text_config.mlp_bias = true is not supported");
  activation_from_name(cfg.hidden_act, "text_config.hidden_act");
  m.embed = be->matrix("text.embed_tokens", {ws.host(p + "embed_tokens.weight", {V, H})});
  m.norm = be->vector(ws.host(p + "norm.weight", {H}));
  if (!lm_head_name.empty()) {
    m.lm_head = be->matrix("text.lm_head", {ws.host(lm_head_name, {V, H})});
  } else if (tie) {
    m.lm_head = m.embed;
  } else {
    throw InputError(ws.dir() + ": checkpoint has no lm_head weight and tie_word_embeddings is false");
  }
  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    const std::string q = p + "layers." + std::to_string(l) + ".";
    const std::string n = "text.l" + std::to_string(l) + ".";
    LlamaLayer L;
    L.ln1 = be->vector(ws.host(q + "input_layernorm.weight", {H}));
    L.qkv_w = be->matrix(n + "qkv", {ws.host(q + "self_attn.q_proj.weight", {QD, H}),
                                     ws.host(q + "self_attn.k_proj.weight", {KD, H}),
                                     ws.host(q + "self_attn.v_proj.weight", {KD, H})});
    L.o_w = be->matrix(n + "o", {ws.host(q + "self_attn.o_proj.weight", {H, QD})});
    if (cfg.qkv_bias) {
      // Biases are fp32 vectors; the three are stacked like the matrix rows.
      std::vector<float> b;
      for (const auto& [name, len] : {std::pair{"q_proj", QD}, {"k_proj", KD}, {"v_proj", KD}}) {
        const Buffer part = be->vector(ws.host(q + "self_attn." + name + ".bias", {len}));
        std::vector<float> host(static_cast<size_t>(len));
        be->download(part, host.data());
        b.insert(b.end(), host.begin(), host.end());
      }
      L.qkv_b = be->vector({n + "qkv_bias", Dt::F32, {QD + 2 * KD}, b.data()});
    }
    if (cfg.o_bias) L.o_b = be->vector(ws.host(q + "self_attn.o_proj.bias", {H}));
    L.ln2 = be->vector(ws.host(q + "post_attention_layernorm.weight", {H}));
    L.gate_up_w = be->matrix(n + "gate_up", {ws.host(q + "mlp.gate_proj.weight", {I, H}),
                                             ws.host(q + "mlp.up_proj.weight", {I, H})});
    L.down_w = be->matrix(n + "down", {ws.host(q + "mlp.down_proj.weight", {H, I})});
    m.layers.push_back(std::move(L));
    ws.release();  // the layer is in the backend's memory: its mapped pages go back
  }
  return m;
}

AttnLayout LlamaDecoder::layout(int T) const {
  AttnLayout a;
  a.T = T;
  a.n_heads = cfg.num_attention_heads;
  a.n_kv_heads = cfg.num_key_value_heads;
  a.head_dim = cfg.head_dim;
  const int64_t QD = static_cast<int64_t>(a.n_heads) * a.head_dim, KD = static_cast<int64_t>(a.n_kv_heads) * a.head_dim;
  a.row_stride = QD + 2 * KD;
  a.q_col = 0;
  a.k_col = QD;
  a.v_col = QD + KD;
  a.causal = true;
  a.scale = 1.0f / std::sqrt(static_cast<float>(a.head_dim));
  return a;
}

void LlamaDecoder::check_ids(const std::vector<int>& ids) const {
  for (int id : ids)
    if (id < 0 || id >= cfg.vocab_size)
      throw InputError("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(cfg.vocab_size) + ")");
}

Buffer LlamaDecoder::embed_tokens(const std::vector<int>& ids) const {
  check_ids(ids);
  const int n = static_cast<int>(ids.size());
  Buffer idb = be->alloc("text.token_ids", {n}, Dt::I32);
  be->upload(ids.data(), idb);
  Buffer out = be->alloc("text.token_embeds", {n, cfg.hidden_size}, Dt::F32);
  be->embed(embed, idb, out);
  return out;
}

void LlamaDecoder::mlp(const LlamaLayer& L, Buffer& h, Buffer& x, Buffer& gu, Buffer& g) const {
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  be->norm_gate_up(h, L.ln2, eps, x, L.gate_up_w, activation_from_name(cfg.hidden_act, "text_config.hidden_act"), gu, g);
  be->linear(g, L.down_w, nullptr, h, true);
}

std::vector<float> LlamaDecoder::prefill(const Buffer& x0, const std::vector<SegmentKind>& kinds, SeqKV& kv,
                                         const std::vector<AttentionObserver*>& observers, PrefillCapture* capture,
                                         const std::vector<int32_t>& rope_positions) const {
  const int T = static_cast<int>(x0.rows()), H = cfg.hidden_size, I = cfg.intermediate_size;
  const int NH = cfg.num_attention_heads, NKV = cfg.num_key_value_heads, D = cfg.head_dim;
  const int QD = NH * D;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  const Dt mdt = layers.at(0).qkv_w.dt;
  const AttnLayout lay = layout(T);
  Buffer h = be->alloc("text.h", {T, H}, Dt::F32);
  be->copy_block(x0, 0, 0, h, 0, 0, T, H);
  Buffer x = be->alloc("text.x", {T, H}, mdt);
  Buffer qkv = be->alloc("text.qkv", {T, lay.row_stride}, Dt::F32);
  Buffer a = be->alloc("text.attn_out", {T, QD}, mdt);
  Buffer gu = be->alloc("text.gate_up", {T, 2 * I}, Dt::F32);
  Buffer g = be->alloc("text.mlp_act", {T, I}, mdt);
  std::vector<int32_t> pos_host(T);
  for (int t = 0; t < T; ++t) pos_host[t] = t;
  Buffer pos = be->alloc("text.positions", {T}, Dt::I32);
  be->upload(pos_host.data(), pos);
  Buffer rpos = pos;  // the rotary positions
  if (!rope_positions.empty()) {
    const int R = cfg.rope.rows();
    if (rope_positions.size() != static_cast<size_t>(R) * T)
      throw InternalError("prefill: " + std::to_string(rope_positions.size()) + " rotary positions for " + std::to_string(R) +
                          " rows of " + std::to_string(T) + " tokens");
    rpos = be->alloc("text.rope_positions", {R, T}, Dt::I32);
    be->upload(rope_positions.data(), rpos);
  }

  const bool keep = capture && capture->keep;
  // Observers see each layer's scores and probabilities as it runs (one layer's at a time); a
  // capture keeps the layer's queries, keys and values where they are (the backend's memory)
  // and recomputes its attention on demand: nothing of it crosses to the host.
  const bool observe = !observers.empty();
  const bool want_q = observe;
  std::vector<float> scores, probs, qkv_host;
  if (observe) {
    scores.resize(static_cast<size_t>(NH) * T * T);
    probs.resize(scores.size());
  }
  std::shared_ptr<CapturedAttention> captured;
  if (keep)
    captured = std::make_shared<CapturedAttention>(be, lay, mdt, cfg.num_hidden_layers, cfg.rope, rpos);
  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    const LlamaLayer& L = layers[l];
    be->rms_norm(h, L.ln1, eps, x);
    be->linear(x, L.qkv_w, or_null(L.qkv_b), qkv, false);
    if (keep) captured->keep_layer(l, x, L.qkv_w, L.qkv_b);
    be->rope(qkv, lay, rpos, cfg.rope);
    be->kv_append(kv, l, qkv, lay, pos, pos_host.data(), kinds.data(), T);
    be->attention(qkv, lay, a, observe ? scores.data() : nullptr, observe ? probs.data() : nullptr);
    if (want_q) {
      qkv_host.resize(static_cast<size_t>(qkv.numel()));
      be->download(qkv, qkv_host.data());
    }
    std::vector<float> q;
    if (want_q) {
      q.resize(static_cast<size_t>(T) * QD);
      for (int t = 0; t < T; ++t)
        std::copy_n(qkv_host.data() + static_cast<size_t>(t) * lay.row_stride, QD, q.data() + static_cast<size_t>(t) * QD);
    }
    if (!observers.empty()) {
      std::vector<int32_t> key_pos(static_cast<size_t>(NKV) * T);
      std::vector<SegmentKind> key_kind(key_pos.size());
      std::vector<float> keys(static_cast<size_t>(NKV) * T * D), vals(keys.size());
      for (int h2 = 0; h2 < NKV; ++h2)
        for (int t = 0; t < T; ++t) {
          key_pos[h2 * T + t] = t;
          key_kind[h2 * T + t] = kinds[t];
          const float* row = qkv_host.data() + static_cast<size_t>(t) * lay.row_stride;
          std::copy_n(row + lay.k_col + h2 * D, D, keys.data() + (static_cast<size_t>(h2) * T + t) * D);
          std::copy_n(row + lay.v_col + h2 * D, D, vals.data() + (static_cast<size_t>(h2) * T + t) * D);
        }
      AttentionEvent e;
      e.phase = Phase::Prefill; e.layer = l; e.n_heads = NH; e.n_kv_heads = NKV;
      e.n_q = T; e.n_k = T; e.scores = scores.data(); e.probs = probs.data();
      e.query_pos = pos_host.data(); e.key_pos = key_pos.data(); e.key_kind = key_kind.data();
      e.q = q.data(); e.k = keys.data(); e.v = vals.data(); e.head_dim = D;
      for (AttentionObserver* o : observers) o->on_attention(e);
    }
    be->linear(a, L.o_w, or_null(L.o_b), h, true);
    mlp(L, h, x, gu, g);
    be->check_finite(h, "text layer " + std::to_string(l) + " output (prefill)");
  }
  Buffer last = h.row_view(T - 1, 1);
  Buffer xl = be->alloc("text.final_norm", {1, H}, mdt);
  be->rms_norm(last, norm, eps, xl);
  Buffer logits = be->alloc("text.logits", {1, cfg.vocab_size}, Dt::F32);
  be->linear(xl, lm_head, nullptr, logits, false);
  std::vector<float> out(static_cast<size_t>(cfg.vocab_size));
  be->download(logits, out.data());
  be->finish_checks();
  if (keep) capture->attention = std::move(captured);
  return out;
}

CapturedAttention::CapturedAttention(std::shared_ptr<Backend> be, const AttnLayout& lay, Dt out_dt, int n_layers,
                                     const Rope& rope, const Buffer& positions)
    : be_(std::move(be)), lay_(lay), out_dt_(out_dt), rope_(rope), pos_(positions),
      layers_(static_cast<size_t>(n_layers)) {}

void CapturedAttention::keep_layer(int layer, const Buffer& x, const Buffer& qkv_w, const Buffer& qkv_b) {
  Layer& c = layers_.at(static_cast<size_t>(layer));
  c.x = be_->alloc("l" + std::to_string(layer) + ".prefill.qkv_input_captured", x.shape, x.dt);
  be_->copy_block(x, 0, 0, c.x, 0, 0, x.rows(), x.cols());
  c.w = qkv_w;
  c.b = qkv_b;
}

int64_t CapturedAttention::kept_slots(int64_t n_layers, int64_t T, int64_t row_stride) {
  const int64_t layer_bytes = std::max<int64_t>(1, T * row_stride * 4);
  return std::min(n_layers, std::max(static_cast<int64_t>(kSlots), kSlotBytes / layer_bytes));
}

Buffer CapturedAttention::qkv_locked(int layer) const {
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].first == layer) {
      std::rotate(slots_.begin(), slots_.begin() + static_cast<std::ptrdiff_t>(i), slots_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      return slots_.front().second;
    }
  if (layer < 0 || layer >= n_layers() || layers_[static_cast<size_t>(layer)].x.empty())
    throw InternalError("prefill attention: no captured layer " + std::to_string(layer));
  // Another thread's ops on this backend wait (a policy's layers may compress in parallel).
  std::lock_guard<std::recursive_mutex> ops(be_->ops_mutex());
  Buffer qkv = be_->alloc("l" + std::to_string(layer) + ".prefill.qkv_recomputed", {lay_.T, lay_.row_stride}, Dt::F32);
  recompute_locked(layer, qkv);
  ++recomputes_;
  slots_.insert(slots_.begin(), {layer, qkv});
  if (static_cast<int64_t>(slots_.size()) > kept_slots(n_layers(), lay_.T, lay_.row_stride)) slots_.pop_back();
  return qkv;
}

void CapturedAttention::recompute_locked(int layer, Buffer& qkv) const {
  // The prefill's projection and RoPE on the kept input: the prefill's q, k and v again.
  const Layer& c = layers_[static_cast<size_t>(layer)];
  be_->linear(c.x, c.w, c.b.empty() ? nullptr : &c.b, qkv, false);
  be_->rope(qkv, lay_, pos_, rope_);
}

Buffer CapturedAttention::layer_qkv(int layer) const {
  std::lock_guard<std::shared_mutex> lock(mu_);
  return qkv_locked(layer);
}

std::shared_ptr<const std::vector<float>> CapturedAttention::probs(int layer) const {
  std::lock_guard<std::shared_mutex> lock(mu_);
  for (const auto& [l, p] : recent_)
    if (l == layer) return p;
  return held(layer);
}

void CapturedAttention::run_locked(int layer, const AttentionReduction& own) const {
  // From probabilities kept on the host, else where the capture is (a backend without the op
  // hands over the layer's probabilities).
  for (const auto& e : recent_)
    if (e.first == layer) return reduce_attention(e.second->data(), lay_.n_heads, lay_.T, own);
  std::lock_guard<std::recursive_mutex> ops(be_->ops_mutex());
  if (be_->attention_reduce(qkv_locked(layer), lay_, own)) {
    ++runs_;
    return;
  }
  const auto p = held(layer);
  reduce_attention(p->data(), lay_.n_heads, lay_.T, own);
}

const CapturedAttention::Reduced& CapturedAttention::reduced_locked(int layer, const AttentionReduction& r) const {
  const int T = lay_.T, NH = lay_.n_heads;
  AttentionReduction rows_only;
  rows_only.queries = r.queries;
  const std::string rows = rows_only.key();
  Reduced* x = const_cast<Reduced*>(find_reduced(layer, rows));
  if (x && (!r.below || x->counts(r))) return *x;
  // The column sums with any request over rows not seen yet, the counts when asked.
  Reduced fresh{layer, rows, nullptr, {}};
  Reduced& into = x ? *x : fresh;
  AttentionReduction own;
  own.queries = r.queries;
  if (!x) {
    into.column_sums = std::make_shared<std::vector<double>>(static_cast<size_t>(NH) * T);
    own.column_sums = into.column_sums->data();
  }
  Below b{r.p, r.zeros_below, {}};
  if (r.below) {
    b.counts.resize(static_cast<size_t>(NH));
    own.below = b.counts.data();
    own.p = r.p;
    own.zeros_below = r.zeros_below;
  }
  run_locked(layer, own);
  if (r.below) into.below.push_back(std::move(b));
  if (x) return *x;
  keep_reduced_locked(std::move(fresh));
  return reduced_.front();
}

const CapturedAttention::Reduced* CapturedAttention::find_reduced(int layer, const std::string& rows) const {
  const Reduced* x = nullptr;
  for (const Reduced& e : reduced_)
    if (e.layer == layer && e.rows == rows) x = &e;
  return x;
}

void CapturedAttention::keep_reduced_locked(Reduced x) const {
  reduced_.insert(reduced_.begin(), std::move(x));
  if (reduced_.size() > max_reduced()) reduced_.pop_back();
}

void CapturedAttention::prepare(const std::vector<int>& layers, const std::vector<QueryRows>& sets) const {
  const int T = lay_.T, NH = lay_.n_heads;
  if (!be_->queues_reductions()) return;  // (a layer at a time when asked, as without prepare)
  std::vector<std::string> keys;
  for (const QueryRows& q : sets) {
    AttentionReduction rows_only;
    rows_only.queries = q.queries;
    rows_only.check(T, "prefill attention");
    keys.push_back(rows_only.key());
  }
  std::lock_guard<std::shared_mutex> lock(mu_);
  // Per layer, the sets with nothing kept over their rows (or without the counts asked for),
  // for layers whose probabilities are not on the host.
  std::vector<std::pair<int, std::vector<size_t>>> todo;
  size_t jobs = 0;
  for (int l : layers) {
    if (l < 0 || l >= n_layers() || layers_[static_cast<size_t>(l)].x.empty())
      throw InternalError("prefill attention: no captured layer " + std::to_string(l));
    if (std::any_of(recent_.begin(), recent_.end(), [&](const auto& x) { return x.first == l; })) continue;
    if (std::any_of(todo.begin(), todo.end(), [&](const auto& x) { return x.first == l; })) continue;
    std::vector<size_t> missing;
    for (size_t s = 0; s < sets.size(); ++s) {
      AttentionReduction want;
      want.p = sets[s].below_p;
      want.zeros_below = sets[s].zeros_below;
      const Reduced* e = find_reduced(l, keys[s]);
      const bool have = e && (sets[s].below_p < 0 || e->counts(want));
      const bool twice = std::any_of(missing.begin(), missing.end(), [&](size_t m) { return keys[m] == keys[s]; });
      if (!have && !twice) missing.push_back(s);
    }
    if (missing.empty()) continue;
    jobs += missing.size();
    todo.emplace_back(l, std::move(missing));
  }
  if (jobs < 2) return;  // (one reduction waits once either way)
  std::lock_guard<std::recursive_mutex> ops(be_->ops_mutex());
  Buffer qkv = be_->alloc("prefill.qkv_recomputed_in_turn", {T, lay_.row_stride}, Dt::F32);
  std::vector<Reduced> fresh;
  fresh.reserve(jobs);  // (the results' addresses are queued: no reallocation)
  be_->queue_then_finish([&] {
    for (const auto& [l, missing] : todo) {
      recompute_locked(l, qkv);
      ++recomputes_;
      for (size_t s : missing) {
        const QueryRows& q = sets[s];
        fresh.push_back(Reduced{l, keys[s], std::make_shared<std::vector<double>>(static_cast<size_t>(NH) * T), {}});
        Reduced& x = fresh.back();
        AttentionReduction own;
        own.queries = q.queries;
        own.column_sums = x.column_sums->data();
        if (q.below_p >= 0) {
          x.below.push_back(Below{q.below_p, q.zeros_below, std::vector<int64_t>(static_cast<size_t>(NH))});
          own.below = x.below.back().counts.data();
          own.p = q.below_p;
          own.zeros_below = q.zeros_below;
        }
        if (!be_->attention_reduce_later(qkv, lay_, own))
          throw InternalError("prefill attention: the " + be_->name() + " backend said it queues reductions, then did not");
        ++runs_;
      }
    }
  });
  // A layer's earlier entry over the same rows gives way to the new one (counts it held for
  // other shares are computed again if asked).
  for (Reduced& x : fresh) {
    reduced_.erase(std::remove_if(reduced_.begin(), reduced_.end(),
                                  [&](const Reduced& e) { return e.layer == x.layer && e.rows == x.rows; }),
                   reduced_.end());
    keep_reduced_locked(std::move(x));
  }
}

void CapturedAttention::reduce(int layer, const AttentionReduction& r) const {
  r.check(lay_.T, "prefill attention of layer " + std::to_string(layer));
  std::lock_guard<std::shared_mutex> lock(mu_);
  if (r.map) {  // a view: computed for this caller, not remembered
    AttentionReduction m = r;  // the map alone
    m.column_sums = nullptr;
    m.below = nullptr;
    run_locked(layer, m);
    if (!r.column_sums && !r.below) return;
  }
  const Reduced& x = reduced_locked(layer, r);
  if (r.column_sums) std::copy(x.column_sums->begin(), x.column_sums->end(), r.column_sums);
  if (r.below) std::copy(x.counts(r)->counts.begin(), x.counts(r)->counts.end(), r.below);
}

std::shared_ptr<const std::vector<double>> CapturedAttention::column_sums(int layer, const std::vector<int>& queries) const {
  AttentionReduction r;
  r.queries = queries;
  r.check(lay_.T, "prefill attention of layer " + std::to_string(layer));
  {
    // Kept already (a method asks once for each of a layer's heads, its layers on threads): many
    // readers at once.
    AttentionReduction rows_only;
    rows_only.queries = queries;
    std::shared_lock<std::shared_mutex> read(mu_);
    if (const Reduced* x = find_reduced(layer, rows_only.key())) return x->column_sums;
  }
  std::lock_guard<std::shared_mutex> lock(mu_);
  return reduced_locked(layer, r).column_sums;
}

std::shared_ptr<const std::vector<float>> CapturedAttention::held(int layer) const {
  const int T = lay_.T, NH = lay_.n_heads;
  std::lock_guard<std::recursive_mutex> ops(be_->ops_mutex());
  const Buffer qkv = qkv_locked(layer);
  auto p = std::make_shared<std::vector<float>>(static_cast<size_t>(NH) * T * T);
  Buffer out = be_->alloc("l" + std::to_string(layer) + ".prefill.attn_out_recomputed",
                          {T, static_cast<int64_t>(NH) * lay_.head_dim}, out_dt_);
  be_->attention(qkv, lay_, out, nullptr, p->data());
  recent_.insert(recent_.begin(), {layer, p});
  if (recent_.size() > kRecent) recent_.pop_back();
  return p;
}

int64_t CapturedAttention::capture_bytes() const {
  int64_t b = 0;
  for (const Layer& c : layers_) b += c.x.empty() ? 0 : c.x.bytes();
  // and the q/k/v slots, at most kept_slots layers (the most they hold)
  return b + kept_slots(n_layers(), lay_.T, lay_.row_stride) * lay_.T * lay_.row_stride * 4;
}

int64_t CapturedAttention::cached_bytes() const {
  std::lock_guard<std::shared_mutex> lock(mu_);
  int64_t b = 0;
  for (const auto& r : recent_) b += static_cast<int64_t>(r.second->size() * sizeof(float));
  return b;
}

LlamaWorkspace LlamaDecoder::workspace() const {
  const int H = cfg.hidden_size, I = cfg.intermediate_size;
  const Dt mdt = layers.at(0).qkv_w.dt;
  const AttnLayout lay = layout(1);
  LlamaWorkspace w;
  w.h = be->alloc("step.h", {1, H}, Dt::F32);
  w.x = be->alloc("step.x", {1, H}, mdt);
  w.qkv = be->alloc("step.qkv", {1, lay.row_stride}, Dt::F32);
  w.a = be->alloc("step.attn_out", {1, static_cast<int64_t>(cfg.num_attention_heads) * cfg.head_dim}, mdt);
  w.gu = be->alloc("step.gate_up", {1, 2 * I}, Dt::F32);
  w.g = be->alloc("step.mlp_act", {1, I}, mdt);
  w.ids = be->alloc("step.token", {1}, Dt::I32);
  w.pos = be->alloc("step.position", {1}, Dt::I32);
  w.logits = be->alloc("step.logits", {1, cfg.vocab_size}, Dt::F32);
  w.logits_host.resize(static_cast<size_t>(cfg.vocab_size));
  return w;
}

const CapturedAttention* device_capture(const std::vector<AttentionObserver*>& observers, const Backend* be) {
  const CapturedAttention* capture = nullptr;
  for (const AttentionObserver* o : observers) {
    const auto* c = dynamic_cast<const CapturedAttention*>(o->compares_to());
    if (c && c->backend() == be) capture = c;
  }
  return capture;
}

bool observers_read_rows(const std::vector<AttentionObserver*>& observers, const CapturedAttention* capture) {
  return std::any_of(observers.begin(), observers.end(), [&](const AttentionObserver* o) {
    return o->reads_decode_kv() && !(capture && o->compares_to() == capture);
  });
}

std::vector<float> LlamaDecoder::decode(int token, int position, int step_no, SeqKV& kv, KVPolicy* policy,
                                        const std::vector<AttentionObserver*>& observers,
                                        LlamaWorkspace& w) const {
  step_ops(token, position, step_no, kv, policy, observers, false, w);
  be->download(w.logits, w.logits_host.data());
  be->finish_checks();
  return w.logits_host;
}

int LlamaDecoder::launch(int token, int position, int step_no, SeqKV& kv, KVPolicy* policy,
                         LlamaWorkspace& w) const {
  if (!be->chains_steps() || kv.mirror || !kv.dev || decode_needs_host_rows(policy))
    throw InternalError("decode: chained steps need a chaining backend and a cache without host rows");
  step_ops(token, position, step_no, kv, policy, {}, true, w);
  return be->start_readback(w.logits, w.ids);
}

void LlamaDecoder::record_queries(LlamaWorkspace& w, int slots) const {
  if (!be->records_decode_queries()) throw InternalError("decode: the " + be->name() + " backend records no queries");
  const int64_t rows = static_cast<int64_t>(cfg.num_hidden_layers) * std::max(slots, 1);
  if (w.recorded_q.rows() < rows)
    w.recorded_q = be->alloc("step.recorded_queries", {rows, static_cast<int64_t>(cfg.num_attention_heads) * cfg.head_dim},
                             Dt::F32);
  w.record_slots = std::max(slots, 1);
  w.record_slot = -1;
}

const std::vector<float>& LlamaDecoder::collect(int ticket, LlamaWorkspace& w, int& device_token) const {
  int32_t t = -1;
  be->finish_readback(ticket, w.logits_host.data(), &t);
  device_token = t;
  return w.logits_host;
}

void LlamaDecoder::step_ops(int token, int position, int step, SeqKV& kv, KVPolicy* policy,
                            const std::vector<AttentionObserver*>& observers, bool chain,
                            LlamaWorkspace& w) const {
  const int NH = cfg.num_attention_heads, NKV = cfg.num_key_value_heads, D = cfg.head_dim;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  const AttnLayout lay = layout(1);
  const int32_t pos = position;
  if (token >= 0) {
    check_ids({token});
    const int32_t tok = token;
    be->upload(&tok, w.ids);
    be->upload(&pos, w.pos);
  }
  // The cache's own work due before this step's row (StepQuant::group), outside the step that
  // may be captured: it may lay the cache out anew, and the step's key follows.
  if (kv.dev) be->kv_before_step(kv);
  const SegmentKind gen = SegmentKind::Generated;
  const bool want = !observers.empty();
  // A policy that compresses only at prefill and calibrates (if at all) inside the device's
  // kernel adds no host work to a step.
  const bool acts = policy && policy->acts_on_decode();
  const bool host_side = decode_needs_host_rows(policy) || want;  // per-layer work on the host: no replay
  if (host_side && !kv.mirror) throw InternalError("decode: a policy or observer needs the host KV rows");
  // A recorded step keeps each layer's query after RoPE in its slot (a different row each step:
  // not replayed).
  const bool recording = w.record_slot >= 0;
  if (recording && (host_side || chain || !kv.dev || w.record_slot >= w.record_slots))
    throw InternalError("decode: a recorded step runs on a device cache alone, in a slot record_queries made");
  if (chain && (host_side || !be->chains_steps())) throw InternalError("decode: a chained step with host-side work");
  // On a device cache, a layer where the method would not act this step (acts_at_step), and
  // nothing else reads the host rows, runs on the device alone; the host copies of those layers'
  // new rows are fetched together once the step's layers are launched.
  const ScoreTransform transform = policy ? policy->score_transform() : ScoreTransform{};
  const bool may_defer = acts && kv.dev && !want && transform.kind != ScoreTransform::Kind::Host;
  // An observer that compares the queries with this prefill's capture: the backend may compute
  // the exact attention from the capture, and that observer then needs no rows.
  const CapturedAttention* capture = device_capture(observers, be.get());

  // Observed steps whose observers read no rows (or compare with this capture) and whose
  // policy does nothing on the host: on a backend that defers the taps, the layers run without
  // waiting for the host, their rows come over together after the last layer, and the events
  // are handed over then, layer by layer.
  const bool rows_wanted = observers_read_rows(observers, capture);
  const bool staged = want && kv.dev && !rows_wanted && !decode_needs_host_rows(policy) && be->defers_decode_taps();
  if (staged && w.qkv_layers.empty())
    w.qkv_layers = be->alloc("step.qkv_of_each_layer", {cfg.num_hidden_layers, lay.row_stride}, Dt::F32);

  // Layer l's event, its taps filled (q_dev: the layer's qkv on the backend, q_host on the host),
  // with the rows or the exact attention its observers read, handed to them.
  auto hand_over = [&](int l, LayerTaps& t, const Buffer& q_dev, const float* q_host) {
    ExactAttention exact;
    const bool has_exact =
        capture && be->exact_decode_attention(q_dev, lay, capture->layer_qkv(l), capture->layout(),
                                              rows_from(*kv.host, l, capture->prompt_len()), exact);
    const bool rows = observers_read_rows(observers, has_exact ? capture : nullptr);
    take_positions(*kv.host, l, t);
    std::vector<float> keys(rows ? static_cast<size_t>(NKV) * t.n_max * D : 0, 0.0f), vals(keys.size(), 0.0f);
    std::vector<float> K, V;
    std::vector<int32_t> P;
    for (int h = 0; rows && h < NKV; ++h) {
      kv.host->gather(l, h, K, V, P);
      std::copy(K.begin(), K.end(), keys.begin() + static_cast<size_t>(h) * t.n_max * D);
      std::copy(V.begin(), V.end(), vals.begin() + static_cast<size_t>(h) * t.n_max * D);
    }
    AttentionEvent e = layer_event(t, l, step, &pos, q_host);
    e.k = rows ? keys.data() : nullptr;
    e.v = rows ? vals.data() : nullptr;
    if (has_exact) e.exact = &exact;
    for (AttentionObserver* o : observers) o->on_attention(e);
  };

  auto body = [&] {
    trace::Scope span("step.body", step);
    std::vector<int> deferred;
    be->embed(embed, w.ids, w.h);
    // Each layer's output is checked for NaN / Inf by the next norm_linear, which reads it whole
    // anyway (a device folds the check into that product).
    std::string check;
    for (int l = 0; l < cfg.num_hidden_layers; ++l) {
      const LlamaLayer& L = layers[l];
      be->norm_linear(w.h, L.ln1, eps, w.x, L.qkv_w, or_null(L.qkv_b), w.qkv, check.empty() ? nullptr : &check);
      // A plain step (no host work, no score transform, nothing captured) hands RoPE, the append
      // and attention to the backend as one op, which a device runs as one kernel.
      const bool plain = !host_side && !transform.any() && !recording;
      DecodeContext ctx;
      ctx.layer = l; ctx.step = step; ctx.position = position; ctx.n_heads = NH;
      ctx.n_kv_heads = NKV; ctx.head_dim = D;
      const bool acts_now = acts && (!may_defer || policy->acts_at_step(ctx, kv.host->layer(l)));
      if (plain) {
        be->rope_append_attend(kv, l, w.qkv, lay, w.pos, &pos, &gen, cfg.rope, w.a);
      } else if ((acts && !acts_now) || staged) {
        SeqKV device_only = kv;
        device_only.mirror = false;
        be->rope_append(device_only, l, w.qkv, lay, w.pos, &pos, &gen, 1, cfg.rope);
        deferred.push_back(l);
      } else {
        be->rope_append(kv, l, w.qkv, lay, w.pos, &pos, &gen, 1, cfg.rope);
      }
      if (acts_now) {
        w.qkv_host.resize(static_cast<size_t>(w.qkv.numel()));
        be->download(w.qkv, w.qkv_host.data());
        ctx.q = w.qkv_host.data();
        policy->on_decode_step(ctx, kv.host->layer(l));
        if (kv.dev) be->kv_sync(*kv.dev, *kv.host, l);
      }
      if (staged) {
        be->decode_attention_deferred(w.qkv, lay, kv, l, &transform, w.a, capture != nullptr);
        be->copy_block(w.qkv, 0, 0, w.qkv_layers, l, 0, 1, lay.row_stride);
      } else if (want) {
        LayerTaps t;
        be->decode_attention(w.qkv, lay, kv, l, &transform, w.a, size_taps(*kv.host, l, capture != nullptr, t));
        w.qkv_host.resize(static_cast<size_t>(w.qkv.numel()));
        be->download(w.qkv, w.qkv_host.data());
        hand_over(l, t, w.qkv, w.qkv_host.data());
      } else if (!plain) {
        be->decode_attention(w.qkv, lay, kv, l, &transform, w.a, DecodeTaps{});
      }
      if (recording)
        be->copy_block(w.qkv, 0, lay.q_col, w.recorded_q, static_cast<int64_t>(l) * w.record_slots + w.record_slot, 0, 1,
                       static_cast<int64_t>(NH) * D);
      be->linear(w.a, L.o_w, or_null(L.o_b), w.h, true);
      mlp(L, w.h, w.x, w.gu, w.g);
      check = "text layer " + std::to_string(l) + " output (decode step " + std::to_string(step) + ")";
    }
    be->norm_linear(w.h, norm, eps, w.x, lm_head, nullptr, w.logits, check.empty() ? nullptr : &check);
    if (chain) be->next_token(w.logits, w.ids, w.pos);
    if (!deferred.empty()) be->kv_pull_rows(kv, deferred, &pos, &gen, 1);
    if (staged) {  // the step's events, now that the host store holds its rows
      trace::Scope span("step.staged_taps", step);
      std::vector<float> q_all(static_cast<size_t>(w.qkv_layers.numel()));
      be->download(w.qkv_layers, q_all.data());
      const int L = cfg.num_hidden_layers;
      if (capture) {
        // Put off until the decode hands it over with its other such steps (hand_over_stashed):
        // the taps, positions and generated rows as this step left them, its queries kept on the
        // backend.
        constexpr int kSlots = LlamaWorkspace::kStashSlots;
        if (static_cast<int>(w.stash.size()) == kSlots) hand_over_stashed(w);
        if (w.stash_q.empty())
          w.stash_q = be->alloc("step.stashed_queries", {static_cast<int64_t>(L) * kSlots, lay.row_stride}, Dt::F32);
        const int slot = static_cast<int>(w.stash.size());
        for (int l = 0; l < L; ++l)
          be->copy_block(w.qkv_layers, l, 0, w.stash_q, static_cast<int64_t>(l) * kSlots + slot, 0, 1, lay.row_stride);
        StashedStep st;
        st.step = step;
        st.pos = pos;
        st.observers = observers;
        st.capture = capture;
        st.q = std::move(q_all);
        st.layers.resize(static_cast<size_t>(L));
        auto keep = [&](int l) {
          StashedStep::Layer& x = st.layers[static_cast<size_t>(l)];
          be->collect_deferred(kv, l, &transform, size_taps(*kv.host, l, true, x));
          take_positions(*kv.host, l, x);
          x.extra = rows_from(*kv.host, l, capture->prompt_len());
        };
        trace::Scope keep_span("step.stash_layers");
        keep(0);  // (the first layer's collect fetches every layer's taps)
        parallel_for(L - 1, 8, [&](int i) { keep(i + 1); });
        w.stash.push_back(std::move(st));
        return;
      }
      // (the first layer's collect fetches every layer's taps; the others are the host's work alone)
      each_layer(observers, [&](int l) {
        LayerTaps t;
        be->collect_deferred(kv, l, &transform, size_taps(*kv.host, l, false, t));
        hand_over(l, t, w.qkv_layers.row_view(l, 1), q_all.data() + static_cast<size_t>(l) * lay.row_stride);
      });
    }
  };
  // Replay is allowed only for steps with no host-side work; the key changes whenever the
  // device cache is laid out anew, and differs between chained and unchained steps.
  uint64_t key = 0;
  if (!host_side && kv.dev && !recording) key = (kv.dev->version() << 1) | (chain ? 1u : 0u);
  be->run_step(w.step, key, body);
}

}  // namespace kvlens
