#include "core/kv_store.h"

#include <algorithm>
#include <cstddef>

#include "core/errors.h"
#include "core/half.h"

namespace kvlens {

const char* segment_kind_name(SegmentKind k) {
  switch (k) {
    case SegmentKind::System: return "system";
    case SegmentKind::Visual: return "visual";
    case SegmentKind::PostVisionText: return "post_vision_text";
    case SegmentKind::Generated: return "generated";
  }
  return "?";
}

const char* row_storage_name(RowStorage s) { return s == RowStorage::Fp16 ? "fp16" : "fp32"; }

RowStorage parse_row_storage(const std::string& s, const std::string& what) {
  if (s == "fp16") return RowStorage::Fp16;
  if (s == "fp32") return RowStorage::Fp32;
  throw InputError(what + " must be fp16 or fp32, got '" + s + "'");
}

int row_storage_bytes(RowStorage s) { return s == RowStorage::Fp16 ? 2 : 4; }

KVBytes KVSegment::dense_bytes(int head_dim, int bytes_per_value) const {
  KVBytes b;
  for (const HeadRows& h : heads) {
    b.codes += 2LL * h.n() * head_dim * bytes_per_value;
    b.indices += static_cast<int64_t>(h.n()) * static_cast<int64_t>(sizeof(int32_t));
  }
  return b;
}

KVStore::KVStore(int n_layers, int n_kv_heads, int head_dim, RowStorage rows)
    : n_kv_heads_(n_kv_heads), head_dim_(head_dim), rows_(rows), layers_(n_layers) {}

void KVStore::set_row_storage(RowStorage rows) {
  rows_ = rows;
  if (rows != RowStorage::Fp16) return;
  for (LayerKV& L : layers_)
    for (KVSegment& s : L.segments) {
      if (!s.dense() || s.storage == "fp16") continue;
      for (HeadRows& r : s.heads) {
        round_half_n(r.k.data(), static_cast<int64_t>(r.k.size()));
        round_half_n(r.v.data(), static_cast<int64_t>(r.v.size()));
      }
      s.storage = "fp16";
      s.bytes = s.dense_bytes(head_dim_, 2);
    }
}

void KVStore::append(int l, const float* k, const float* v, const int32_t* pos,
                     const SegmentKind* kinds, int T, bool as_given) {
  LayerKV& L = layers_.at(l);
  const int H = n_kv_heads_, D = head_dim_;
  const char* label = row_storage_name(rows_);
  const bool half = rows_ == RowStorage::Fp16 && !as_given;
  // A run of tokens of one kind at a time, each head's rows of the run appended together.
  for (int t0 = 0; t0 < T;) {
    int t1 = t0 + 1;
    while (t1 < T && kinds[t1] == kinds[t0]) ++t1;
    if (L.segments.empty() || L.segments.back().kind != kinds[t0] || !L.segments.back().dense() ||
        L.segments.back().storage != label || L.segments.back().layout_only) {
      KVSegment s;
      s.kind = kinds[t0];
      s.storage = label;
      s.heads.resize(H);
      L.segments.push_back(std::move(s));
    }
    KVSegment& s = L.segments.back();
    const size_t n = static_cast<size_t>(t1 - t0);
    for (int h = 0; h < H; ++h) {
      HeadRows& r = s.heads[h];
      const size_t at = r.k.size();
      r.k.resize(at + n * D);
      r.v.resize(at + n * D);
      for (int t = t0; t < t1; ++t) {
        const int64_t src = (static_cast<int64_t>(t) * H + h) * D;
        std::copy_n(k + src, D, r.k.begin() + static_cast<ptrdiff_t>(at + static_cast<size_t>(t - t0) * D));
        std::copy_n(v + src, D, r.v.begin() + static_cast<ptrdiff_t>(at + static_cast<size_t>(t - t0) * D));
      }
      if (half) {
        round_half_n(r.k.data() + at, static_cast<int64_t>(n) * D);
        round_half_n(r.v.data() + at, static_cast<int64_t>(n) * D);
      }
      r.pos.insert(r.pos.end(), pos + t0, pos + t1);
    }
    s.bytes = s.dense_bytes(D, row_storage_bytes(rows_));
    t0 = t1;
  }
}

int KVStore::n_rows(int l, int h) const {
  int n = 0;
  for (const KVSegment& s : layers_.at(l).segments) n += s.heads.at(h).n();
  return n;
}

std::vector<KVStore::RowSpan> KVStore::spans(int l, int h) const {
  std::vector<RowSpan> out;
  for (const KVSegment& s : layers_.at(l).segments) {
    if (s.layout_only)
      throw InternalError("KV store: layer " + std::to_string(l) + " holds the layout of its " +
                          segment_kind_name(s.kind) + " rows only (the rows are in the device cache)");
    const HeadRows& r = s.heads.at(h);
    if (static_cast<int64_t>(r.k.size()) != static_cast<int64_t>(r.n()) * head_dim_ ||
        r.v.size() != r.k.size())
      throw InternalError("KV store: layer " + std::to_string(l) + " head " + std::to_string(h) +
                          " rows and positions disagree");
    out.push_back({r.k.data(), r.v.data(), r.n(), s.kind});
  }
  return out;
}

void KVStore::gather(int l, int h, std::vector<float>& k, std::vector<float>& v,
                     std::vector<int32_t>& pos, std::vector<SegmentKind>* kinds) const {
  const std::vector<RowSpan> rows = spans(l, h);  // checks the segments first
  k.clear();
  v.clear();
  pos.clear();
  if (kinds) kinds->clear();
  const auto& segs = layers_.at(l).segments;
  for (size_t i = 0; i < rows.size(); ++i) {
    const size_t n = static_cast<size_t>(rows[i].n) * head_dim_;
    k.insert(k.end(), rows[i].k, rows[i].k + n);
    v.insert(v.end(), rows[i].v, rows[i].v + n);
    const std::vector<int32_t>& p = segs[i].heads.at(h).pos;
    pos.insert(pos.end(), p.begin(), p.end());
    if (kinds) kinds->insert(kinds->end(), p.size(), rows[i].kind);
  }
}

KVStore KVStore::without_rows() const {
  KVStore out;
  out.n_kv_heads_ = n_kv_heads_;
  out.head_dim_ = head_dim_;
  out.rows_ = rows_;
  out.layers_.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l)
    for (const KVSegment& s : layers_[l].segments) {
      KVSegment c;
      c.kind = s.kind;
      c.storage = s.storage;
      c.bytes = s.bytes;
      c.payload = s.payload;
      c.layout_only = true;
      c.heads.resize(s.heads.size());
      for (size_t h = 0; h < s.heads.size(); ++h) {
        c.heads[h].pos = s.heads[h].pos;
        c.heads[h].bits = s.heads[h].bits;
        c.heads[h].merged = s.heads[h].merged;
      }
      out.layers_[l].segments.push_back(std::move(c));
    }
  return out;
}

bool KVStore::has_rows() const {
  for (const LayerKV& L : layers_)
    for (const KVSegment& s : L.segments)
      if (s.layout_only) return false;
  return true;
}

void KVStore::positions(int l, int h, std::vector<int32_t>& pos, std::vector<SegmentKind>& kinds) const {
  pos.clear();
  kinds.clear();
  for (const KVSegment& s : layers_.at(l).segments) {
    const HeadRows& r = s.heads.at(h);
    pos.insert(pos.end(), r.pos.begin(), r.pos.end());
    kinds.insert(kinds.end(), r.pos.size(), s.kind);
  }
}

KVBytes KVStore::bytes(int l) const {
  KVBytes b;
  for (const KVSegment& s : layers_.at(l).segments) b += s.bytes;
  return b;
}

KVBytes KVStore::bytes() const {
  KVBytes b;
  for (int l = 0; l < n_layers(); ++l) b += bytes(l);
  return b;
}

}  // namespace kvlens
