// Llama decoder (HF LlamaForCausalLM): RMSNorm, RoPE, GQA attention, SiLU-gated MLP, lm_head,
// built once on the backend interface (core/backend.h). q/k/v and gate/up are one matrix each
// ([q; k; v] and [gate; up] stacked along rows), so a layer is four matrix products.
// Attention in decode reads the KV cache as it is; the policy and observers are called at one
// hook point each.
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <utility>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/kv_store.h"
#include "core/observer.h"
#include "core/compress/policy.h"
#include "models/config.h"
#include "models/model.h"
#include "models/safetensors.h"

namespace kvlens {

struct LlamaLayer {
  Buffer ln1, ln2;      // fp32 [hidden]
  Buffer qkv_w, qkv_b;  // [q_dim + 2·kv_dim][hidden] (bias empty unless qkv_bias)
  Buffer o_w, o_b;      // [hidden][q_dim]
  Buffer gate_up_w;     // [2·intermediate][hidden]
  Buffer down_w;        // [hidden][intermediate]
};

class CapturedAttention;

// What a decode layer's event carries of its step: [n_heads][n_max] scores, raw scores (before
// the score transform) and probabilities, the [n_heads][head_dim] output (raw and out empty unless
// the step compares with a capture), and the rows' positions and kinds ([n_kv_heads][n_max], −1
// past a head's rows).
struct LayerTaps : RecordedAttention {
  std::vector<float> raw, out;
};

// An observed decode step whose events wait for its exact attention (LlamaDecoder::
// hand_over_stashed): what its observers are given, as the step left it. Per layer its taps and
// its generated rows.
struct StashedStep {
  int step = 0;
  int32_t pos = 0;
  std::vector<AttentionObserver*> observers;
  const CapturedAttention* capture = nullptr;
  std::vector<float> q;  // every layer's qkv row, [layers][row stride]
  struct Layer : LayerTaps {
    ExtraRows extra;
  };
  std::vector<Layer> layers;
};

// The capture on backend `be` that an observer among `observers` compares its decode queries
// with (AttentionObserver::compares_to), or null: the backend then computes their exact
// attention from it and gathers no rows for them.
const CapturedAttention* device_capture(const std::vector<AttentionObserver*>& observers, const Backend* be);
// Whether an observer among `observers` reads a decode step's keys and values from the host
// rows: it reads them and does not compare with `capture` itself (null: none on the backend).
bool observers_read_rows(const std::vector<AttentionObserver*>& observers, const CapturedAttention* capture);

// The buffers of one sequence's decode steps, allocated once: every step runs on the same
// buffers, so a device backend can capture a step once and replay it.
struct LlamaWorkspace {
  Buffer h, x, qkv, a, gu, g, ids, pos, logits;
  Buffer qkv_layers;  // each layer's qkv of an observed step whose events come at its end
  // Decode queries recorded for later (Backend::records_decode_queries): each layer's q after RoPE,
  // [layers][slots][n_heads · head_dim] (record_queries); a step with record_slot ≥ 0 writes its
  // queries to that slot.
  Buffer recorded_q;
  int record_slots = 0, record_slot = -1;
  // Observed steps that compare with a capture, put off until the decode hands them over
  // (LlamaDecoder::hand_over_stashed); their queries on the backend, [layers][kStashSlots][row].
  static constexpr int kStashSlots = 8;
  std::vector<StashedStep> stash;
  Buffer stash_q, exact_q;  // (exact_q: the queries of one call of hand_over_stashed)
  std::vector<float> qkv_host, logits_host;
  std::unique_ptr<StepCache> step;
};

// The prompt's attention of a prefill that was asked to keep it. Per layer it keeps what the
// layer's q/k/v projection read (the normalised input, in the model's dtype: a third of q, k and
// v in fp32 for MHA at fp32, a sixth at fp16) with the projection's weights (shared, not copied),
// and recomputes the layer's q, k, v after RoPE with the prefill's own ops when asked: the same
// values bit for bit, so the probabilities are the ones the prefill computed. The q/k/v of the
// layers recomputed most recently (kept_slots of them: every layer of a small model, whose decode
// steps compare with each layer in turn), and the kRecent layers' probabilities asked for most
// recently (host), stay for the next caller.
class CapturedAttention final : public PrefillAttention {
 public:
  CapturedAttention(std::shared_ptr<Backend> be, const AttnLayout& lay, Dt out_dt, int n_layers, const Rope& rope,
                    const Buffer& positions);
  // Keeps layer `layer`'s projection input x [T][hidden] (copied) and its weights (shared).
  void keep_layer(int layer, const Buffer& x, const Buffer& qkv_w, const Buffer& qkv_b);

  int n_layers() const override { return static_cast<int>(layers_.size()); }
  int n_heads() const override { return lay_.n_heads; }
  int prompt_len() const override { return lay_.T; }
  std::shared_ptr<const std::vector<float>> probs(int layer) const override;
  void reduce(int layer, const AttentionReduction& r) const override;
  std::shared_ptr<const std::vector<double>> column_sums(int layer, const std::vector<int>& queries) const override;
  // The layers' q/k/v recomputed in turn into one buffer, once a layer for every set, and reduced
  // there, every reduction queued before one wait (Backend::attention_reduce_later); kept as
  // reduce would keep them.
  using PrefillAttention::prepare;
  void prepare(const std::vector<int>& layers, const std::vector<QueryRows>& sets) const override;
  // How many layer reductions the capture has run on its backend (prepare's included).
  int64_t reductions_run() const {
    std::lock_guard<std::shared_mutex> lock(mu_);
    return runs_;
  }
  // How many times a layer's q/k/v has been recomputed for layer_qkv and the reductions.
  int64_t recomputes_run() const {
    std::lock_guard<std::shared_mutex> lock(mu_);
    return recomputes_;
  }
  int64_t capture_bytes() const override;
  int64_t cached_bytes() const override;
  // Layer `layer`'s q, k and v (fp32 [T][row stride], after RoPE), recomputed or kept from a
  // recent call; the buffer stays valid while the caller holds it. Its layout, and the backend
  // that holds it.
  Buffer layer_qkv(int layer) const;
  const AttnLayout& layout() const { return lay_; }
  const Backend* backend() const { return be_.get(); }
  // The most layers' q/k/v kept at once (a caller asking for more at a time holds them itself):
  // as many as kSlotBytes holds, at least kSlots, at most every layer. One layer's q/k/v is
  // T × row_stride fp32.
  static constexpr size_t kSlots = 2;
  static constexpr int64_t kSlotBytes = int64_t{64} << 20;
  static int64_t kept_slots(int64_t n_layers, int64_t T, int64_t row_stride);

 private:
  static constexpr size_t kRecent = 2;
  struct Layer {
    Buffer x, w, b;
  };
  std::shared_ptr<Backend> be_;
  AttnLayout lay_;
  Dt out_dt_;
  Rope rope_;
  Buffer pos_;
  std::vector<Layer> layers_;
  // (shared: column_sums finding a kept reduction; every other use exclusive)
  mutable std::shared_mutex mu_;
  mutable std::vector<std::pair<int, Buffer>> slots_;  // recomputed q/k/v, most recent first
  mutable std::vector<std::pair<int, std::shared_ptr<const std::vector<float>>>> recent_;
  // The latest reductions' results by layer and query rows (a method asks the same of a layer
  // once for each KV head or query head it scores; the run's diagnostics and the methods ask a
  // few row sets a layer): the column sums, computed with any request, and the counts below each
  // threshold asked for.
  struct Below {
    double p = 0;
    bool zeros = false;
    std::vector<int64_t> counts;
  };
  struct Reduced {
    int layer = 0;
    std::string rows;
    std::shared_ptr<std::vector<double>> column_sums;  // shared with column_sums() callers
    std::vector<Below> below;
    // The counts below r's threshold, or null when not computed yet.
    const Below* counts(const AttentionReduction& r) const {
      for (const Below& b : below)
        if (b.p == r.p && b.zeros == r.zeros_below) return &b;
      return nullptr;
    }
  };
  size_t max_reduced() const { return 4 * layers_.size() + 4; }
  mutable std::vector<Reduced> reduced_;
  mutable int64_t runs_ = 0;
  mutable int64_t recomputes_ = 0;
  // The kept reduction of `layer` over r.queries, computed (with the counts r asks for) when
  // missing; and one reduction run where the probabilities are. Both under mu_.
  const Reduced& reduced_locked(int layer, const AttentionReduction& r) const;
  // The kept reduction of `layer` over the rows whose key is `rows`, or null (under mu_, shared or not).
  const Reduced* find_reduced(int layer, const std::string& rows) const;
  void keep_reduced_locked(Reduced x) const;
  // The prefill's projection and RoPE of `layer` on its kept input, into `qkv` (under the ops lock).
  void recompute_locked(int layer, Buffer& qkv) const;
  void run_locked(int layer, const AttentionReduction& own) const;
  std::shared_ptr<const std::vector<float>> held(int layer) const;  // under mu_
  Buffer qkv_locked(int layer) const;                              // under mu_
};

class LlamaDecoder {
 public:
  LlamaConfig cfg;
  std::shared_ptr<Backend> be;
  // hand_over_stashed compares this many layers a call, holding their recomputed prompt q/k/v.
  static constexpr int kExactLayersAtOnce = 4;
  // hand_over_recorded keeps a chunk of steps' scores, and a batch of queued span sums, near this.
  static constexpr int64_t kHandOverBytes = int64_t{256} << 20;
  // The threads (at most the machine's) that events handed over together are compared on, and
  // those an observed step's layers are handed over on: a step's 32 layers are a few
  // milliseconds of host work, whose end waits for its slowest thread (on a virtual machine of
  // 16 CPUs, 16 threads let one thread's stall hold up the step by several milliseconds).
  static constexpr int kEventThreads = 16;
  static constexpr int kStepEventThreads = 8;
  Buffer embed, norm, lm_head;  // lm_head shares embed's memory when tied
  std::vector<LlamaLayer> layers;

  static LlamaDecoder load(const WeightStore& ws, const std::string& prefix,
                           const std::string& lm_head_name, bool tie, const LlamaConfig& cfg,
                           std::shared_ptr<Backend> be);

  // Token embeddings of ids as a [n][hidden] fp32 buffer; ids must be < vocab_size.
  Buffer embed_tokens(const std::vector<int>& ids) const;
  // Runs the prompt x [T][hidden] (positions 0..T-1), appends every layer's K/V to `kv`
  // tagged by `kinds`, and returns the logits of the last position. rope_positions (empty: the
  // positions 0..T-1): the rotary positions, [cfg.rope.rows()][T] (M-RoPE's sections), which the
  // cache's rows do not take (they keep 0..T-1).
  std::vector<float> prefill(const Buffer& x, const std::vector<SegmentKind>& kinds, SeqKV& kv,
                             const std::vector<AttentionObserver*>& observers, PrefillCapture* capture,
                             const std::vector<int32_t>& rope_positions = {}) const;
  LlamaWorkspace workspace() const;
  // One decode step for `token` at position `pos` (step = 0 for the first generated token's
  // forward); returns logits.
  std::vector<float> decode(int token, int pos, int step, SeqKV& kv, KVPolicy* policy,
                            const std::vector<AttentionObserver*>& observers,
                            LlamaWorkspace& ws) const;
  // The chained form of decode (Backend::chains_steps), for steps with no observer and no
  // policy that needs host rows (decode_needs_host_rows) over a cache without host rows (a
  // prefill-only method compressed it before the first step): launch enqueues the step and the
  // readback of its logits and returns before it has run; token < 0 takes the input the
  // previous step left on the device (its greedy token, at position pos). collect waits for the readback `launch`
  // returned (readbacks are collected in launch order), returns the step's logits and sets
  // `device_token` to the greedy token the device chose from them.
  int launch(int token, int pos, int step, SeqKV& kv, KVPolicy* policy, LlamaWorkspace& ws) const;
  const std::vector<float>& collect(int ticket, LlamaWorkspace& ws, int& device_token) const;
  // Steps observed by observers that read probabilities alone (AttentionObserver::
  // reads_probabilities_only), on a backend that records decode queries: record_queries makes
  // room for `slots` steps; a decode with ws.record_slot ≥ 0 then runs on the device as an
  // unobserved step does (no host rows, observers none) and keeps its queries in that slot; and
  // hand_over_recorded computes, once the decode is done, the attention of the steps recorded in
  // slots 0 .. steps.size() − 1 (steps[i] at positions[i]) and hands each layer's event to the
  // observers that read that step (when those observers all read one span's sums, only those
  // sums, reduced on the backend: AttentionObserver::reads_span).
  // An observed step whose observers read no rows and compare with this prefill's capture, on a
  // backend that defers decode taps, is put off (ws.stash, at most kStashSlots at once): its taps,
  // positions and generated rows are kept as the step left them, and hand_over_stashed computes
  // every stashed step's exact attention together, each layer's prompt q/k/v recomputed once
  // for all of them, and hands the stashed steps' events over in step order (after those of any
  // step that was not put off). The decode calls it once its steps are done; a backend that
  // defers decode taps computes exact attention (exact_decode_attention_layers), which this needs.
  void hand_over_stashed(LlamaWorkspace& ws) const;
  void record_queries(LlamaWorkspace& ws, int slots) const;
  void hand_over_recorded(SeqKV& kv, const std::vector<int>& steps, const std::vector<int32_t>& positions,
                          KVPolicy* policy, const std::vector<AttentionObserver*>& observers, LlamaWorkspace& ws) const;
  // The scale its attention applies to q·k (StepZip::scale: what ZipCache's kept states are at).
  float attention_scale() const { return layout(1).scale; }

 private:
  AttnLayout layout(int T) const;
  void check_ids(const std::vector<int>& ids) const;
  // The ops of one decode step; token < 0: the input is already on the device. A chained step
  // (launch) ends with the next step's input, its greedy token and position (next_token), so
  // the next step can start on the device without the host.
  void step_ops(int token, int pos, int step, SeqKV& kv, KVPolicy* policy,
                const std::vector<AttentionObserver*>& observers, bool chain, LlamaWorkspace& ws) const;
  // Sizes t for layer l of `host` (n_max: the most rows a KV head holds there; raw and out only
  // with `raw_out`) and returns the DecodeTaps that fill it.
  DecodeTaps size_taps(const KVStore& host, int l, bool raw_out, LayerTaps& t) const;
  // t's key positions and kinds: those of layer l of `host`.
  void take_positions(const KVStore& host, int l, LayerTaps& t) const;
  // Layer l's event of decode step `step` (at *pos; q: the layer's qkv row after RoPE, on the
  // host; null: none) from its taps — a recorded step's answer, or a step's taps with its raw
  // scores and output where it has them; rows and exact attention are the caller's to add.
  AttentionEvent layer_event(const RecordedAttention& t, int l, int step, const int32_t* pos, const float* q) const;
  AttentionEvent layer_event(const LayerTaps& t, int l, int step, const int32_t* pos, const float* q) const;
  // f(0), then f(1) .. f(layers − 1): on threads when every observer takes concurrent events.
  void each_layer(const std::vector<AttentionObserver*>& observers, const std::function<void(int)>& f) const;
  // h += attention block and MLP block of layer l for the T tokens in `w` (the part shared by
  // prefill and decode after attention).
  void mlp(const LlamaLayer& L, Buffer& h, Buffer& x, Buffer& gu, Buffer& g) const;
};

}  // namespace kvlens
