// The CUDA backend's shared state: one device, one stream, one cuBLAS handle, allocations from
// the device's stream-ordered memory pool. Buffers and caches keep a reference to it, so memory
// is freed on the right stream even after the backend object is gone.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/backend.h"
#include "kernels/cuda/backend_cuda.h"

namespace kvlens::cuda {

struct Context : std::enable_shared_from_this<Context> {
  int device = 0;
  std::string name;
  int n_sm = 0;
  bool sm90 = false;  // compute capability 9.0 or later: the kernels that need sm_90 run
  int64_t total_mem = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  void* blas_workspace = nullptr;
  // While a captured decode step is replayed, ops do their host bookkeeping only.
  bool replay = false;
  bool capturing = false;
  std::map<std::pair<int, std::string>, std::shared_ptr<void>> inv_freq;  // RoPE tables by (D, Rope::key)

  explicit Context(int dev);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // `bytes` of device memory for `what`; OutOfMemory names what, the size and the free memory.
  std::shared_ptr<void> alloc(int64_t bytes, const std::string& what);
  // `bytes` of page-locked host memory for `what` (the target of copies that must not wait).
  std::shared_ptr<void> pinned(int64_t bytes, const std::string& what);
  // A host buffer of at least `bytes`: the landing place of the large synchronous copies to the
  // host (one at a time, on this context's stream), which run at the link's speed from
  // page-locked memory. Page-locking memory takes several times longer than copying the same
  // bytes through pageable memory, so a size beyond any asked for before is served from pageable
  // memory (a run that needs it once does not wait for the pinning); a size the page-locked
  // buffer lacks but that was reached before (the app's next edit) grows it to that size.
  void* staging(int64_t bytes, const std::string& what);
  std::shared_ptr<void> staging_mem;
  int64_t staging_bytes = 0;
  std::unique_ptr<char[]> staging_pageable;
  int64_t staging_largest = 0;
  // An event without timing, destroyed with its last reference.
  std::shared_ptr<CUevent_st> event(const std::string& what);
  void upload(void* dst, const void* src, int64_t bytes, const std::string& what);
  // Copies to the host in stream order without waiting (dst: pinned memory).
  void download_async(void* dst, const void* src, int64_t bytes, const std::string& what);
  void download(void* dst, const void* src, int64_t bytes, const std::string& what);
  void sync(const std::string& what);
  void free_memory(int64_t& free_bytes, int64_t& total) const;
  // Results that come to the host later (Backend::attention_reduce_later and the like): `bytes`
  // of `src` (held until then), and what to do with them once they are on the host. land_all
  // copies the queued results in batches of at most kLandChunk bytes through two page-locked
  // buffers made with the context (land_ring), each batch copied while the one before it lands on
  // threads of their own — a method's first compression in a process does not wait for pageable
  // copies or for pinning its landings' size (a result larger than a batch goes through
  // `staging` alone). A landing writes only outputs no other queued landing writes. It empties
  // the queue, also on error: the error of the first landing that failed is rethrown once all
  // have run; a copy that fails ends it there (the batches not yet landed are dropped) with its
  // error.
  void land_later(std::shared_ptr<void> src, int64_t bytes, std::function<void(const char*)> land);
  void land_all(const std::string& what);
  struct Landing {
    std::shared_ptr<void> src;
    int64_t bytes = 0;
    std::function<void(const char*)> land;
  };
  std::vector<Landing> landings;
  static constexpr int64_t kLandChunk = int64_t{16} << 20;
  std::shared_ptr<void> land_ring[2];
  std::shared_ptr<CUevent_st> land_done[2];
  // Page-locked room for the host side of uploads queued between two land_alls (arguments made
  // on threads, copied without a wait): `bytes` (16-byte aligned) of the landing buffers, or null
  // when what is left of them is too small. Any thread may ask. land_all takes the room back once
  // the uploads queued before it are done (its copies into the buffers come after them, in stream
  // order).
  char* upload_room(int64_t bytes);
  std::atomic<int64_t> room_used{0};
};

// A cuBLAS status other than success as a DeviceError naming the call and `what`.
void check_blas(cublasStatus_t st, const char* call, const std::string& what, const char* file, int line);
#define KV_BLAS(call, what) ::kvlens::cuda::check_blas((call), #call, (what), __FILE__, __LINE__)

// A device allocation of exactly `bytes` (what a cache reports as allocated).
struct DevMem {
  std::shared_ptr<void> mem;
  int64_t bytes = 0;
  template <class T>
  T* as() const { return static_cast<T*>(mem.get()); }
};
// `bytes` of `m` from byte `at`, holding all of m (what a cache holding a part reports as allocated).
inline DevMem part_of(const DevMem& m, int64_t at, int64_t bytes) {
  return {std::shared_ptr<void>(m.mem, static_cast<char*>(m.mem.get()) + at), bytes};
}
// Arrays made on the device for payload `out` left there (QuantPayload::defer): `bytes` of
// `src`, which `land` writes into out's blocks from a host copy when a host reader asks for
// them (`counted`: what they add to out.allocated()). The copy waits for the work queued on
// ctx's stream so far (an event recorded now), not for what is queued later, and goes by a
// synchronous copy of its own, so any thread may ask (the backend's stream may be capturing
// meanwhile). The arrays must not change on the device after this call; src is held until
// they land or the payload goes.
void defer_landing(Context& ctx, quant::QuantPayload& out, std::shared_ptr<void> src, int64_t bytes, KVBytes counted,
                   std::function<void(const char*)> land);

// The KV cache half of the backend (kv_cache.cu).
std::unique_ptr<DeviceKV> kv_create(const std::shared_ptr<Context>& ctx, int n_layers, int n_kv_heads, int head_dim);
void kv_append(Context& ctx, SeqKV& kv, int layer, const Buffer& qkv, const AttnLayout& l, const Buffer& pos,
               const int32_t* pos_host, const SegmentKind* kinds, int T);
// RoPE and the decode row's append in one kernel (a plain decode step); false when the step
// needs the general path (prompt rows, or host rows kept in step).
bool kv_rope_append(Context& ctx, SeqKV& kv, int layer, Buffer& qkv, const AttnLayout& l, const Buffer& pos,
                    const int32_t* pos_host, const SegmentKind* kinds, int T, const float* inv_freq);
void kv_decode_attention(Context& ctx, const Buffer& qkv, const AttnLayout& l, SeqKV& kv, int layer,
                         const ScoreTransform* transform, Buffer& out, const DecodeTaps& taps);
// Backend::decode_attention_deferred and collect_deferred (kv_decode.cu).
void kv_decode_deferred(Context& ctx, const Buffer& qkv, const AttnLayout& l, SeqKV& kv, int layer,
                        const ScoreTransform* transform, Buffer& out, bool want_out);
void kv_collect_deferred(Context& ctx, SeqKV& kv, int layer, const ScoreTransform* transform, const DecodeTaps& taps);
// Backend::recorded_attention (kv_decode.cu).
void kv_recorded_attention(Context& ctx, SeqKV& kv, int layer, const Buffer& q_rows, const AttnLayout& l,
                           const std::vector<int32_t>& positions, const ScoreTransform* transform,
                           std::vector<RecordedAttention>& out);
// Backend::recorded_span_attention (kv_decode.cu); false for a transform it cannot apply.
bool kv_recorded_span_attention(Context& ctx, SeqKV& kv, int layer, const Buffer& q_rows, const AttnLayout& l,
                                const std::vector<int32_t>& positions, const ScoreTransform* transform, int first,
                                int n, std::vector<float>& out);
// kv_rope_append and the plain kv_decode_attention in one kernel (the fp16 decode kernel rotates
// q and the token's k, attends over the cache and the token's row, and appends the row); false
// when the step needs the separate ops (prompt rows, host rows kept in step, a cache that is not
// all fp16, or a head size the fp16 kernel does not take).
bool kv_rope_attend(Context& ctx, SeqKV& kv, int layer, Buffer& qkv, const AttnLayout& l, const Buffer& pos,
                    const int32_t* pos_host, const SegmentKind* kinds, const float* inv_freq, Buffer& out);
void kv_hydrate(Context& ctx, const DeviceKV& dev, KVStore& host, bool rows);
// Backend::quantize_rows (later: quantize_rows_later): the segment's rows gathered from the cache
// by KV head and position, quantized by the quant_pack.cu kernels, codes and ranges copied out
// in one wait (later: landing at the context's next land_all).
bool kv_quantize_rows(Context& ctx, DeviceKV& dev, int layer, const KVSegment& seg, const quant::UniformSpec& k,
                      const quant::UniformSpec& v, quant::QuantPayload& out, bool later);
// Backend::code_rows (later: code_rows_later): the segment's rows read where the cache holds
// them, coded by codec_rows, codes and scales copied out in one wait (later: landing at the
// context's next land_all), the coded rows kept for the layer's next kv_sync, which makes them
// the segment's own (DevLayer::coded).
bool kv_code_rows(Context& ctx, DeviceKV& dev, int layer, const KVSegment& seg, const quant::RowCodec& k,
                  const quant::RowCodec& v, quant::QuantPayload& out, bool later);
// Backend::zip_quantize_rows (kv_zip.cu): each group's rows gathered from the cache by KV head,
// subset and position, quantized by zip_quantize, every array landing at the context's next
// land_all and kept for its layer's next kv_sync.
bool kv_zip_quantize(Context& ctx, DeviceKV& dev, const std::vector<ZipRowsGroup>& groups);
// Backend::kv_lookm_merge (kv_merge.cu).
void kv_lookm_merge(Context& ctx, DeviceKV& dev, const LookMMergeSpec& spec, std::vector<LayerMerge>& layers);
void kv_sync(Context& ctx, DeviceKV& dev, KVStore& host, int layer);
// Backend::kv_reserve; with quant (any()), every layer's decode rows quantized per token as they
// are appended (rope_quant_append), or with quant.group > 0 kept as fp16 rows whose oldest are
// quantized in groups by kv_before_step, or with quant.zip.gap > 0 kept as fp16 rows whose gaps
// kv_before_step quantizes (ZipCache, the probes scheduled here); kv_quantizes_steps(quant, head
// size) must allow it.
void kv_reserve(Context& ctx, DeviceKV& dev, int rows, const StepQuant& quant);
// 1 to 8 bits a side, and a head size and rotation rope_quant_append takes (quant_tail_ok);
// grouped: equal bits, no rotation, a group and at least one residual row; zipped: no rotation,
// a head size that is a multiple of 8.
bool kv_quantizes_steps(const StepQuant& quant, int head_dim);
// Backend::kv_before_step (kv_groups.cu): every layer's rows due under its grouped tail's
// StepQuant quantized into segments of their own (one upload, one launch for all layers), or
// its zipped tail's due gap (kv::zip_gap); the host's copies of the decode rows grouped replaced
// by their dequantization (kv::group_rows_to_host).
void kv_before_step(Context& ctx, SeqKV& kv);
// Whether some layer's decode rows are grouped or zipped (kv_before_step may quantize some).
bool kv_has_groups(const DeviceKV& dev);
// Whether kv_before_step would quantize rows now: some layer's grouped rows due (rows_due), or
// a zipped layer (whose gaps it schedules itself).
bool kv_groups_due(const DeviceKV& dev);
void kv_pull_rows(Context& ctx, SeqKV& kv, const std::vector<int>& layers, const int32_t* pos_host,
                  const SegmentKind* kinds, int T);

// research_ops.cu: Backend::attention_reduce (the layer's causal probabilities recomputed from
// qkv on the device and reduced there), Backend::cosine_assign (LOOK-M's Eq. 9) and
// Backend::exact_decode_attention, as core/backend.h states them.
void reduce_prefill_attention(Context& ctx, const Buffer& qkv, const AttnLayout& l, const AttentionReduction& r);
// Backend::attention_reduce_later: the reduction queued on the stream, its results landing where
// r asks at the context's next land_all (Context::land_later).
void queue_prefill_reduction(Context& ctx, const Buffer& qkv, const AttnLayout& l, const AttentionReduction& r);
// Backend::cosine_assign: every head's keys in one upload, two launches (norms, then the
// assignment), one copy back.
void assign_by_cosine(Context& ctx, int d, const std::vector<const std::vector<float>*>& k,
                      const std::vector<const std::vector<int>*>& keep, std::vector<std::vector<RowAssignment>>& out);
// Backend::exact_decode_attention(_layers): query i (row i of qkv) against prompts[i] and
// extras[i]; the arguments and extra rows in one upload, one launch, the results in one copy back.
void exact_decode_attention(Context& ctx, const Buffer& qkv, const AttnLayout& l,
                            const std::vector<const Buffer*>& prompts, const AttnLayout& pl,
                            const std::vector<ExtraRows>& extras, std::vector<ExactAttention>& x);

}  // namespace kvlens::cuda
