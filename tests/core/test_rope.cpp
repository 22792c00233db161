// Rotary frequencies (core/rope.h): the default table, and Llama-3.1's scaling band by band against
// the formula in double precision; configs that ask for a scaling kvlens lacks are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/rope.h"
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
