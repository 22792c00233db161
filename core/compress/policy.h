// The one hook point between the model and KV-cache compression. The model calls these and
// nothing else; policies never edit model code.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/kv_store.h"
#include "core/prefill_attention.h"

namespace kvlens {

// What a policy may read when it compresses a layer after prefill.
struct PrefillContext {
  int layer = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int prompt_len = 0;
  // The prompt's attention, from which probs() recomputes this layer's causal probabilities on
  // demand and reduce() reduces them where they are.
  const PrefillAttention* attention = nullptr;
  const std::vector<SegmentKind>* token_kinds = nullptr;  // [prompt_len]
  const std::vector<int>* token_ids = nullptr;            // [prompt_len]
  // The backend the model runs on, for methods that compute on it (null: on the host). Called
  // from one thread at a time.
  Backend* backend = nullptr;
  // The decode's own device cache (null on the host), holding the prompt's rows, for ops that
  // read or merge them there (Backend::quantize_rows, kv_lookm_merge) when the
  // store's segments are layout_only.
  DeviceKV* device = nullptr;

  // This layer's probabilities [n_heads][prompt_len][prompt_len], or null when prefill kept no
  // attention (hold the pointer while reading them).
  std::shared_ptr<const std::vector<float>> probs() const {
    return attention ? attention->probs(layer) : nullptr;
  }
};

struct DecodeContext {
  int layer = 0;
  int step = 0;
  int position = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  const float* q = nullptr;  // [n_heads][head_dim] of the new token
};

class KVPolicy {
 public:
  virtual ~KVPolicy() = default;
  virtual std::string name() const = 0;
  // Whether on_prefill needs the layer's prompt attention (probs/scores in PrefillContext).
  virtual bool needs_prefill_attention() const { return false; }
  // Whether on_prefill / on_prefill_layer read the rows' values on the host. One that selects
  // rows by the prompt's attention and positions, or reads and changes rows only through the
  // backend's ops on the device cache (PrefillContext::device: quantize_rows, kv_lookm_merge),
  // says false: on a device backend it then acts on the store's layout alone
  // (layout_only segments) and the device gathers the kept rows, so the prompt's rows never
  // cross to the host.
  virtual bool reads_rows() const { return true; }
  // The Hadamard block whose rotation the keys' codes this method's prefill makes without host
  // rows are of (CodeLayout::k_rotation); 0: none. A device reads such codes only while it rotates
  // the query by the same blocks (StepQuant::rotation); a decode whose device does not brings the
  // prompt's rows to the host first, and the method quantizes those.
  virtual int rotated_keys(int head_dim) const { return 0; }
  // The storage of dense rows this policy asks for instead of the run's (the decode option
  // kv_storage, fp16 by default); nullopt = the run's. `full:storage=fp32` keeps exact rows.
  virtual std::optional<RowStorage> row_storage() const { return std::nullopt; }
  // Called once the whole prompt is in the store, with one context per layer (so layer
  // budgets may depend on every layer, as VL-Cache and PyramidKV need). The default compresses
  // each layer on its own through on_prefill_layer.
  virtual void on_prefill(const std::vector<PrefillContext>& layers, KVStore& store) {
    for (const PrefillContext& c : layers) on_prefill_layer(c, store.layer(c.layer));
  }
  virtual void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) {}
  // Called after the new token's K/V were appended, before attention reads the store.
  virtual void on_decode_step(const DecodeContext& ctx, LayerKV& layer) {}
  // Whether on_decode_step may change the store. A method that compresses only at prefill says
  // false: its decode steps then never call it, and a device cache needs no host copy of the
  // rows while decoding (the steps run on the device alone, replayed and chained).
  virtual bool acts_on_decode() const { return true; }
  // The decode-time action as data a device may run in its own steps instead of on_decode_step
  // (core/backend.h): what on_decode_step does to each new row, when that is all it does. The
  // default: none (the hook is the only form).
  virtual StepQuant step_quant(int head_dim) const { return {}; }
  // Whether on_decode_step may change the store within a decode of `new_tokens` generated
  // tokens. A method that acts only after some steps (ZipCache's first gap) answers exactly: a
  // shorter decode then runs as one that acts at prefill alone.
  virtual bool acts_on_decode_within(int new_tokens) const { return acts_on_decode(); }
  // Whether on_decode_step would change `layer` at this step, asked before the new token's row
  // is appended (`layer` does not hold it yet). A method that answers exactly lets a device's
  // decode loop skip a step's host work where it would not act (the host copy of the new row is
  // then fetched after the step); the default answers acts_on_decode().
  virtual bool acts_at_step(const DecodeContext& ctx, const LayerKV& layer) const { return acts_on_decode(); }
  // Optional transform of one query head's pre-softmax scores over the keys [n_k] the store
  // holds (kinds[j] tells each key's segment). Calibration lives here.
  virtual bool has_score_transform() const { return false; }
  virtual void transform_scores(int layer, int head, float* scores, const SegmentKind* kinds,
                                int n_k) const {}
  // The same transform as data for a backend (core/backend.h): what kind it is, so a device can
  // apply a calibration inside its attention kernel, and transform_scores as its host form. The
  // default says Host when has_score_transform(); a method whose transform is the calibration
  // the kernels know returns Calibrate with its τ1, τ2. Valid while the policy lives.
  virtual ScoreTransform score_transform() const {
    ScoreTransform t;
    if (!has_score_transform()) return t;
    t.kind = ScoreTransform::Kind::Host;
    t.apply = [this](int layer, int head, float* scores, const SegmentKind* kinds, int n_k) {
      transform_scores(layer, head, scores, kinds, n_k);
    };
    return t;
  }
};

// Whether `policy` (null = none) transforms scores in a way only the host computes: its decode
// attention then needs the scores and the rows on the host.
inline bool transforms_scores_on_host(const KVPolicy* policy) {
  return policy && policy->score_transform().kind == ScoreTransform::Kind::Host;
}
// Whether decode steps with `policy` (null = none) need the host store's rows: the policy edits
// the store while decoding, or transforms scores on the host.
inline bool decode_needs_host_rows(const KVPolicy* policy) {
  return policy && (policy->acts_on_decode() || transforms_scores_on_host(policy));
}

// The policy a decode of `new_tokens` tokens hands its steps: `policy`, or null when it would not
// act within them (acts_on_decode_within) and transforms no scores, so that the steps need no
// host rows.
inline KVPolicy* step_policy(KVPolicy* policy, int new_tokens) {
  return policy && !policy->acts_on_decode_within(new_tokens) && !policy->has_score_transform() ? nullptr : policy;
}

// Who reads a decode's steps: no observer; observers the device serves where the rows are (they
// read no keys and values, or compare with a capture the device computes the exact attention
// from, their events handed over after the step: Backend::defers_decode_taps); others.
enum class StepReaders { None, Device, Host };

// What a decode's device runs in its steps for the step policy `steps` (null = none): its
// step_quant() where `backend` runs it and it is all the steps need — no score transform
// applies, and no observer reads the steps (`readers`), or only ones the device serves while
// each row is quantized (or coded, or its keys rotated) on its own where it is appended, or in
// KIVI's groups (not ZipCache's streamed gaps, whose steps the host still runs when observed).
// The decode then hands its steps no policy.
inline StepQuant device_step_quant(const KVPolicy* steps, const Backend& backend, StepReaders readers, int head_dim) {
  if (!steps || readers == StepReaders::Host || steps->has_score_transform()) return {};
  const StepQuant q = steps->step_quant(head_dim);
  if (!q.any() || !backend.quantizes_steps(q, head_dim)) return {};
  const bool served = q.zip.gap == 0;
  return readers == StepReaders::None || served ? q : StepQuant{};
}

// The storage of dense rows a decode with `policy` (null = none) uses: what the policy asks
// for, else the run's `run` setting. The decode loop calls KVStore::set_row_storage with it
// before the policy's on_prefill.
inline RowStorage decode_row_storage(const KVPolicy* policy, RowStorage run) {
  const std::optional<RowStorage> asked = policy ? policy->row_storage() : std::nullopt;
  return asked ? *asked : run;
}

}  // namespace kvlens
