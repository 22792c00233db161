// The KV store: per decoder layer, a list of segments. A segment knows its modality tag
// (system text / visual / post-vision text / generated), its storage, each kept token's
// position per KV head, and its exact byte count. Attention reads the store as it is.
//
// Rows are kept per KV head so that eviction policies may keep a different token set in each
// head (SnapKV, PyramidKV do). `k`/`v` always hold the rows attention computes with (floats,
// already dequantized when the storage is quantized); `bytes` is what the storage would take
// in memory as compressed, and `payload` owns the packed codes when a policy quantizes.
//
// Dense rows (those no policy quantized) are stored as the store's RowStorage says: fp16 rows
// hold values rounded to half precision (round to nearest even) and count 2 bytes per value,
// fp32 rows hold the exact values and count 4. A segment of dense rows is labelled "fp16" or
// "fp32" and has no payload; its floats are exactly what a half (or float) buffer would hold.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvlens {

enum class SegmentKind { System, Visual, PostVisionText, Generated };
const char* segment_kind_name(SegmentKind k);

// Storage of dense (uncompressed) rows. fp16 is what the papers' full cache and the GPU
// backend hold; fp32 keeps the exact values (the prefill snapshot that diagnostics compare
// against is fp32).
enum class RowStorage { Fp16, Fp32 };
const char* row_storage_name(RowStorage s);  // "fp16" / "fp32"
// "fp16" | "fp32"; throws InputError naming `what` otherwise.
RowStorage parse_row_storage(const std::string& s, const std::string& what);
int row_storage_bytes(RowStorage s);          // 2 / 4 bytes per value

// Byte accounting for one segment (or a sum of them).
struct KVBytes {
  int64_t codes = 0;    // K/V values or packed codes
  int64_t scales = 0;   // quantization scales
  int64_t zeros = 0;    // zero points / minima
  int64_t indices = 0;  // positions or kept-token indices
  int64_t meta = 0;     // anything else (per-channel factors, codebooks...)
  int64_t total() const { return codes + scales + zeros + indices + meta; }
  KVBytes& operator+=(const KVBytes& o) {
    codes += o.codes; scales += o.scales; zeros += o.zeros; indices += o.indices; meta += o.meta;
    return *this;
  }
};

struct HeadRows {
  std::vector<float> k, v;     // [n][head_dim]
  std::vector<int32_t> pos;    // [n] absolute position of each row
  // Optional per-row annotations for diagnostics: the bits a row's keys are stored with
  // (32 = fp32, 16 = fp16, b = b-bit codes; empty = every row as the segment's storage label
  // says) and how many evicted rows were merged into it (empty = none).
  std::vector<uint8_t> bits;
  std::vector<uint16_t> merged;
  int n() const { return static_cast<int>(pos.size()); }
};

// Opaque storage a policy keeps for a segment (packed codes and scales). It reports the bytes
// it really holds, so accounting can be checked against allocation.
struct SegmentPayload {
  virtual ~SegmentPayload() = default;
  virtual KVBytes allocated() const = 0;
};

struct KVSegment {
  SegmentKind kind = SegmentKind::System;
  std::string storage = "fp32";      // "fp32", "fp16", "q1", "q4/q2 mixed", ...
  std::vector<HeadRows> heads;       // one per KV head
  KVBytes bytes;                     // as stored
  std::shared_ptr<SegmentPayload> payload;
  // The rows live in a device cache alone: heads hold positions and row annotations, and k / v
  // are empty (KVStore::without_rows, or a device run's store while nothing on the host reads
  // rows). Eviction may still select rows of it; reading or merging its rows throws.
  bool layout_only = false;

  int n_tokens(int head = 0) const { return heads.empty() ? 0 : heads[head].n(); }
  // Whether the rows are plain floats as the store keeps them ("fp32" or "fp16", no payload):
  // the segments a compression policy may still evict, merge, split or quantize.
  bool dense() const { return !payload && (storage == "fp32" || storage == "fp16"); }
  // Bytes per value of a dense segment (4 or 2); 0 otherwise.
  int dense_value_bytes() const { return !dense() ? 0 : storage == "fp16" ? 2 : 4; }
  // Bytes of this segment stored as plain floats of `bytes_per_value` (4 = fp32, 2 = fp16),
  // positions as int32.
  KVBytes dense_bytes(int head_dim, int bytes_per_value) const;
};

struct LayerKV {
  std::vector<KVSegment> segments;
};

class KVStore {
 public:
  KVStore() = default;
  // Dense rows stored as `rows` (fp32 by default: the exact prefill snapshot).
  KVStore(int n_layers, int n_kv_heads, int head_dim, RowStorage rows = RowStorage::Fp32);

  int n_layers() const { return static_cast<int>(layers_.size()); }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  LayerKV& layer(int l) { return layers_.at(l); }
  const LayerKV& layer(int l) const { return layers_.at(l); }

  RowStorage row_storage() const { return rows_; }
  // Sets the storage of dense rows from now on. Switching to fp16 rounds the rows of every
  // dense fp32 segment to half precision and relabels it; switching to fp32 leaves existing
  // fp16 segments as they are (their values are exact in fp32) and new rows are kept exact.
  void set_row_storage(RowStorage rows);

  // Appends T tokens of layer l: k/v laid out [T][n_kv_heads][head_dim] (as the projections
  // produce them), positions pos[T], kinds[T], stored as row_storage() says (fp16: rounded to
  // half precision). Consecutive tokens of one kind go to one segment; a token whose kind
  // equals the last segment's kind extends that segment when that segment is still dense in
  // the store's row storage (otherwise a new dense segment starts). With `as_given` the values
  // are kept as they are (what a cache holds already, e.g. a quantized row's dequantization).
  void append(int l, const float* k, const float* v, const int32_t* pos, const SegmentKind* kinds,
              int T, bool as_given = false);

  // Number of rows KV head h of layer l holds over all segments.
  int n_rows(int l, int h) const;
  // Gathers layer l, KV head h into contiguous [n][head_dim] buffers (the order of segments).
  // Throws InternalError when a segment of the layer is layout_only.
  void gather(int l, int h, std::vector<float>& k, std::vector<float>& v,
              std::vector<int32_t>& pos, std::vector<SegmentKind>* kinds = nullptr) const;
  // One segment's rows of a head where the store keeps them: what gather concatenates, in the
  // same order, without copying. Valid until the store changes.
  struct RowSpan {
    const float* k;
    const float* v;
    int n;
    SegmentKind kind;
  };
  // Throws InternalError as gather does.
  std::vector<RowSpan> spans(int l, int h) const;
  // A copy of the layout alone: segments with their kinds, storage, bytes, payloads (shared),
  // positions and row annotations, and no k / v rows (every segment layout_only). What
  // diagnostics read of a compressed store, at a small share of a full copy's cost.
  KVStore without_rows() const;
  // Whether every segment holds its rows (none is layout_only).
  bool has_rows() const;
  // The positions and kinds gather would give, without the rows.
  void positions(int l, int h, std::vector<int32_t>& pos, std::vector<SegmentKind>& kinds) const;

  KVBytes bytes(int l) const;
  KVBytes bytes() const;

 private:
  int n_kv_heads_ = 0, head_dim_ = 0;
  RowStorage rows_ = RowStorage::Fp32;
  std::vector<LayerKV> layers_;
};

}  // namespace kvlens
