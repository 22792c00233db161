// The backend interface: the ops the LLaVA graph uses, as one narrow table with two
// implementations — kernels/cpu (the fp32 reference, today's loops) and kernels/cuda (the GPU).
// models/ builds the graph once against this interface and never knows which backend runs it.
//
// Tensors live in the backend's memory (host memory for the CPU, device memory for CUDA) as
// Buffers: a name, a shape and a dtype written beside the pointer, so activations of the two
// backends can be compared by name. Matrices keep the checkpoint's dtype (fp16 / bf16 / fp32);
// an activation that feeds a matrix product has the matrix's dtype; everything else is fp32.
//
// The KV cache of a sequence is the host KVStore (what policies, observers and diagnostics
// read) plus, on a device backend, a DeviceKV that attention reads. The host store keeps its
// rows in step with the device only when asked (SeqKV::mirror): a plain caption pays nothing.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/attention_reduce.h"
#include "core/errors.h"
#include "core/exact_attention.h"
#include "core/kv_format.h"
#include "core/kv_store.h"
#include "core/rope.h"
#include "core/row_merge.h"
#include "core/tensor.h"

namespace kvlens {

enum class Dt : uint8_t { F32, F16, BF16, I32 };
int dt_size(Dt d);
const char* dt_name(Dt d);

struct Buffer {
  std::string name;
  std::vector<int64_t> shape;
  Dt dt = Dt::F32;
  void* data = nullptr;
  std::shared_ptr<void> hold;  // owns the memory (shared by views)

  int64_t numel() const;
  int64_t bytes() const { return numel() * dt_size(dt); }
  int64_t rows() const { return shape.empty() ? 0 : shape[0]; }
  int64_t cols() const { return rows() ? numel() / rows() : 0; }
  bool empty() const { return data == nullptr; }
  std::string shape_str() const;
  // Rows [r0, r0 + n) along the first dimension, sharing the memory.
  Buffer row_view(int64_t r0, int64_t n) const;
  template <class T>
  T* as() const { return static_cast<T*>(data); }
};

// Checkpoint bytes handed to a backend (row-major, dtype F32, F16 or BF16).
struct HostTensor {
  std::string name;
  Dt dt = Dt::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  int64_t numel() const;
};

// The op table. A backend answers supports(op) for each; the model checks the ops it needs
// when it is loaded, so a missing op is a load-time error, not a crash mid-run.
enum class Op {
  Linear, RmsNorm, LayerNorm, Add, BiasAct, GatedAct, Rope, Embed, CopyRows, Attention,
  KVAppend, DecodeAttention, DecodeAttentionCapture, PackedKV, Count
};
const char* op_name(Op op);

// Where q, k and v of each token sit in a projection output [T][row_stride] (fp32).
struct AttnLayout {
  int T = 0;  // tokens in this buffer
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int64_t row_stride = 0;
  int64_t q_col = 0, k_col = 0, v_col = 0;
  bool causal = false;  // token i sees tokens j <= i (positions 0..T-1)
  float scale = 1.0f;
};

// LOOK-M's merge as Backend::kv_lookm_merge does it: the rule, and the authors' similarity
// filter and average-merge sources (lookm_contributions, core/compress/evict_methods.h).
struct LookMMergeSpec {
  MergeKind kind = MergeKind::Pivotal;
  bool above_mean = false;      // only the evicted indices whose similarity passes the filter
  bool prefix_sources = false;  // (average) the f-th passing index takes the f-th evicted row
};
// A layer's share of LOOK-M's merge where the cache is (Backend::kv_lookm_merge).
struct LayerMerge {
  int layer = 0;
  const LayerKV* layout = nullptr;      // the host store's layer: every prompt row, layout_only
  std::vector<std::vector<int>> keep;   // [KV head] kept rows, ascending (in)
  std::vector<std::vector<int>> merged; // [KV head][kept row] the rows merged into it (out)
};

// A sequence's KV cache on a device backend. Bytes are what its segments hold; allocated() is
// the device memory it holds (they agree except for capacity reserved ahead for decode rows, and
// rows merged on the device that the next kv_sync has yet to store).
class DeviceKV {
 public:
  virtual ~DeviceKV() = default;
  virtual std::unique_ptr<DeviceKV> clone() const = 0;
  virtual KVBytes bytes() const = 0;
  virtual KVBytes bytes(int layer) const = 0;
  virtual int64_t allocated() const = 0;
  // Changes whenever the layout the kernels read changes (a captured decode step is stale).
  virtual uint64_t version() const = 0;
  // Human-readable storage of each segment of a layer (e.g. "fp16", "packed q1-channel").
  virtual std::vector<std::string> storage(int layer) const = 0;
};

// How decode attention changes one query head's pre-softmax scores over the keys the cache
// holds, before the softmax: the description a compression method returns
// (KVPolicy::score_transform), so that a backend never sees the method.
//   None:      scores as computed.
//   Calibrate: the visual keys' scores go through the calibration g(x) with the head's range
//              [γ, δ] of visual scores and τ1, τ2 (clamp to [γ − τ1, δ − τ2], stretched back to
//              [γ, δ]); a device applies it inside its attention kernel.
//   Host:      a transform only the host computes; the scores cross to the host and back.
// `apply` is the transform on the host (both kinds): kinds[j] is key j's segment, in the host
// store's row order, n_k keys.
struct ScoreTransform {
  enum class Kind : uint8_t { None, Calibrate, Host };
  Kind kind = Kind::None;
  float tau1 = 0, tau2 = 0;
  std::function<void(int layer, int head, float* scores, const SegmentKind* kinds, int n_k)> apply;
  bool any() const { return kind != Kind::None; }
};

// A method's decode-time action as data a device runs inside its own steps: each generated row's
// keys and values quantized to k_bits / v_bits with one range per row (CalibQuant Eq. 3/4 per
// token: α, β the row's min and max, scale = half((β − α)/(2^b − 1)), zero = half(α)), as the row
// is appended and before attention reads it. The host's twin is the method's on_decode_step on
// the rows rounded to the cache's fp16 (quant::quantize_block, Axis::PerToken). k_bits = 0: none.
// rotation > 0 (Hadamard-INT4): each key row is first rotated by the block-diagonal orthonormal
// Hadamard transform of blocks of `rotation` channels (quant::block_hadamard) and its codes are
// of the rotated row; every key of the cache is then stored so (CodeLayout::k_rotation), and the
// device rotates the query once per step instead of rotating keys back.
// `label` names the rows so stored, as the method labels the segment its hook makes.
// group > 0 (KIVI): rows are appended as fp16 instead, and before a step appends its row, each
// KV head whose trailing dense rows (the prompt's last dense segments, then the decode rows),
// with that row, number at least residual + group, has its oldest such rows quantized in whole
// groups so that `residual` rows stay dense: keys with a range per channel over each piece, cut
// where a segment ends, values with a range per row, both k_bits (quant::quantize_block); each
// piece becomes a segment labelled `label` before the rest of the one it was cut from. The
// host's twin is KIVI's on_decode_step (residual >= 1, so the new row is never among them).
// zip.gap > 0 (ZipCache, Algorithm 3): rows are appended as fp16; each layer keeps the queries
// of its probe tokens (`probes`: the method's schedule), and before the step whose row follows
// `gap` dense decode rows, those rows' saliency (zipcache::gap_saliency over the probes'
// attention: the device keeps each probe's softmax sums from its own step and scores it against
// the gap's rows) is ranked as the method
// ranks it (`ratio`, `shared_ranking`), and the gap is quantized as ZipCache's prefill quantizes
// a group (CodeLayout::ZipMixed: k_bits salient, v_bits the others) into a segment of its own
// before the decode rows. The host's twin is ZipCache's on_decode_step.
struct StepZip {
  int gap = 0;
  bool accumulated = false;        // p_i (Eq. 7) instead of the normalized p̃_i (Eq. 8)
  bool head_token_ranges = false;  // CodeLayout: V token ranges per KV head
  bool layer_factors = false;      // CodeLayout: CST factors over the group before the split
  int n_heads = 0;                 // query heads (the decode fills it in)
  float scale = 0;                 // their attention's scale (the decode fills it in)
  // Layer `layer`'s probe slot of each of its first `rows` decode rows (−1: not a probe; a gap's
  // probes numbered from 0), drawn as the host's hook draws them.
  std::function<std::vector<int32_t>(int layer, int rows)> probes;
  // How a gap's rows are ranked, as the host's hook ranks them (zipcache::rank_gap): the top
  // round(ratio · gap) rows of each KV head by saliency, or with `shared_ranking` by the KV heads'
  // saliency summed.
  double ratio = 0;
  bool shared_ranking = false;
};
struct StepQuant {
  int k_bits = 0, v_bits = 0;
  int rotation = 0;
  std::string label;
  int group = 0, residual = 0;
  StepZip zip;
  // Each row coded where it is appended by a row codebook a side (TurboQuant; quant::RowCodec):
  // its codes and fp16 scales kept, its K and V replaced by their dequantization (rounded to
  // the cache's fp16); k_bits the bits a row counts (quant::set_quantized).
  std::shared_ptr<const quant::RowCodec> k_codec, v_codec;
  bool any() const { return k_bits > 0 && v_bits > 0; }
  static StepQuant coded(std::shared_ptr<const quant::RowCodec> k, std::shared_ptr<const quant::RowCodec> v, int bits,
                         std::string label) {
    StepQuant q;
    q.k_bits = q.v_bits = bits;
    q.k_codec = std::move(k);
    q.v_codec = std::move(v);
    q.label = std::move(label);
    return q;
  }
  // Each row quantized as it is appended (no groups, no streaming).
  static StepQuant rows(int k_bits, int v_bits, int rotation = 0, std::string label = {}) {
    StepQuant q;
    q.k_bits = k_bits;
    q.v_bits = v_bits;
    q.rotation = rotation;
    q.label = std::move(label);
    return q;
  }
};

// What a decode attention hands back to the host besides its output, each written when not null
// ([n_heads][n_max] in the host store's row order, padding -inf / 0): the scores after the
// transform (what the softmax saw), the scores before it, the probabilities; and the attention
// output in fp32 [n_heads][head_dim] before any rounding to the output buffer's dtype.
struct DecodeTaps {
  float* scores = nullptr;
  float* raw_scores = nullptr;
  float* probs = nullptr;
  float* out = nullptr;
  int n_max = 0;
  bool rows() const { return scores || raw_scores || probs; }
  bool any() const { return rows() || out; }
};

// The attention a decode query recorded on the device had (Backend::recorded_attention), over
// the keys it saw in the host store's row order: each KV head's key positions and kinds, then
// each query head's scores (after the score transform) and probabilities. Past a head's keys:
// position −1, score −inf, probability 0.
struct RecordedAttention {
  int n_max = 0;
  std::vector<int32_t> key_pos;       // [n_kv_heads][n_max]
  std::vector<SegmentKind> key_kind;  // [n_kv_heads][n_max]
  std::vector<float> scores, probs;   // [n_heads][n_max]
};

// One group of Backend::zip_quantize_rows: segments of layer `layer` and the payload whose flags
// and layout say how, where its arrays land. `prepare`, when set, makes those flags and that
// layout: called once before the group's rows are read, on any thread, while the backend's
// operations are held (it must not call the backend), so that it runs beside the other groups'
// work.
struct ZipRowsGroup {
  int layer = 0;
  std::vector<const KVSegment*> segs;
  quant::QuantPayload* out = nullptr;
  std::function<void()> prepare;
};

struct SeqKV {
  KVStore* host = nullptr;
  DeviceKV* dev = nullptr;  // null on the CPU backend (the host store is the cache)
  bool mirror = true;       // the host store holds the rows too (policies, observers)
};

struct BackendOptions {
  std::string kind = "cpu";   // cpu | cuda | auto
  bool fp32_as_fp16 = false;  // CUDA: store fp32 checkpoints' matrices as fp16
  int device = 0;             // CUDA device ordinal
};

// Opaque per-sequence state a backend keeps between decode steps (CUDA: a captured graph).
struct StepCache {
  virtual ~StepCache() = default;
};

// Runs `first`, then `then`, also when `first` throws: its error goes on after `then` ran, and an
// error of `then` gives way to it (the first error is the one to report).
inline void then_anyway(const std::function<void()>& first, const std::function<void()>& then) {
  try {
    first();
  } catch (...) {
    try {
      then();
    } catch (...) {
      // (the first error is the one to report)
    }
    throw;
  }
  then();
}

class Backend {
 public:
  virtual ~Backend() = default;
  // Taken by ops that threads other than the model's may call, and by callers that run several
  // ops from such a thread (see attention_reduce).
  std::recursive_mutex& ops_mutex() const { return ops_mu_; }

 private:
  mutable std::recursive_mutex ops_mu_;

 public:
  virtual std::string name() const = 0;    // "cpu" / "cuda"
  virtual std::string device() const = 0;  // what runs it, in words
  virtual bool supports(Op op) const = 0;

  // ---- memory ------------------------------------------------------------------------------
  virtual Buffer alloc(const std::string& name, std::vector<int64_t> shape, Dt dt) = 0;
  // Host values (fp32 for float buffers, int32 for I32) into the whole buffer, converted.
  virtual void upload(const void* host, Buffer& dst) = 0;
  // The whole buffer to host fp32 (I32 buffers to int32).
  virtual void download(const Buffer& src, void* host) = 0;
  // A matrix [sum of rows][cols] made of `parts` stacked along rows (e.g. q, k, v), kept in the
  // checkpoint's dtype. Every part must have the same number of columns.
  virtual Buffer matrix(const std::string& name, const std::vector<HostTensor>& parts) = 0;
  // A vector or small table kept in fp32 (norm weights, biases, embedding rows...).
  virtual Buffer vector(const HostTensor& t) = 0;
  // Waits for queued work (timings).
  virtual void synchronize() {}
  // Copy bandwidth of the backend's memory in bytes per second (bytes read + bytes written
  // over the time of a large copy, median of several): the roofline benchmarks measure against.
  virtual double copy_bandwidth() = 0;
  // Time spent in each op since the last call (ms, in call order of first use), when the
  // backend was asked to profile (CUDA: KVLENS_CUDA_PROFILE=1, which also turns off the replay
  // of captured decode steps so every op is timed); empty otherwise.
  virtual std::vector<std::pair<std::string, double>> profile_report() { return {}; }
  // Device memory in use and free, when the backend has a device (0, 0 otherwise).
  virtual void memory_info(int64_t& used, int64_t& free_bytes) { used = free_bytes = 0; }

  // ---- ops (shapes are checked; Buffers name what failed) ------------------------------------
  // y[M][N] = x[M][K]·Wᵀ (+ bias) (+ y when accumulate). x.dt == W.dt, y fp32.
  virtual void linear(const Buffer& x, const Buffer& W, const Buffer* bias, Buffer& y,
                      bool accumulate) = 0;
  // y = x / sqrt(mean(x²) + eps) · g over rows; x fp32, y fp32 or a matrix dtype.
  virtual void rms_norm(const Buffer& x, const Buffer& g, float eps, Buffer& y) = 0;
  // y = LayerNorm(x)·g + b (biased variance); y may alias x when both are fp32.
  virtual void layer_norm(const Buffer& x, const Buffer& g, const Buffer* b, float eps,
                          Buffer& y) = 0;
  // x = rms_norm(h)·g, then y = x·Wᵀ (+ bias): one op, so a device can fuse the norm into the
  // product (x is scratch afterwards). The default runs the two ops. With `check` set, h is first
  // checked as check_finite(h, *check) does (a device folds the check into the product).
  virtual void norm_linear(const Buffer& h, const Buffer& g, float eps, Buffer& x, const Buffer& W,
                           const Buffer* bias, Buffer& y, const std::string* check = nullptr) {
    if (check) check_finite(h, *check);
    rms_norm(h, g, eps, x);
    linear(x, W, bias, y, false);
  }
  // x += y (fp32, same shape).
  virtual void add(Buffer& x, const Buffer& y) = 0;
  // NonFiniteError naming `tensor` when fp32 x holds NaN or Inf: thrown at once by the CPU; a
  // device records the check and finish_checks() throws for the first recorded tensor that
  // failed (the model calls it where it reads results back anyway, so checks cost no sync).
  virtual void check_finite(const Buffer& x, const std::string& tensor) = 0;
  virtual void finish_checks() {}
  // out = act(y + bias) with y fp32 [M][N]; act None is a plain copy / dtype conversion.
  virtual void bias_act(const Buffer& y, const Buffer* bias, Act act, bool apply_act,
                        Buffer& out) = 0;
  // out[M][I] = act(gu[:, :I]) ⊙ gu[:, I:] with gu fp32 [M][2I].
  virtual void gated_act(const Buffer& gu, Act act, Buffer& out) = 0;
  // out = gated_act(gu) with gu = norm_linear(h, g, eps, x, W) (W = [2I][K]: the I gate rows,
  // then the I up rows; out [M][I] in its own dtype): one op, so a device can apply the gate in
  // the product's epilogue and never write gu (x and gu are scratch afterwards). `check` as in
  // norm_linear. The default runs norm_linear and gated_act.
  virtual void norm_gate_up(const Buffer& h, const Buffer& g, float eps, Buffer& x, const Buffer& W, Act act,
                            Buffer& gu, Buffer& out, const std::string* check = nullptr) {
    norm_linear(h, g, eps, x, W, nullptr, gu, check);
    gated_act(gu, act, out);
  }
  // Rotary embedding ("rotate half") of the q and k heads of qkv, in place; pos I32 [T].
  virtual void rope(Buffer& qkv, const AttnLayout& l, const Buffer& pos, const Rope& rope) = 0;
  // out[t] = table[ids[t]] (ids I32 [T], every id < table rows; out fp32).
  virtual void embed(const Buffer& table, const Buffer& ids, Buffer& out) = 0;
  // dst[dst_row0 + i][dst_col0 ..] = src[src_row0 + i][src_col0 ..] for i < n, `cols` values
  // (buffers of one dtype, copied as they are).
  virtual void copy_block(const Buffer& src, int64_t src_row0, int64_t src_col0, Buffer& dst,
                          int64_t dst_row0, int64_t dst_col0, int64_t n, int64_t cols) = 0;
  // Prefill / vision attention of the T tokens of qkv among themselves; out [T][n_heads·D]
  // (fp32 or a matrix dtype). scores / probs (host, [n_heads][T][T], masked = -inf / 0) are
  // written when not null.
  virtual void attention(const Buffer& qkv, const AttnLayout& l, Buffer& out, float* scores,
                         float* probs) = 0;
  // attention, attention_reduce and cosine_assign may be called from several threads at once (a
  // compression policy's layers run in parallel); a backend serialises them where it must, under
  // ops_mutex(). Work of several ops that must not interleave with another thread's (a capture
  // recomputing a layer) holds ops_mutex() around them.
  //
  // The causal probabilities attention computes for qkv, reduced where they are computed as `r`
  // asks (core/attention_reduce.h: reduce_attention is the reference), only the results copied
  // to the host. False where the backend has no such op: the caller then reduces the
  // probabilities `attention` gives.
  virtual bool attention_reduce(const Buffer& qkv, const AttnLayout& l, const AttentionReduction& r) {
    return false;
  }
  // attention_reduce whose results may come later: r's outputs are written by the next
  // finish_reductions (they must stay valid until then, and r is copied), and qkv may be
  // overwritten by ops after this call. Reductions queued back to back then share one wait.
  // The default reduces at once.
  virtual bool attention_reduce_later(const Buffer& qkv, const AttnLayout& l, const AttentionReduction& r) {
    return attention_reduce(qkv, l, r);
  }
  virtual void finish_reductions() {}
  // Whether attention_reduce_later queues (a caller then queues several before one wait);
  // false: it reduces at once, or not at all.
  virtual bool queues_reductions() const { return false; }
  // Runs `queue` (calls whose results come later), then finish_reductions, holding ops_mutex()
  // throughout so that no other thread lands, or loses, this queue. When `queue` throws, what it
  // queued lands first, while the caller's results still exist; then its error goes on.
  void queue_then_finish(const std::function<void()>& queue) {
    std::lock_guard<std::recursive_mutex> ops(ops_mutex());
    then_anyway(queue, [this] { finish_reductions(); });
  }
  // queue_then_finish, then `keep` (what takes the landed results in), also when `queue` throws:
  // what it queued before the error has landed and is kept (results made on the device name
  // what they were made for), then the error goes on; an error of `keep` then gives way to it.
  void queue_then_keep(const std::function<void()>& queue, const std::function<void()>& keep) {
    then_anyway([&] { queue_then_finish(queue); }, keep);
  }

  // LOOK-M's assignment (Eq. 9) of one layer's KV heads at once: out[h] holds, for each row e of
  // k[h] [n_h][d] (host, fp32) that keep[h] (ascending, distinct, not empty) does not list, in
  // ascending e, {e, the kept row c of largest cosine similarity, that similarity s}, every dot
  // product and norm added in double in ascending component order from 0.0 (a zero norm:
  // similarity 0), ties to the earlier kept row — the host's lookm_assign bit for bit. Every
  // head's rows go over in one copy and the results come back in one. False where the backend
  // has no such op.
  virtual bool cosine_assign(int d, const std::vector<const std::vector<float>*>& k,
                             const std::vector<const std::vector<int>*>& keep,
                             std::vector<std::vector<RowAssignment>>& out) {
    return false;
  }

  // ---- KV cache ------------------------------------------------------------------------------
  virtual std::unique_ptr<DeviceKV> kv_create(int n_layers, int n_kv_heads, int head_dim) {
    return nullptr;
  }
  // Appends the T tokens of qkv (k and v columns, after RoPE) to layer `layer`; pos: I32
  // buffer [T] (device side) and host copies of positions and kinds.
  virtual void kv_append(SeqKV& kv, int layer, const Buffer& qkv, const AttnLayout& l,
                         const Buffer& pos, const int32_t* pos_host, const SegmentKind* kinds,
                         int T) = 0;
  // RoPE on qkv, then kv_append: one op, so a device can fuse them for a decode step.
  virtual void rope_append(SeqKV& kv, int layer, Buffer& qkv, const AttnLayout& l, const Buffer& pos,
                           const int32_t* pos_host, const SegmentKind* kinds, int T, const Rope& r) {
    rope(qkv, l, pos, r);
    kv_append(kv, layer, qkv, l, pos, pos_host, kinds, T);
  }
  // Decode attention of the one query in qkv against layer `layer` of the cache. `transform`
  // (null = none) changes the scores before the softmax; what `taps` asks for is written too.
  virtual void decode_attention(const Buffer& qkv, const AttnLayout& l, SeqKV& kv, int layer,
                                const ScoreTransform* transform, Buffer& out, const DecodeTaps& taps) = 0;
  // Observed decode steps without a wait a layer. A backend that answers true here lets a step
  // defer what its observers read: for each layer decode_attention_deferred runs the attention as
  // decode_attention does with no taps (the transform applied where the backend applies it,
  // never a Host one) and keeps the scores before the transform, and with want_out the fp32
  // output, where they are; once the step's layers are launched and the host store holds the
  // step's rows (kv_pull_rows), collect_deferred(layer) writes the taps: raw_scores and out as
  // kept, scores = the transform's apply of the raw scores in the host's row order, probs their
  // softmax (exp in float, the sum in double). A backend that answers false is never asked for
  // the other two.
  virtual bool defers_decode_taps() const { return false; }
  virtual void decode_attention_deferred(const Buffer& qkv, const AttnLayout& l, SeqKV& kv, int layer,
                                         const ScoreTransform* transform, Buffer& out, bool want_out) {
    throw InternalError(name() + " backend: no deferred decode taps");
  }
  virtual void collect_deferred(SeqKV& kv, int layer, const ScoreTransform* transform, const DecodeTaps& taps) {
    throw InternalError(name() + " backend: no deferred decode taps");
  }
  // The exact attention (core/exact_attention.h) of the decode query in qkv (its q columns after
  // RoPE, laid out as l) over `prompt`, a prefill's qkv after RoPE (fp32 [T][row stride], laid
  // out as pl: its k and v columns), followed by `extra`: exact_attention's values, within the
  // tolerance the device test derives. False where the backend has no such op (the caller then
  // computes it on the host from rows).
  virtual bool exact_decode_attention(const Buffer& qkv, const AttnLayout& l, const Buffer& prompt,
                                      const AttnLayout& pl, const ExtraRows& extra, ExactAttention& out) {
    return false;
  }
  // exact_decode_attention for the queries of every layer of a step at once: row i of qkv_rows
  // ([n][row stride], each row laid out as l) against prompts[i] (laid out as pl) and extras[i],
  // into out[i] (resized to n), the same values as n calls of exact_decode_attention: one launch
  // and one copy back where the backend can. False where the backend has no such op.
  virtual bool exact_decode_attention_layers(const Buffer& qkv_rows, const AttnLayout& l,
                                             const std::vector<const Buffer*>& prompts, const AttnLayout& pl,
                                             const std::vector<ExtraRows>& extras, std::vector<ExactAttention>& out) {
    return false;
  }
  // Decode queries recorded for later: a backend that answers true lets a decode keep each
  // layer's query (its row of qkv after RoPE, copied with copy_block into a buffer the caller
  // holds) in steps that run on the device alone, and compute their attention once the caption
  // is done with recorded_attention: query i (row i of q_rows, laid out as l, at positions[i])
  // against layer `layer` of the cache as that step saw it (the prompt's rows, which must not
  // have changed since, and the decode rows at positions ≤ positions[i]); raw scores by the
  // decode's own scoring, then `transform`'s apply in the host's row order and the softmax (exp in
  // float, the sum in double), as collect_deferred gives them. A backend that answers false is
  // never asked for recorded_attention.
  virtual bool records_decode_queries() const { return false; }
  virtual void recorded_attention(SeqKV& kv, int layer, const Buffer& q_rows, const AttnLayout& l,
                                  const std::vector<int32_t>& positions, const ScoreTransform* transform,
                                  std::vector<RecordedAttention>& out) {
    throw InternalError(name() + " backend: no recorded decode queries");
  }
  // recorded_attention's probabilities reduced where they are to what a view of one span of key
  // positions reads (the patch overlay: the visual tokens first .. first + n − 1): out
  // [queries][n_heads][n], each query head's probabilities summed by key position over the span
  // (span_attention_sums on recorded_attention's answer, within the softmax's roundings). `out` is
  // sized and written by the next finish_reductions (the vector must stay where it is until
  // then), so that several layers' calls share one wait. False: this backend cannot for this
  // transform (nothing is queued; the caller asks recorded_attention).
  virtual bool recorded_span_attention(SeqKV& kv, int layer, const Buffer& q_rows, const AttnLayout& l,
                                       const std::vector<int32_t>& positions, const ScoreTransform* transform,
                                       int first, int n, std::vector<float>& out) {
    return false;
  }
  // rope_append of one generated token followed by decode_attention with no transform and no scores
  // or probabilities asked for: one op, so a device can rotate q and k and append the token's
  // row inside the attention kernel (a plain decode step). The default runs the two ops.
  virtual void rope_append_attend(SeqKV& kv, int layer, Buffer& qkv, const AttnLayout& l, const Buffer& pos,
                                  const int32_t* pos_host, const SegmentKind* kinds, const Rope& r, Buffer& out) {
    rope_append(kv, layer, qkv, l, pos, pos_host, kinds, 1, r);
    decode_attention(qkv, l, kv, layer, nullptr, out, DecodeTaps{});
  }
  // Quantizes the rows of host segment `seg` of `layer`, which the device cache `dev` holds (found
  // by KV head and position), as quant::quantize_block would on the host: keys with `k`, values
  // with `v`, into out.k[h] / out.v[h] for each KV head h (out sized to the segment's heads) —
  // the same layout and fp16 ranges, and the same codes but for values within an fp32 rounding of
  // a decision boundary. Only the codes and ranges cross to the host. The device keeps its copy
  // until the layer's next kv_sync, which stores a segment whose payload is `out` itself from it
  // instead of uploading the same bytes: a policy hands `out` to the segment as it came back
  // (payloads are replaced, not edited). False: this backend cannot (the caller quantizes host
  // rows).
  virtual bool quantize_rows(DeviceKV& dev, int layer, const KVSegment& seg, const quant::UniformSpec& k,
                             const quant::UniformSpec& v, quant::QuantPayload& out) {
    return false;
  }
  // Codes the rows of host segment `seg` of `layer`, which the device cache holds (by KV head and
  // position), by row codebooks (TurboQuant; quant::RowCodec): keys with `k`, values with `v`, as
  // turboquant::Codec::encode_row does on the host — into out.k[h] / out.v[h], each row's codes
  // and fp16 scales in the head's row order, bit for bit. The device keeps each row's
  // dequantization, rounded to fp16, until the layer's next kv_sync, which stores the segment
  // whose payload is `out` from those rows. False: this backend cannot (the caller codes host rows).
  virtual bool code_rows(DeviceKV& dev, int layer, const KVSegment& seg, const quant::RowCodec& k,
                         const quant::RowCodec& v, quant::QuantPayload& out) {
    return false;
  }
  // code_rows whose codes and scales may stay where they were made: `out` defers them
  // (QuantPayload::defer; it must stay where it is), they land in it when a host reader asks
  // (QuantPayload::land), and its allocated() counts them meanwhile. The default codes at once.
  virtual bool code_rows_later(DeviceKV& dev, int layer, const KVSegment& seg, const quant::RowCodec& k,
                               const quant::RowCodec& v, quant::QuantPayload& out) {
    return code_rows(dev, layer, seg, k, v, out);
  }
  // quantize_rows whose codes and ranges may stay where they were made: `out` defers them as
  // code_rows_later does. The default quantizes at once.
  virtual bool quantize_rows_later(DeviceKV& dev, int layer, const KVSegment& seg, const quant::UniformSpec& k,
                                   const quant::UniformSpec& v, quant::QuantPayload& out) {
    return quantize_rows(dev, layer, seg, k, v, out);
  }
  // ZipCache's mixed-bit quantization (quant::CodeLayout::ZipMixed) of groups of host segments,
  // each of one layer (ZipRowsGroup: dense segments in the layer's order), whose rows the device
  // cache `dev` holds (found by KV head and position), as zipcache::quantize_group does on host
  // rows: on entry each out.layout holds the bits and choices and out.k[h].flags each row's
  // salient flag (zipcache::mark_group); keys channel-wise per KV head and subset, values by
  // CSTQuant. The codes, ranges and factors — the same bytes the host makes — stay on the device,
  // deferred in each `out` (QuantPayload::defer; it must stay where it is) until a host reader
  // asks for them (QuantPayload::land); the device keeps
  // them for the layers' next kv_sync, which stores each group from them instead of uploading
  // them. Every group at once (one launch where the backend can). False: this backend cannot
  // (nothing is queued).
  virtual bool zip_quantize_rows(DeviceKV& dev, const std::vector<ZipRowsGroup>& groups) { return false; }
  // LOOK-M on a device cache whose rows the host does not hold, every listed layer in one call
  // (LayerMerge: the layer, its host layout with head h's rows in gather_head's order, and per KV
  // head the kept rows, ascending indices into those rows), all of it where the rows are: each
  // evicted row's most cosine-similar kept row by its key (cosine_assign's answer on the fp16
  // values a host copy would hold), the contributions lookm_contributions keeps under `spec`,
  // and their merge into the kept rows as merge_rows does, each merged row rounded to fp16 and
  // kept for the layer's next kv_sync, which stores it in place of the kept row (the host layout
  // then lists it with its HeadRows::merged count); quantize_rows before that sync reads the
  // merged rows. Only merged[h] (each kept row's count) crosses to the host. False where the
  // backend has no such op.
  virtual bool kv_lookm_merge(DeviceKV& dev, const LookMMergeSpec& spec, std::vector<LayerMerge>& layers) {
    return false;
  }
  // Fills the host store with the device cache's layout (segments, positions, annotations,
  // bytes) and, with `rows`, its rows' values; without, every segment is layout_only.
  virtual void kv_hydrate(const DeviceKV& dev, KVStore& host, bool rows) {}
  // Makes the device cache mirror the host store after a policy changed it (layer < 0: all);
  // the host segments' byte counts then read what the device holds.
  virtual void kv_sync(DeviceKV& dev, KVStore& host, int layer) {}
  // Room for `rows` more decode rows per layer without reallocation. With `quant` (any()), the
  // cache's decode rows are stored as it says from now on: each step's row quantized and packed
  // where it is appended (only before the first decode row; quantizes_steps(quant, the cache's
  // head size) must hold).
  virtual void kv_reserve(DeviceKV& dev, int rows, const StepQuant& quant = {}) {}
  // Whether this backend's decode steps run `quant` themselves (kv_reserve), so a method whose
  // only decode-time action it is needs no host rows and no hook while decoding.
  virtual bool quantizes_steps(const StepQuant& quant, int head_dim) const { return false; }
  // Before a decode step's ops, outside any captured step: the decode rows' action that
  // kv_reserve's quant (group > 0) takes before the step's row is appended, run where the rows
  // of kv.dev are. The layout may change (DeviceKV::version), so a replayed step is captured
  // anew. The decode rows the host store holds (an observed decode's) that were quantized are
  // replaced there by their dequantization, as the device now holds them.
  virtual void kv_before_step(SeqKV& kv) {}
  // Whether the next kv_before_step would quantize rows of kv.dev (some layer's grouped rows due,
  // or a zipped gap): the rows a recorded query sees change there.
  virtual bool kv_quantizes_before_step(const SeqKV& kv) const { return false; }
  // Appends to the host store, for each of `layers`, the device cache's last T decode rows
  // (appended while the host copy was put off: SeqKV::mirror off for that append), at
  // positions pos_host with kinds `kinds`, as the device holds them (quantized rows dequantized).
  // Only a backend with a device cache has such rows.
  virtual void kv_pull_rows(SeqKV& kv, const std::vector<int>& layers, const int32_t* pos_host,
                            const SegmentKind* kinds, int T) {
    throw InternalError(name() + " backend: no device rows to pull into the host store");
  }

  // ---- decode steps --------------------------------------------------------------------------
  // Runs `body` (a decode step's ops on fixed buffers). A device backend may capture it once
  // and replay it while `key` stays the same; the CPU runs it.
  virtual void run_step(std::unique_ptr<StepCache>& cache, uint64_t key,
                        const std::function<void()>& body) {
    body();
  }

  // ---- chained greedy steps ------------------------------------------------------------------
  // A device backend can run greedy decode steps back to back: a step's last op, next_token,
  // leaves the next step's input on the device, so the host launches step s + 1 before step s
  // has ended and reads step s's results through a readback. The host's work between steps
  // (sampling, bookkeeping, the launch itself) then overlaps the device's. A backend that
  // answers false here is never asked for the other four.
  virtual bool chains_steps() const { return false; }
  // ids[0] = the greedy token of logits fp32 [1][V]: the first index of the largest value, as
  // std::max_element picks it; pos[0] += 1.
  virtual void next_token(const Buffer& logits, Buffer& ids, Buffer& pos);
  // Enqueues copies of logits (fp32 [1][V]) and ids[0] to the host, with the finiteness checks
  // recorded since the last readback (finish_checks' work, deferred); returns a ticket.
  virtual int start_readback(const Buffer& logits, const Buffer& ids);
  // Waits for readback `ticket` (tickets are finished in the order they were started) and
  // writes its logits and token; throws NonFiniteError as finish_checks does when one of its
  // checks failed.
  virtual void finish_readback(int ticket, float* logits, int32_t* token);
  // Waits for the device, then forgets every unfinished readback and the checks recorded since
  // the last one: the results of a step launched ahead that turned out not to be needed.
  virtual void drop_readbacks() {}
};

// Parses "cpu" | "cuda" | "auto"; throws InputError naming `what`.
std::string parse_backend_kind(const std::string& s, const std::string& what);

}  // namespace kvlens
