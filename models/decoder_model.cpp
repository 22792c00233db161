#include "models/decoder_model.h"

#include <sys/stat.h>

#include <algorithm>
#include <random>

#include "core/errors.h"
#include "kernels/backends.h"
#include "kernels/cpu/ops.h"
#include "core/trace.h"

namespace kvlens {

using model_detail::in_model;
using model_detail::ms_since;

namespace model_detail {

std::string need_prefix(const WeightStore& ws, const std::vector<std::string>& prefixes, const std::string& probe,
                        const std::string& what) {
  for (const auto& p : prefixes)
    if (ws.has(p + probe)) return p;
  std::string tried;
  for (const auto& x : prefixes) tried += (tried.empty() ? "'" : ", '") + x + probe + "'";
  throw InputError(ws.dir() + ": no " + what + " weights (looked for " + tried + ")");
}

void check_model_dir(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw InputError(dir + ": model directory does not exist");
}

Tokenizer image_tokenizer(const std::string& dir, int image_token_id) {
  Tokenizer t = Tokenizer::load(dir, image_token_id);
  if (t.image_token_id() != image_token_id)
    throw InputError(dir + ": the tokenizer's image token id " + std::to_string(t.image_token_id()) +
                     " is not config.json's image_token_id " + std::to_string(image_token_id));
  return t;
}

std::string first_present(const WeightStore& ws, const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (ws.has(n)) return n;
  return "";
}

}  // namespace model_detail

namespace {

int sample(const std::vector<float>& logits, const GenerateOptions& opt, std::mt19937_64& rng) {
  if (opt.temperature <= 0.0f)
    return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<float> p(logits);
  for (float& x : p) x /= opt.temperature;
  cpu::softmax_rows(p.data(), 1, static_cast<int>(p.size()));
  std::vector<int> order(p.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  double cum = 0.0;
  size_t keep = 0;
  while (keep < order.size()) {
    cum += p[order[keep++]];
    if (cum >= opt.top_p) break;
  }
  const double u = std::uniform_real_distribution<double>(0.0, cum)(rng);
  double acc = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    acc += p[order[i]];
    if (u < acc) return order[i];
  }
  return order[keep - 1];
}

// softmax(logits)[tok] (no copy of the row: this runs once a token on the host).
float chosen_prob(const std::vector<float>& logits, int tok) {
  return cpu::softmax_at(logits.data(), static_cast<int>(logits.size()), tok);
}

}  // namespace

void DecoderModel::load_decoder(const WeightStore& ws, const std::string& tp, const std::string& lm_head, bool tied,
                                const BackendOptions& backend) {
  be_ = make_backend(backend);
  for (Op op : {Op::Linear, Op::RmsNorm, Op::LayerNorm, Op::Add, Op::BiasAct, Op::GatedAct, Op::Rope,
                Op::Embed, Op::CopyRows, Op::Attention, Op::KVAppend, Op::DecodeAttention})
    if (!be_->supports(op))
      throw InputError("backend " + be_->name() + " has no " + op_name(op) + " op, which the model needs");
  text_ = LlamaDecoder::load(ws, tp, lm_head, tied, text_cfg_, be_);
  ModelInfo& f = info_;
  f.n_layers = text_cfg_.num_hidden_layers;
  f.n_heads = text_cfg_.num_attention_heads;
  f.n_kv_heads = text_cfg_.num_key_value_heads;
  f.head_dim = text_cfg_.head_dim;
  f.hidden = text_cfg_.hidden_size;
  f.intermediate = text_cfg_.intermediate_size;
  f.vocab = text_cfg_.vocab_size;
  f.matrix_bytes = dt_size(text_.layers.at(0).qkv_w.dt);
}

void DecoderModel::check_prompt_length(int T, int n_visual) const {
  if (T + 1 > text_cfg_.max_context())
    throw InputError("prompt is " + std::to_string(T) + " tokens (" + std::to_string(n_visual) + " visual); the model holds " +
                     std::to_string(text_cfg_.max_context()) + " positions (" +
                     (text_cfg_.max_context() < text_cfg_.max_position_embeddings ? "its sliding_window"
                                                                                 : "its max_position_embeddings") +
                     ")");
}

void DecoderModel::prefill_embedded(PrefillState& st, Buffer x, bool keep_attention,
                                    const std::vector<AttentionObserver*>& observers) const {
  const int L = text_cfg_.num_hidden_layers, NKV = text_cfg_.num_key_value_heads, D = text_cfg_.head_dim;
  st.store = KVStore(L, NKV, D);
  std::unique_ptr<DeviceKV> dev = be_->kv_create(L, NKV, D);
  st.capture.keep = keep_attention;
  st.store_rows = !dev || !observers.empty();
  SeqKV kv{&st.store, dev.get(), st.store_rows};
  const std::vector<int32_t> rope = rope_positions(st);
  st.logits = in_model(dir_, [&] { return text_.prefill(x, st.kinds, kv, observers, &st.capture, rope); });
  if (dev && !st.store_rows) be_->kv_hydrate(*dev, st.store, false);  // the layout alone
  st.device = std::move(dev);
}

int64_t DecoderModel::decode_weight_bytes() const {
  int64_t b = text_.norm.bytes() + text_.lm_head.bytes() + text_.embed.bytes() / std::max<int64_t>(text_.embed.rows(), 1);
  for (const LlamaLayer& L : text_.layers)
    for (const Buffer* x : {&L.ln1, &L.ln2, &L.qkv_w, &L.qkv_b, &L.o_w, &L.o_b, &L.gate_up_w, &L.down_w})
      b += x->empty() ? 0 : x->bytes();
  return b;
}

std::vector<PrefillContext> DecoderModel::prefill_contexts(const PrefillState& st) const {
  std::vector<PrefillContext> r;
  const int L = text_cfg_.num_hidden_layers;
  for (int l = 0; l < L; ++l) {
    PrefillContext c;
    c.layer = l;
    c.n_layers = L;
    c.n_heads = text_cfg_.num_attention_heads;
    c.n_kv_heads = text_cfg_.num_key_value_heads;
    c.head_dim = text_cfg_.head_dim;
    c.prompt_len = static_cast<int>(st.ids.size());
    if (st.capture.keep) c.attention = st.capture.attention.get();
    c.token_kinds = &st.kinds;
    c.token_ids = &st.ids;
    if (st.device) c.backend = be_.get();  // a device backend: methods may compute there (decode adds its cache)
    r.push_back(c);
  }
  return r;
}

DecodeResult DecoderModel::decode(const PrefillState& st, KVPolicy* policy, const GenerateOptions& opt,
                                const std::vector<AttentionObserver*>& observers, KVStore* compressed) const {
  DecodeResult r;
  auto check = [&](int done) {
    if (opt.keep_going && !opt.keep_going(done))
      throw Cancelled("decode cancelled after " + std::to_string(done) + " tokens");
  };
  check(0);
  KVStore store = st.store;
  const RowStorage rows = decode_row_storage(policy, opt.kv_storage);
  if (st.device && rows == RowStorage::Fp32)
    throw InputError(std::string("fp32 KV rows (") + (policy && policy->row_storage() ? "full:storage=fp32" : "--kv-storage fp32") +
                     ") need --backend cpu: the " + be_->name() + " backend's KV cache holds fp16 rows");
  std::unique_ptr<DeviceKV> dev = st.device ? st.device->clone() : nullptr;
  // The host store carries rows while decoding for a policy that edits the store or transforms
  // scores on the host, or an observer (decode_needs_host_rows) until the last step one reads.
  // Its prompt rows come from the device only when the host reads them: a policy whose prefill
  // compression reads rows (quantizes, merges), or an observer that reads keys and values and
  // does not compare with a capture (the device computes that comparison from the capture).
  // The policy as the steps see it: none when it would not act within them (step_policy).
  KVPolicy* steps = step_policy(policy, opt.max_new_tokens);
  const int observed = observed_decode_steps(observers);
  // A method whose decode-time action the device runs itself (per-token quantization of each
  // new row) leaves its steps nothing to do on the host: they run as a prefill-only method's.
  // (an observed decode keeps it where every observer is served on the device, as the steps' staged taps serve them)
  const StepReaders readers = observed == 0 ? StepReaders::None
                              : be_->defers_decode_taps() && !observers_read_rows(observers, device_capture(observers, be_.get()))
                                  ? StepReaders::Device
                                  : StepReaders::Host;
  StepQuant device_quant = dev ? device_step_quant(steps, *be_, readers, text_cfg_.head_dim) : StepQuant{};
  device_quant.zip.n_heads = text_cfg_.num_attention_heads;  // (the probes' queries, StepQuant::zip)
  device_quant.zip.scale = text_.attention_scale();          // (and the scale they attend at)
  if (device_quant.any()) steps = nullptr;
  const bool mirror = !dev || decode_needs_host_rows(steps) || observed > 0;
  // (Keys' codes of rotated rows that the device will not read: the host's rows, quantized there.)
  const int rotated = policy ? policy->rotated_keys(text_cfg_.head_dim) : 0;
  const bool reads_rows =
      (policy && (policy->reads_rows() || decode_needs_host_rows(steps) || (dev && rotated && rotated != device_quant.rotation))) ||
      std::any_of(observers.begin(), observers.end(),
                  [](const AttentionObserver* o) { return o->reads_decode_kv() && !o->compares_to(); });
  if (dev && reads_rows && !store.has_rows()) be_->kv_hydrate(*dev, store, true);
  store.set_row_storage(rows);
  SeqKV kv{&store, dev.get(), mirror};
  auto cache_bytes = [&] { return dev ? dev->bytes() : store.bytes(); };
  // The decode rows' room and storage first: a device that rotates the query for rotated keys
  // (StepQuant::rotation) stores the prompt's rotated codes as they are when the policy's
  // compression is synced.
  if (dev) be_->kv_reserve(*dev, opt.max_new_tokens, device_quant);
  const auto t0 = std::chrono::steady_clock::now();
  if (policy) {
    trace::Scope span("method.compress");
    if (policy->needs_prefill_attention() && !st.capture.keep)
      throw InternalError("policy '" + policy->name() + "' needs the prefill attention, which was not kept");
    std::vector<PrefillContext> cs = prefill_contexts(st);
    for (PrefillContext& c : cs) c.device = dev.get();  // the decode's own copy of the prompt's rows
    {
      trace::Scope on_prefill("method.on_prefill");
      policy->on_prefill(cs, store);
    }
    if (dev) be_->kv_sync(*dev, store, -1);
  }
  r.compress_ms = ms_since(t0);
  r.bytes_after_prefill = cache_bytes();
  if (compressed) *compressed = store.without_rows();
  const auto t1 = std::chrono::steady_clock::now();
  std::mt19937_64 rng(opt.seed);
  std::vector<float> logits = st.logits;
  r.first_logits = logits;
  int pos = static_cast<int>(st.ids.size());
  const auto& eos = text_cfg_.eos_token_ids;
  LlamaWorkspace ws = text_.workspace();
  int tok = -1;
  KVBytes before_ahead;  // the cache's bytes before the latest step launched ahead
  bool dropped = false;
  // Takes the token of generated position `step` from `logits`; true when the caption ends there.
  auto take = [&](int step) {
    if (opt.keep_step_logits) r.step_logits.push_back(logits);
    tok = sample(logits, opt, rng);
    r.chosen_probs.push_back(chosen_prob(logits, tok));
    r.generated_ids.push_back(tok);
    const bool is_eos = std::find(eos.begin(), eos.end(), tok) != eos.end() || tok == tok_.eos_id();
    return (opt.stop_at_eos && is_eos) || step + 1 >= opt.max_new_tokens ||
           pos + 1 > text_cfg_.max_context();
  };
  // Forwards from `s0` on, chained: forward `step` consumes generated token `step` (taken, at
  // `pos`). While the host waits for its logits, the next forward is already running on the
  // device from the token the device chose itself; it is launched whenever the caption cannot
  // end before it for a reason known in advance.
  auto chain_from = [&](int s0) {
    trace::Scope span("decode.chained", s0);
    bool ahead = false;
    try {
      check(s0 + 1);
      int ticket = in_model(dir_, [&] { return text_.launch(tok, pos, s0, kv, steps, ws); });
      ++pos;
      for (int step = s0;; ++step) {
        ahead = step + 2 < opt.max_new_tokens && pos + 1 <= text_cfg_.max_context();
        int next = -1;
        if (ahead) {
          before_ahead = cache_bytes();
          next = in_model(dir_, [&] { return text_.launch(-1, pos, step + 1, kv, steps, ws); });
        }
        int device_tok = -1;
        logits = in_model(dir_, [&] { return text_.collect(ticket, ws, device_tok); });
        const bool end = take(step + 1);
        if (device_tok != tok)
          throw InternalError("decode: the device chose token " + std::to_string(device_tok) + " at step " +
                              std::to_string(step + 1) + ", the host " + std::to_string(tok));
        if (end) break;
        if (next < 0) throw InternalError("decode: step " + std::to_string(step + 1) + " was not launched ahead");
        check(step + 2);
        ticket = next;
        ++pos;
      }
    } catch (...) {
      try {
        be_->drop_readbacks();
      } catch (...) {
      }
      throw;
    }
    if (ahead) {  // the caption ended at an EOS: the step launched past it is not part of it
      be_->drop_readbacks();
      dropped = true;
    }
  };
  // (!mirror: a device cache, and no observer or policy that needs the host rows)
  const bool can_chain = opt.chain_steps && opt.temperature <= 0.0f && be_->chains_steps();
  const bool chain = can_chain && !mirror;
  r.chained = chain && opt.max_new_tokens > 0;
  if (opt.max_new_tokens <= 0) {
    // nothing to generate
  } else if (!chain) {
    // Positions of the steps run on the device alone while the host store still carries rows:
    // their rows are fetched together before the next observed step.
    std::vector<int32_t> pending;
    // A step whose observers read its probabilities alone runs on the device alone too, on a
    // backend that records its queries there: its events come once the caption is done.
    // (device_alone: a device cache whose host rows only observers read, so steps may drop them)
    const bool device_alone = dev && mirror && !decode_needs_host_rows(steps);
    // (not over rotated keys, nor over zipped gaps; over KIVI's groups until the first rows are
    // quantized into groups: the steps recorded until then are handed over first, as they saw
    // the cache, and the later ones are staged, or chained past the last observed step)
    bool can_record =
        device_alone && be_->records_decode_queries() && device_quant.zip.gap == 0 && device_quant.rotation == 0 &&
        std::any_of(observers.begin(), observers.end(), [](const AttentionObserver* o) { return o->reads_probabilities_only(); });
    std::vector<int> rec_steps;
    std::vector<int32_t> rec_pos;
    double handover_ms = 0;
    // The steps recorded so far handed over now, while the cache is as they saw it.
    auto hand_over_now = [&] {
      const auto t = std::chrono::steady_clock::now();
      in_model(dir_, [&] { text_.hand_over_recorded(kv, rec_steps, rec_pos, steps, observers, ws); });
      rec_steps.clear();
      rec_pos.clear();
      handover_ms += ms_since(t);
    };
    if (can_record) text_.record_queries(ws, opt.max_new_tokens);
    for (int step = 0; !take(step); ++step) {
      check(step + 1);
      if (device_alone && can_chain && step >= observed) {
        // Past the last step an observer reads, the rest of the caption is chained on the device
        // alone; the observed steps' events are handed over after it (the recorded ones before
        // it over KIVI's groups, which the chained steps may quantize).
        if (device_quant.group > 0) hand_over_now();
        ws.record_slot = -1;
        kv.mirror = false;
        r.chained = true;
        chain_from(step);
        break;
      }
      std::vector<AttentionObserver*> seen = decode_observers(observers, step);
      if (can_record && device_quant.group > 0 && be_->kv_quantizes_before_step(kv)) {
        hand_over_now();
        can_record = false;
      }
      const bool record = can_record && !seen.empty() &&
                          std::all_of(seen.begin(), seen.end(), [](const AttentionObserver* o) {
                            return o->reads_probabilities_only();
                          });
      ws.record_slot = record ? static_cast<int>(rec_steps.size()) : -1;
      if (record) {
        rec_steps.push_back(step);
        rec_pos.push_back(pos);
        seen.clear();
      }
      if (device_alone) {
        // Past the last observed step, a device cache stops carrying host rows that no one reads
        // any more: the remaining steps run on the device alone (and are replayed). A step no
        // observer reads before that runs so too.
        kv.mirror = !seen.empty();  // (an observer reads only steps below `observed`)
        if (kv.mirror && !pending.empty()) {
          std::vector<int> all(static_cast<size_t>(store.n_layers()));
          for (int l = 0; l < store.n_layers(); ++l) all[static_cast<size_t>(l)] = l;
          const std::vector<SegmentKind> gen(pending.size(), SegmentKind::Generated);
          be_->kv_pull_rows(kv, all, pending.data(), gen.data(), static_cast<int>(pending.size()));
          pending.clear();
        }
        if (!kv.mirror && step < observed) pending.push_back(pos);
      }
      trace::Scope span("decode.step", step);
      logits = in_model(dir_, [&] { return text_.decode(tok, pos, step, kv, steps, seen, ws); });
      ++pos;
    }
    ws.record_slot = -1;
    const auto t2 = std::chrono::steady_clock::now();
    trace::Scope span("decode.hand_over");
    in_model(dir_, [&] {
      text_.hand_over_stashed(ws);
      text_.hand_over_recorded(kv, rec_steps, rec_pos, steps, observers, ws);
    });
    r.handover_ms = handover_ms + ms_since(t2);
  } else if (!take(0)) {
    chain_from(0);
  }
  r.decode_ms = ms_since(t1);
  r.bytes_final = dropped ? before_ahead : cache_bytes();
  r.text = tok_.decode(r.generated_ids);
  return r;
}

PrefillState DecoderModel::prefill(const RGBImage& img, const std::string& prompt, const std::string& templ,
                                   bool keep_attention, const std::vector<AttentionObserver*>& observers) const {
  return prefill_image(img, prompt, templ, keep_attention, observers);
}

std::vector<int> DecoderModel::prompt_ids(const std::string& prompt, const std::string& templ,
                                          const VisualLayout& image) const {
  if (templ.find("<image>") == std::string::npos)
    throw InputError("prompt template '" + templ + "' has no <image> marker");
  return tok_.encode_prompt(templ, prompt, image.n_tokens);
}

PrefillState DecoderModel::prefill_features(const ImageFeatures& image, const std::string& prompt,
                                            const std::string& templ, bool keep_attention,
                                            const std::vector<AttentionObserver*>& observers) const {
  return prefill_image_tokens(image, prompt_ids(prompt, templ, image.layout), keep_attention, observers);
}

PrefillState DecoderModel::prefill_image(const RGBImage& img, const std::string& prompt, const std::string& templ,
                                         bool keep_attention, const std::vector<AttentionObserver*>& observers) const {
  const auto t0 = std::chrono::steady_clock::now();
  const Tensor px = pixel_values(img);
  const double preprocess_ms = model_detail::ms_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  const ImageFeatures feats = encode_image(px, visual_layout(img.width, img.height));
  be_->synchronize();
  const double vision_ms = model_detail::ms_since(t1);
  PrefillState st = prefill_features(feats, prompt, templ, keep_attention, observers);
  st.preprocess_ms = preprocess_ms;
  st.vision_ms = vision_ms;
  return st;
}

PrefillState DecoderModel::prefill_image_tokens(const ImageFeatures& image, std::vector<int> ids, bool keep_attention,
                                                const std::vector<AttentionObserver*>& observers) const {
  PrefillState st;
  const auto t1 = std::chrono::steady_clock::now();
  const Buffer& feats = image.features;
  st.layout = image.layout;
  st.n_visual = image.layout.n_tokens;
  st.ids = std::move(ids);
  const int T = static_cast<int>(st.ids.size());
  check_prompt_length(T, st.n_visual);
  const int H = text_cfg_.hidden_size, img_id = tok_.image_token_id();
  if (feats.shape != std::vector<int64_t>{st.n_visual, H})
    throw InputError("image features have shape " + feats.shape_str() + ", the model needs [" +
                     std::to_string(st.n_visual) + "," + std::to_string(H) + "]");
  const auto n_image_ids = std::count(st.ids.begin(), st.ids.end(), img_id);
  if (n_image_ids != st.n_visual)
    throw InputError("prompt holds " + std::to_string(n_image_ids) + " image tokens, the image gives " +
                     std::to_string(st.n_visual) + " features (one <image> marker is expected, in the template)");
  // Text tokens through the embedding table, then each run of image tokens replaced by the
  // next image features.
  st.kinds.resize(T);
  int seen = 0;
  for (int t = 0; t < T; ++t) {
    if (st.ids[t] == img_id) {
      st.kinds[t] = SegmentKind::Visual;
      ++seen;
    } else {
      st.kinds[t] = seen ? SegmentKind::PostVisionText : SegmentKind::System;
    }
  }
  Buffer x = text_.embed_tokens(st.ids);
  x.name = "prompt_embeds";
  int used = 0;
  for (int t = 0; t < T;) {
    if (st.ids[t] != img_id) {
      ++t;
      continue;
    }
    int e = t;
    while (e < T && st.ids[e] == img_id) ++e;
    be_->copy_block(feats, used, 0, x, t, 0, e - t, H);
    used += e - t;
    t = e;
  }
  prefill_embedded(st, std::move(x), keep_attention, observers);
  st.prefill_ms = ms_since(t1);
  return st;
}

}  // namespace kvlens
