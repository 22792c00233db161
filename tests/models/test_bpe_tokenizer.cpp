// Byte-level BPE tokenizer.json (models/bpe_tokenizer.cpp) against HF `tokenizers` on texts that
// reach each part: contractions, digit runs, whitespace runs and newlines, accents composed and
// decomposed (NFC), Greek, CJK, emoji, special tokens inside text; in the layouts of GPT-2,
// Llama-3 (ignore_merges, a BOS from the post-processor) and Qwen2 (NFC, digits one by one).
// The fixtures and HF's ids come from tests/make_bpe_fixtures.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "models/bpe_tokenizer.h"
#include "models/tokenizer.h"
#include "tests/test_expect.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;
using kt::expect_input_error;

namespace {

const std::string kRoot = kt::source_dir() + "/tests/fixtures/tokenizers/";

class BpeFixture : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(BpeFixture, IdsAndTextAreHfTokenizers) {
  const std::string dir = kRoot + GetParam();
  const Tokenizer tok = Tokenizer::load(dir, -1, false);
  ASSERT_TRUE(tok.byte_level());
  const nlohmann::json cases = kt::read_json(dir + "/cases.json");
  EXPECT_EQ(tok.sp_vocab_size(), cases["vocab_size"].get<int>());
  ASSERT_GE(cases["cases"].size(), GetParam() == "ignore_merges_probe" ? 3u : 15u);
  // The Qwen2 layout normalizes to NFC: without ICU its non-ASCII cases must be refused, by name.
  int unnormalized = 0;
  for (const auto& c : cases["cases"]) {
    const std::string text = c["text"].get<std::string>();
    SCOPED_TRACE(text);
    if (GetParam() == "qwen2_style" && !ByteLevelBpe::nfc_available() &&
        std::any_of(text.begin(), text.end(), [](char ch) { return static_cast<unsigned char>(ch) >= 0x80; })) {
      EXPECT_NE(kt::error_of([&] { tok.encode(text); }).find("built without ICU"), std::string::npos);
      ++unnormalized;
      continue;
    }
    const std::vector<int> ids = c["ids"].get<std::vector<int>>();
    EXPECT_EQ(tok.encode(text), ids);
    EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>());
    // Cut short, the ids may end inside a character: HF writes U+FFFD for the bytes it has.
    if (c.contains("decoded_prefixes")) {
      for (size_t k = 1; k < ids.size(); ++k) {
        EXPECT_EQ(tok.decode(std::vector<int>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k))),
                  c["decoded_prefixes"][k - 1].get<std::string>())
            << "the first " << k << " ids";
      }
    }
    // With the post-processor's special tokens: BOS first where the family puts one.
    std::vector<int> with;
    if (tok.add_bos()) with.push_back(tok.bos_id());
    with.insert(with.end(), ids.begin(), ids.end());
    EXPECT_EQ(with, c["ids_with_special_tokens"].get<std::vector<int>>());
  }
  if (unnormalized > 0)
    GTEST_SKIP() << unnormalized << " non-ASCII cases are not checked: this kvlens was built without ICU (libicu-dev)";
}

INSTANTIATE_TEST_SUITE_P(Families, BpeFixture, ::testing::Values("gpt2_style", "llama3_style", "qwen2_style",
                                                                     "ignore_merges_probe"));

// What the families' configs say: Llama-3's BOS comes from its post-processor, Qwen2 has none;
// the EOS is tokenizer_config's eos_token; a prompt template's ids start with the BOS.
TEST(BpeTokenizer, BosAndEosAreTheFamilysOwn) {
  const Tokenizer llama = Tokenizer::load(kRoot + "llama3_style", -1, false);
  EXPECT_TRUE(llama.add_bos());
  EXPECT_EQ(llama.piece(llama.bos_id()), "<|begin_of_text|>");
  EXPECT_EQ(llama.piece(llama.eos_id()), "<|eot_id|>");
  const std::vector<int> p = llama.encode_prompt("{prompt}", "Describe the image.", 0);
  ASSERT_FALSE(p.empty());
  EXPECT_EQ(p.front(), llama.bos_id());
  const Tokenizer qwen = Tokenizer::load(kRoot + "qwen2_style", -1, false);
  EXPECT_FALSE(qwen.add_bos());
  EXPECT_EQ(qwen.piece(qwen.eos_id()), "<|im_end|>");
  EXPECT_EQ(qwen.encode_prompt("{prompt}", "x", 0), qwen.encode("x"));
}

TEST(BpeTokenizer, FilesItCannotReadAreRefusedNamingThePart) {
  const nlohmann::json good = kt::read_json(kRoot + "qwen2_style/tokenizer.json");
  auto edited = [&](const std::function<void(nlohmann::json&)>& e) {
    nlohmann::json j = good;
    e(j);
    return j;
  };
  expect_input_error([&] { ByteLevelBpe::from_json(edited([](nlohmann::json& j) {
                             j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}};
                           }), "t.json"); },
                     "t.json: pre-tokenizer 'Metaspace' is not one kvlens reads");
  expect_input_error([&] { ByteLevelBpe::from_json(edited([](nlohmann::json& j) {
                             j["normalizer"] = {{"type", "Lowercase"}};
                           }), "t.json"); },
                     "t.json: normalizer 'Lowercase' is not one kvlens applies");
  expect_input_error([&] { ByteLevelBpe::from_json(edited([](nlohmann::json& j) {
                             j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
                           }), "t.json"); },
                     "the pre-tokenizer pattern '(unclosed' does not compile");
  expect_input_error([&] { ByteLevelBpe::from_json(edited([](nlohmann::json& j) { j["model"]["type"] = "WordPiece"; }), "t.json"); },
                     "model type 'WordPiece' is not one kvlens reads");
  expect_input_error([&] { ByteLevelBpe::from_json(edited([](nlohmann::json& j) {
                             j["pre_tokenizer"] = j["pre_tokenizer"]["pretokenizers"][0];
                           }), "t.json"); },
                     "not a byte-level BPE");
  // Text that is not UTF-8 is refused, not split mid-character.
  const ByteLevelBpe bpe = ByteLevelBpe::from_json(good, "t.json");
  expect_input_error([&] { bpe.encode(std::string("caf\xC3", 4)); }, "not valid UTF-8");
  // A folder with neither tokenizer file names both.
  expect_input_error([&] { Tokenizer::load(kt::make_temp_dir("notok"), -1, false); },
                     "no tokenizer.model (SentencePiece) or tokenizer.json (byte-level BPE)");
}
