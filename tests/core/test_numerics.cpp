// Checkpoint numerics: every fp16 and bf16 bit pattern decoded by the safetensors loader,
// compared bit for bit with an independent conversion written here from the IEEE 754 field
// layout (and, where the CPU has F16C, with the hardware conversion); shapes whose element
// count fits in 64 bits but whose byte count wraps.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <nlohmann/json.hpp>

#include "core/half.h"
#include "core/errors.h"
#include "models/safetensors.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;

namespace {

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// binary16: 1 sign, 5 exponent (bias 15), 10 fraction bits. Subnormals are m·2^-24, normals
// (1024 + m)·2^(e−25); every value is exact in binary32. Infinities keep their sign; NaNs widen
// with sign and payload kept (fraction moved to the top of the binary32 fraction), as IEEE
// 754's format conversion and numpy / PyTorch do.
uint32_t expected_f16(uint16_t h) {
  const bool neg = h >> 15;
  const int e = (h >> 10) & 31, m = h & 1023;
  if (e == 31) return (neg ? 0x80000000u : 0u) | 0x7f800000u | (static_cast<uint32_t>(m) << 13);
  const double mag = e == 0 ? std::ldexp(static_cast<double>(m), -24) : std::ldexp(1024.0 + m, e - 25);
  return bits_of(static_cast<float>(neg ? -mag : mag)) | (neg ? 0x80000000u : 0u);  // keeps −0
}

// bfloat16: 1 sign, 8 exponent (bias 127), 7 fraction bits: the top half of a binary32.
// Subnormals m·2^-133, normals (128 + m)·2^(e−134).
uint32_t expected_bf16(uint16_t h) {
  const bool neg = h >> 15;
  const int e = (h >> 7) & 255, m = h & 127;
  if (e == 255) return (neg ? 0x80000000u : 0u) | 0x7f800000u | (static_cast<uint32_t>(m) << 16);
  const double mag = e == 0 ? std::ldexp(static_cast<double>(m), -133) : std::ldexp(128.0 + m, e - 134);
  return bits_of(static_cast<float>(neg ? -mag : mag)) | (neg ? 0x80000000u : 0u);
}



using kvlens::testing::error_of;

}  // namespace

TEST(HalfDecoding, EveryF16AndBf16PatternBitForBit) {
  std::string data(2 * 2 * 65536, '\0');
  for (uint32_t i = 0; i < 65536; ++i) {
    data[2 * i] = static_cast<char>(i & 0xff);
    data[2 * i + 1] = static_cast<char>(i >> 8);
  }
  std::memcpy(&data[2 * 65536], &data[0], 2 * 65536);
  nlohmann::json h;
  h["f16"] = {{"dtype", "F16"}, {"shape", {256, 256}}, {"data_offsets", {0, 131072}}};
  h["bf16"] = {{"dtype", "BF16"}, {"shape", {65536}}, {"data_offsets", {131072, 262144}}};
  const std::string dir = kt::make_temp_dir("half");
  kt::write_file(dir + "/model.safetensors", kvlens::testing::safetensors_bytes(h, data));
  const WeightStore ws = WeightStore::open_dir(dir);
  const Tensor f16 = ws.load("f16"), bf16 = ws.load("bf16");
  ASSERT_EQ(f16.data.size(), 65536u);
  ASSERT_EQ(bf16.data.size(), 65536u);
  int subnormals = 0, nans = 0, infs = 0, mismatches = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t x = static_cast<uint16_t>(i);
    const uint32_t got = bits_of(f16.data[i]), want = expected_f16(x);
    if (got != want && ++mismatches <= 8)
      ADD_FAILURE() << "F16 0x" << std::hex << i << ": got 0x" << got << ", want 0x" << want;
    const uint32_t gotb = bits_of(bf16.data[i]), wantb = expected_bf16(x);
    if (gotb != wantb && ++mismatches <= 8)
      ADD_FAILURE() << "BF16 0x" << std::hex << i << ": got 0x" << gotb << ", want 0x" << wantb;
    const int e = (x >> 10) & 31, m = x & 1023;
    subnormals += e == 0 && m != 0;
    nans += std::isnan(f16.data[i]);
    infs += std::isinf(f16.data[i]);
#if defined(__F16C__)
    // The CPU's own conversion agrees on every non-NaN pattern (it quiets signalling NaNs).
    if (!std::isnan(f16.data[i]) && got != bits_of(_cvtsh_ss(x)) && ++mismatches <= 8)
      ADD_FAILURE() << "F16 0x" << std::hex << i << " differs from F16C";
#endif
  }
  EXPECT_EQ(mismatches, 0);
  // The classes the conversion must get right were all exercised.
  EXPECT_EQ(subnormals, 2 * 1023);
  EXPECT_EQ(nans, 2 * 1023);
  EXPECT_EQ(infs, 2);
  // Spot values written out: the smallest subnormal, the largest subnormal, the smallest
  // normal, the largest finite, −0, −inf.
  EXPECT_EQ(f16.data[0x0001], std::ldexp(1.0f, -24));
  EXPECT_EQ(f16.data[0x03ff], std::ldexp(1023.0f, -24));
  EXPECT_EQ(f16.data[0x0400], std::ldexp(1.0f, -14));
  EXPECT_EQ(f16.data[0x7bff], 65504.0f);
  EXPECT_EQ(bits_of(f16.data[0x8000]), 0x80000000u);
  EXPECT_EQ(f16.data[0xfc00], -INFINITY);
  EXPECT_EQ(bf16.data[0x0001], from_bits(0x00010000u));  // bf16 subnormal 2^-133
  EXPECT_EQ(bf16.data[0x7f80], INFINITY);
  EXPECT_EQ(bf16.data[0x3f80], 1.0f);
}

// A shape whose element count fits in 64 bits but whose byte count wraps: [2^61, 2] F32 is 2^62
// elements and 2^64 bytes, which is 0 modulo 2^64 and would match data_offsets [0, 0].
// `got` is `want` bit for bit, or both are NaNs (a NaN's payload may differ).
static void expect_same_float(float got, float want, const std::string& what) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << what;
    return;
  }
  uint32_t a, b;
  std::memcpy(&a, &got, 4);
  std::memcpy(&b, &want, 4);
  EXPECT_EQ(a, b) << what;
}

// The bulk widening of halves gives the scalar conversion's float for every one of the 65536
// patterns (NaNs stay NaNs), at a length that leaves a scalar tail.
TEST(HalfDecoding, BulkEqualsScalarForEveryPattern) {
  std::vector<uint16_t> h(65536 + 5);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(i * 40503u);  // every pattern (odd multiplier)
  std::vector<float> out(h.size());
  from_half_n(h.data(), out.data(), static_cast<int64_t>(h.size()));
  for (size_t i = 0; i < h.size(); ++i) {
    std::ostringstream what;
    what << "half 0x" << std::hex << h[i];
    expect_same_float(out[i], from_half(h[i]), what.str());
  }
}

TEST(SafetensorsShapes, ByteCountThatWrapsIsRefused) {
  const std::string dir = kt::make_temp_dir("wrap");
  const std::string p = dir + "/model.safetensors";
  const std::string four = std::string(4, '\0');
  struct Case {
    std::vector<int64_t> shape;
    const char* dtype;
  };
  for (const Case& c : {Case{{int64_t{1} << 61, 2}, "F32"}, Case{{2, int64_t{1} << 61}, "F32"},
                        Case{{int64_t{1} << 60, 2}, "F64"}, Case{{int64_t{1} << 62, 2}, "BF16"},
                        Case{{3, int64_t{1} << 61, 1}, "F32"}}) {
    nlohmann::json h;
    h["w"] = {{"dtype", c.dtype}, {"shape", c.shape}, {"data_offsets", {0, 0}}};
    h["ok"] = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}};
    kt::write_file(p, kvlens::testing::safetensors_bytes(h, four));
    const std::string e = error_of([&] { SafetensorsFile f(p); });
    EXPECT_NE(e.find("tensor 'w'"), std::string::npos) << c.dtype << ": " << e;
    EXPECT_NE(e.find("overflows 64-bit byte counts"), std::string::npos) << c.dtype << ": " << e;
    EXPECT_NE(e.find(p), std::string::npos) << e;
  }
  // The largest byte counts that fit are not refused for overflow (they fail on the offsets).
  nlohmann::json h;
  h["w"] = {{"dtype", "F32"}, {"shape", {(int64_t{1} << 61) - 1}}, {"data_offsets", {0, 4}}};
  kt::write_file(p, kvlens::testing::safetensors_bytes(h, four));
  const std::string e = error_of([&] { SafetensorsFile f(p); });
  EXPECT_EQ(e.find("overflows"), std::string::npos) << e;
  EXPECT_NE(e.find("needs 9223372036854775804 bytes"), std::string::npos) << e;
}

// The bulk rounding to fp16 (F16C where the CPU has it) gives what the scalar conversion gives,
// value for value: ties to even, the subnormal range, overflow to infinity, the largest halves,
// signed zeros, infinities, float subnormals, and random values of every magnitude; the bulk
// conversion to fp16 bits likewise, bit for bit. A NaN stays a NaN. Lengths that are not
// multiples of the vector width exercise the scalar tail.
TEST(HalfRounding, BulkEqualsScalar) {
  std::vector<float> x = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, -65504.0f, 65519.99f, 65520.0f, 1e9f, -1e9f,
                          INFINITY, -INFINITY, 5.96046448e-8f, 2.98023224e-8f, 2.98023254e-8f, 8.9407e-8f,
                          6.1035156e-5f, 6.0975552e-5f, 1e-40f, -1e-40f, 1.0009765625f, 1.00048828125f,
                          1.00146484375f, 2049.0f, 2051.0f, 0.1f, 1.0f / 3};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-30, 20);
  for (int i = 0; i < 20000; ++i) x.push_back(std::ldexp(mant(rng), ex(rng)));
  for (uint32_t bits = 0x33000000u; bits < 0x33000000u + 4096; ++bits) {  // around half's smallest subnormal
    float f;
    std::memcpy(&f, &bits, 4);
    x.push_back(f);
  }
  x.push_back(NAN);
  for (const size_t n : {x.size(), x.size() - 3, size_t{7}, size_t{1}}) {
    std::vector<float> bulk(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(n));
    std::vector<uint16_t> halves(n);
    to_half_n(bulk.data(), halves.data(), static_cast<int64_t>(n));
    round_half_n(bulk.data(), static_cast<int64_t>(n));
    for (size_t i = 0; i < n; ++i) {
      const std::string what = "x = " + std::to_string(x[i]) + " (index " + std::to_string(i) + " of " + std::to_string(n) + ")";
      expect_same_float(bulk[i], round_half(x[i]), what);
      if (std::isnan(x[i])) {  // a NaN stays a NaN (exponent all ones, mantissa not zero)
        EXPECT_EQ(halves[i] & 0x7c00u, 0x7c00u) << what;
        EXPECT_NE(halves[i] & 0x3ffu, 0u) << what;
      } else {
        EXPECT_EQ(halves[i], to_half(x[i])) << what;
      }
    }
  }
}
