#include "core/kv_format.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>

#include "core/errors.h"

namespace kvlens::quant {

// ---- packing ----------------------------------------------------------------------------------

int64_t packed_size(int64_t count, int bits) { return (count * bits + 7) / 8; }

int64_t RowCodec::row_code_bytes() const {
  return (mse_bits > 0 ? packed_size(dp, mse_bits) : 0) + (qjl ? packed_size(d, 1) : 0);
}

namespace {
// The 32 × 32 bit transpose: afterwards bit i of A[c] is what bit c of A[i] was.
void transpose32(uint32_t* A) {
  const uint32_t masks[5] = {0x0000FFFFu, 0x00FF00FFu, 0x0F0F0F0Fu, 0x33333333u, 0x55555555u};
  for (int s = 0, j = 16; j; ++s, j >>= 1)
    for (int k = 0; k < 32; ++k) {
      if (k & j) continue;
      const uint32_t t = ((A[k] >> j) ^ A[k + j]) & masks[s];
      A[k] ^= t << j;
      A[k + j] ^= t;
    }
}
}  // namespace

std::vector<uint8_t> channel_major_1bit(const uint8_t* rows, int64_t n, int d) {
  const int64_t row_bytes = d / 8, whole = n / 32 * 32;
  std::vector<uint8_t> out(rows, rows + n * row_bytes);
  // Channel c of row r is bit c & 7 of byte r·d/8 + c/8 (d a multiple of 8). Each 32 × 32 bit
  // block (the group's rows in block_row order, 32 channels) is transposed in registers: word i
  // of A holds row block_row(i)'s 32 channels, bit c being channel c; after the transpose word c
  // holds channel c's 32 codes, bit i being row block_row(i)'s.
  int row_of[32];
  for (int i = 0; i < 32; ++i) row_of[i] = block_row(i);
  auto put = [&](int64_t b, int c, uint32_t w) {
    for (int k = 0; k < 4; ++k) out[static_cast<size_t>((b * d + c) * 4 + k)] = static_cast<uint8_t>(w >> (8 * k));
  };
  for (int64_t b = 0; b < whole / 32; ++b) {
    const uint8_t* group = rows + 32 * b * row_bytes;
    int c0 = 0;
    for (; c0 + 32 <= d; c0 += 32) {
      uint32_t A[32];
      for (int i = 0; i < 32; ++i) {
        const uint8_t* at = group + row_of[i] * row_bytes + c0 / 8;
        A[i] = static_cast<uint32_t>(at[0]) | static_cast<uint32_t>(at[1]) << 8 | static_cast<uint32_t>(at[2]) << 16 |
               static_cast<uint32_t>(at[3]) << 24;
      }
      transpose32(A);
      for (int c = 0; c < 32; ++c) put(b, c0 + c, A[c]);
    }
    for (int c = c0; c < d; ++c) {  // channels past the last 32
      const int byte = c >> 3, shift = c & 7;
      uint32_t w = 0;
      for (int i = 0; i < 32; ++i)
        w |= static_cast<uint32_t>((group[row_of[i] * row_bytes + byte] >> shift) & 1u) << i;
      put(b, c, w);
    }
  }
  return out;
}


std::vector<uint8_t> rows_from_channel_major_1bit(const uint8_t* grouped, int64_t n, int d) {
  const int64_t row_bytes = d / 8, whole = n / 32 * 32;
  std::vector<uint8_t> out(grouped, grouped + n * row_bytes);
  int row_of[32];
  for (int i = 0; i < 32; ++i) row_of[i] = block_row(i);
  auto word = [&](int64_t b, int c) {
    const uint8_t* at = grouped + (b * d + c) * 4;
    return static_cast<uint32_t>(at[0]) | static_cast<uint32_t>(at[1]) << 8 | static_cast<uint32_t>(at[2]) << 16 |
           static_cast<uint32_t>(at[3]) << 24;
  };
  for (int64_t b = 0; b < whole / 32; ++b) {
    uint8_t* group = out.data() + 32 * b * row_bytes;
    int c0 = 0;
    for (; c0 + 32 <= d; c0 += 32) {  // word c0 + c holds channel c0 + c; transposed, row block_row(i)'s channels
      uint32_t A[32];
      for (int c = 0; c < 32; ++c) A[c] = word(b, c0 + c);
      transpose32(A);
      for (int i = 0; i < 32; ++i)
        for (int k = 0; k < 4; ++k) group[row_of[i] * row_bytes + c0 / 8 + k] = static_cast<uint8_t>(A[i] >> (8 * k));
    }
    for (int c = c0; c < d; ++c) {  // channels past the last 32
      const uint32_t w = word(b, c);
      const int byte = c >> 3, shift = c & 7;
      for (int i = 0; i < 32; ++i) {
        uint8_t& x = group[row_of[i] * row_bytes + byte];
        x = static_cast<uint8_t>((x & ~(1u << shift)) | (((w >> i) & 1u) << shift));
      }
    }
  }
  return out;
}

void pack(const uint32_t* codes, int64_t count, int bits, std::vector<uint8_t>& out) {
  const size_t base = out.size();
  out.resize(base + static_cast<size_t>(packed_size(count, bits)), 0);
  uint8_t* p = out.data() + base;
  const uint32_t mask = max_code(bits);
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t c = codes[i] & mask;
    const int64_t bit = i * bits;
    const uint32_t shifted = c << (bit & 7);  // at most 15 bits wide
    p[bit >> 3] |= static_cast<uint8_t>(shifted & 0xffu);
    if ((bit & 7) + bits > 8) p[(bit >> 3) + 1] |= static_cast<uint8_t>(shifted >> 8);
  }
}

uint32_t unpack_one(const uint8_t* p, int64_t i, int bits) {
  const int64_t bit = i * bits;
  uint32_t w = p[bit >> 3];
  if ((bit & 7) + bits > 8) w |= static_cast<uint32_t>(p[(bit >> 3) + 1]) << 8;
  return (w >> (bit & 7)) & max_code(bits);
}

void unpack(const uint8_t* packed, int64_t count, int bits, uint32_t* codes) {
  for (int64_t i = 0; i < count; ++i) codes[i] = unpack_one(packed, i, bits);
}

// ---- axes -------------------------------------------------------------------------------------

Axis parse_axis(const std::string& s) {
  if (s == "global") return Axis::Global;
  if (s == "per-token") return Axis::PerToken;
  if (s == "per-channel") return Axis::PerChannel;
  throw InputError("granularity must be one of global|per-token|per-channel, got " + s);
}

const char* axis_name(Axis a) {
  switch (a) {
    case Axis::Global: return "global";
    case Axis::PerToken: return "per-token";
    case Axis::PerChannel: return "per-channel";
  }
  return "?";
}

// ---- payload ----------------------------------------------------------------------------------

void QuantBlock::shrink_to_fit() {
  codes.shrink_to_fit();
  scales.shrink_to_fit();
  zeros.shrink_to_fit();
  meta.shrink_to_fit();
  flags.shrink_to_fit();
}

KVBytes QuantBlock::allocated() const {
  KVBytes b;
  b.codes = static_cast<int64_t>(codes.capacity());
  b.scales = static_cast<int64_t>(scales.capacity() * sizeof(uint16_t));
  b.zeros = static_cast<int64_t>(zeros.capacity() * sizeof(uint16_t));
  b.meta = static_cast<int64_t>(meta.capacity() * sizeof(uint16_t) + flags.capacity());
  return b;
}

struct QuantPayload::Deferred {
  std::mutex mu;
  KVBytes bytes;
  std::vector<std::function<void()>> lands;
};

namespace {
bool same_bytes(const KVBytes& a, const KVBytes& b) {
  return a.codes == b.codes && a.scales == b.scales && a.zeros == b.zeros && a.indices == b.indices && a.meta == b.meta;
}
}  // namespace

QuantPayload::QuantPayload(const QuantPayload& o) : SegmentPayload(o) { *this = o; }

QuantPayload& QuantPayload::operator=(const QuantPayload& o) {
  if (this == &o) return *this;
  land();
  o.land();
  k = o.k;
  v = o.v;
  tokens = o.tokens;
  layout = o.layout;
  return *this;
}

KVBytes QuantPayload::held() const {
  KVBytes b;
  for (const QuantBlock& q : k) b += q.allocated();
  for (const QuantBlock& q : v) b += q.allocated();
  b += tokens.allocated();
  return b;
}

KVBytes QuantPayload::allocated() const {
  if (!deferred_) return held();
  std::lock_guard<std::mutex> lock(deferred_->mu);
  KVBytes b = held();
  if (!deferred_->lands.empty()) b += deferred_->bytes;
  return b;
}

void QuantPayload::shrink_to_fit() {
  // (deferred arrays land at their exact sizes: only what the host holds is shrunk)
  for (QuantBlock& q : k) q.shrink_to_fit();
  for (QuantBlock& q : v) q.shrink_to_fit();
  tokens.shrink_to_fit();
}

void QuantPayload::defer(KVBytes bytes, std::function<void()> land_fn) {
  if (!deferred_) deferred_ = std::make_shared<Deferred>();
  std::lock_guard<std::mutex> lock(deferred_->mu);
  deferred_->bytes += bytes;
  deferred_->lands.push_back(std::move(land_fn));
}

bool QuantPayload::deferred() const {
  if (!deferred_) return false;
  std::lock_guard<std::mutex> lock(deferred_->mu);
  return !deferred_->lands.empty();
}

void QuantPayload::land() const {
  if (!deferred_) return;
  std::lock_guard<std::mutex> lock(deferred_->mu);
  if (deferred_->lands.empty()) return;
  KVBytes want = held();
  want += deferred_->bytes;
  // (the list is emptied first: a landing that throws is not tried again on half-written blocks)
  std::vector<std::function<void()>> lands = std::move(deferred_->lands);
  deferred_->lands.clear();
  deferred_->bytes = KVBytes{};
  for (const std::function<void()>& f : lands) f();
  const KVBytes got = held();
  if (!same_bytes(got, want))
    throw InternalError("QuantPayload::land: the landed arrays hold " + std::to_string(got.total()) +
                        " bytes, their deferral counted " + std::to_string(want.total()));
}

const QuantPayload* landed(const SegmentPayload* p) {
  const auto* q = dynamic_cast<const QuantPayload*>(p);
  if (q) q->land();
  return q;
}

ZipSlots zip_slots(const std::vector<std::array<std::vector<int32_t>, 2>>& pos) {
  ZipSlots z;
  int32_t top = -1;
  for (const auto& h : pos)
    for (const std::vector<int32_t>& s : h)
      for (int32_t x : s) {
        if (x < 0) throw InternalError("zipcache group: a row at position " + std::to_string(x));
        top = std::max(top, x);
      }
  for (std::vector<int32_t>& a : z.at) a.assign(static_cast<size_t>(top) + 1, -1);
  for (const auto& h : pos)
    for (int s = 0; s < 2; ++s)
      for (int32_t x : h[static_cast<size_t>(s)]) z.at[static_cast<size_t>(s)][static_cast<size_t>(x)] = 0;
  for (int s = 1; s >= 0; --s) {
    for (int32_t& e : z.at[static_cast<size_t>(s)])
      if (e == 0) e = static_cast<int32_t>(z.n++);
    if (s == 1) z.salient = z.n;
  }
  z.one_table = true;
  for (const auto& h : pos)
    for (int s = 1; s >= 0 && z.one_table; --s) {
      const std::vector<int32_t>& x = h[static_cast<size_t>(s)];
      const int64_t first = s ? 0 : z.salient;
      z.one_table = static_cast<int64_t>(x.size()) == (s ? z.salient : z.n - z.salient);
      for (size_t k = 0; z.one_table && k < x.size(); ++k) z.one_table = z.of(s, x[k]) == first + static_cast<int64_t>(k);
    }
  return z;
}

// ---- rotations -------------------------------------------------------------------------------

void hadamard(float* x, int n) {
  for (int len = 1; len < n; len <<= 1)
    for (int i = 0; i < n; i += len << 1)
      for (int j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
  const float s = 1.0f / std::sqrt(static_cast<float>(n));
  for (int i = 0; i < n; ++i) x[i] *= s;
}

void block_hadamard(float* x, int d, int block) {
  for (int b = 0; b + block <= d; b += block) hadamard(x + b, block);
}

int hadamard_block(int asked, int d) {
  if (asked > 0) return asked;
  int b = 16;
  while (b > 1 && d % b != 0) b /= 2;
  return b;
}

}  // namespace kvlens::quant
