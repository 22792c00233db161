// Rotary frequencies (core/rope.h): the default table, and Llama-3.1's scaling band by band against
// the formula in double precision; configs that ask for a scaling kvlens lacks are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/backend.h"
#include "core/rope.h"
#include "kernels/backends.h"
#include "models/config.h"

using namespace kvlens;

TEST(Rope, Llama3ScalingKeepsHighDividesLowAndBlendsTheBandBetween) {
  Rope r(500000.0f);
  const std::vector<float> plain = r.inv_freq(16);
  r.type = "llama3";
  r.factor = 8;
  r.low_freq_factor = 1;
  r.high_freq_factor = 4;
  r.original_max_position = 64;
  const std::vector<float> scaled = r.inv_freq(16);
  ASSERT_EQ(scaled.size(), 8u);
  int kept = 0, divided = 0, blended = 0;
  for (int i = 0; i < 8; ++i) {
    const double f = std::pow(500000.0, -2.0 * i / 16), wavelen = 2 * M_PI / f;
    double want;
    if (wavelen < 64.0 / 4) {
      want = f, ++kept;
    } else if (wavelen > 64.0 / 1) {
      want = f / 8, ++divided;
    } else {
      const double s = (64.0 / wavelen - 1) / (4 - 1);
      want = (1 - s) * f / 8 + s * f, ++blended;
    }
    EXPECT_NEAR(scaled[i], want, 4e-7 * want) << "i = " << i;
    EXPECT_NEAR(plain[i], f, 4e-7 * f) << "i = " << i;
  }
  EXPECT_EQ(kept, 1);
  EXPECT_EQ(blended, 1);
  EXPECT_EQ(divided, 6);
  EXPECT_NE(r.key(), Rope(500000.0f).key());
}

TEST(Rope, ScalingsKvlensLacksAreRefusedNamingThem) {
  nlohmann::json j = {{"model_type", "llama"}, {"hidden_size", 64}, {"num_attention_heads", 4},
                      {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}}};
  try {
    parse_text_only_config(j, "c.json");
    ADD_FAILURE() << "yarn accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("c.json: rope_scaling rope_type 'yarn' is not supported"), std::string::npos) << e.what();
  }
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}};
  try {
    parse_text_only_config(j, "c.json");
    ADD_FAILURE() << "llama3 without original_max_position_embeddings accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("needs 'original_max_position_embeddings'"), std::string::npos) << e.what();
  }
  j["rope_scaling"]["original_max_position_embeddings"] = 8192;
  j["rope_scaling"]["high_freq_factor"] = 0.5;
  try {
    parse_text_only_config(j, "c.json");
    ADD_FAILURE() << "high_freq_factor below low_freq_factor accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("high_freq_factor 0.5 must exceed low_freq_factor 1"), std::string::npos) << e.what();
  }
  j["rope_scaling"]["high_freq_factor"] = 4.0;
  const LlamaConfig c = parse_text_only_config(j, "c.json");
  EXPECT_EQ(c.rope.type, "llama3");
  EXPECT_EQ(c.rope.original_max_position, 8192);
}

// Sectioned rotation on the CPU backend: frequency i takes its section's row of positions
// (Qwen2-VL's M-RoPE), the axial table repeats a half-width table per section, and with one row
// of positions a sectioned rope rotates as the plain one does (a text token's positions agree).
TEST(Rope, SectionsTakeTheirOwnRowOfPositions) {
  const int T = 3, D = 8;
  auto backend = make_backend(BackendOptions{});
  AttnLayout l;
  l.T = T; l.n_heads = 1; l.n_kv_heads = 1; l.head_dim = D; l.row_stride = 3 * D;
  l.q_col = 0; l.k_col = D; l.v_col = 2 * D;
  std::vector<float> x(static_cast<size_t>(T) * 3 * D);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7 * i + 0.3);
  Rope m(100.0f);
  m.sections = {1, 2, 1};
  const std::vector<int32_t> pos{0, 5, 9, 2, -7, 4, 11, 1, 3};  // [3][T]
  Buffer X = backend->alloc("x", {T, 3 * D}, Dt::F32), P = backend->alloc("p", {3, T}, Dt::I32);
  backend->upload(x.data(), X);
  backend->upload(pos.data(), P);
  backend->rope(X, l, P, m);
  const std::vector<int> row{0, 1, 1, 2};
  for (int t = 0; t < T; ++t)
    for (int part = 0; part < 2; ++part)
      for (int i = 0; i < D / 2; ++i) {
        const double inv = std::pow(100.0, -2.0 * i / D), ang = pos[static_cast<size_t>(row[i] * T + t)] * inv;
        const size_t a = static_cast<size_t>(t * 3 * D + part * D + i), b = a + D / 2;
        EXPECT_NEAR(X.as<float>()[a], x[a] * std::cos(ang) - x[b] * std::sin(ang), 1e-5) << t << " " << i;
        EXPECT_NEAR(X.as<float>()[b], x[b] * std::cos(ang) + x[a] * std::sin(ang), 1e-5) << t << " " << i;
      }
  // One row of positions: as the plain rope.
  Buffer Y = backend->alloc("y", {T, 3 * D}, Dt::F32), Z = backend->alloc("z", {T, 3 * D}, Dt::F32);
  backend->upload(x.data(), Y);
  backend->upload(x.data(), Z);
  Buffer P1 = backend->alloc("p1", {T}, Dt::I32);
  backend->upload(pos.data(), P1);
  backend->rope(Y, l, P1, m);
  backend->rope(Z, l, P1, Rope(100.0f));
  for (int64_t i = 0; i < Y.numel(); ++i) EXPECT_EQ(Y.as<float>()[i], Z.as<float>()[i]) << i;
  // Axial: sections of a D/2-wide table.
  Rope ax(100.0f);
  ax.type = "axial";
  ax.sections = {2, 2};
  const std::vector<float> inv = ax.inv_freq(D);
  for (int i = 0; i < D / 2; ++i) EXPECT_NEAR(inv[static_cast<size_t>(i)], std::pow(100.0, -2.0 * (i % 2) / (D / 2)), 1e-7);
  Rope bad = m;
  bad.sections = {1, 1, 1};
  EXPECT_THROW(bad.row_of(D), InternalError);
}
