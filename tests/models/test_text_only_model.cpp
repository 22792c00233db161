// Text-only decoders behind the model interface (models/llama_text.cpp): the config read from
// its top level, the checkpoint's layout refused with messages that name what is wrong, and
// Mistral's sliding window as the bound of a sequence. Parity with HF transformers is in
// test_parity / test_hf_values (the llama_text_* and mistral_* fixtures).
#include <gtest/gtest.h>

#include <algorithm>

#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "models/config.h"
#include "models/model.h"
#include "tests/test_expect.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;
using kt::expect_input_error;

namespace {

const std::string kLlama = kt::source_dir() + "/tests/fixtures/hf/llama_text_fp32_tied";
const std::string kMistral = kt::source_dir() + "/tests/fixtures/hf/mistral_gqa_bf16_shard";

// A copy of fixture `from` with its config.json edited by `edit`.
std::string edited_copy(const std::string& from, const std::string& tag, const std::function<void(nlohmann::json&)>& edit) {
  return kt::edited_copy(from, tag, "config.json", edit);
}

}  // namespace

TEST(TextOnlyModel, ConfigIsReadFromItsTopLevel) {
  const LlamaConfig c = load_text_only_config(kMistral + "/config.json");
  const auto j = kt::read_json(kMistral + "/config.json");
  EXPECT_EQ(c.num_key_value_heads, j["num_key_value_heads"].get<int>());
  EXPECT_EQ(c.head_dim, j["head_dim"].get<int>());
  EXPECT_EQ(c.sliding_window, j["sliding_window"].get<int>());
  EXPECT_EQ(c.max_context(), std::min(c.sliding_window, c.max_position_embeddings));
  const LlamaConfig l = load_text_only_config(kLlama + "/config.json");
  EXPECT_TRUE(l.tie_word_embeddings);
  EXPECT_EQ(l.sliding_window, 0);
  EXPECT_EQ(l.max_context(), l.max_position_embeddings);
  // Keys a Mistral config leaves out take MistralConfig's defaults (a null window: none).
  nlohmann::json bare = {{"model_type", "mistral"}, {"hidden_size", 64}, {"num_attention_heads", 16}};
  const LlamaConfig md = parse_text_only_config(bare, "cfg");
  EXPECT_EQ(md.num_key_value_heads, 8);
  EXPECT_EQ(md.sliding_window, 4096);
  EXPECT_EQ(md.max_position_embeddings, 131072);
  EXPECT_EQ(md.intermediate_size, 14336);
  bare["sliding_window"] = nullptr;
  EXPECT_EQ(parse_text_only_config(bare, "cfg").sliding_window, 0);
  bare["model_type"] = "llama";
  EXPECT_EQ(parse_text_only_config(bare, "cfg").num_key_value_heads, 16) << "Llama's default: one KV head a head";
  nlohmann::json bad = kt::read_json(kLlama + "/config.json");
  bad["model_type"] = "gpt2";
  expect_input_error([&] { parse_text_only_config(bad, "cfg"); }, "model_type 'gpt2'");
  bad = kt::read_json(kLlama + "/config.json");
  bad["num_key_value_heads"] = 3;  // 4 heads
  expect_input_error([&] { parse_text_only_config(bad, "cfg"); }, "not a multiple of num_key_value_heads 3");
  bad = kt::read_json(kLlama + "/config.json");
  bad["hidden_size"] = "64";
  expect_input_error([&] { parse_text_only_config(bad, "cfg"); }, "cfg");
}

TEST(TextOnlyModel, CheckpointsItCannotReadAreRefused) {
  const std::string other = edited_copy(kLlama, "otherarch", [](nlohmann::json& c) { c["model_type"] = "gemma"; });
  expect_input_error([&] { load_model(other); }, "model_type 'gemma' is not one kvlens reads (llava, llava_next, internvl, qwen2_vl, qwen2_5_vl, llama, mistral, qwen2)");
  const std::string untied = edited_copy(kLlama, "untied", [](nlohmann::json& c) { c["tie_word_embeddings"] = false; });
  expect_input_error([&] { load_model(untied); }, "no 'lm_head.weight'");
}

// kvlens attends over every cached row, so a Mistral sequence ends at its sliding window: a
// prompt longer than the window is refused, and a caption stops where the window is full (up
// to there the window changes nothing, so the ids are HF's).
TEST(TextOnlyModel, MistralsSlidingWindowBoundsTheSequence) {
  const auto exp = kt::read_json(kMistral + "/expected.json");
  const int T = static_cast<int>(exp["prompt_ids"].size());
  const auto greedy = exp["greedy_ids"].get<std::vector<int>>();
  const std::string shorter = edited_copy(kMistral, "window", [&](nlohmann::json& c) { c["sliding_window"] = T - 5; });
  const std::unique_ptr<Model> m = load_model(shorter);
  expect_input_error([&] { m->prefill(RGBImage{}, exp["prompt"].get<std::string>(), "{prompt}", false); }, "sliding_window");
  const std::string just = edited_copy(kMistral, "window2", [&](nlohmann::json& c) { c["sliding_window"] = T + 3; });
  const std::unique_ptr<Model> m2 = load_model(just);
  const PrefillState st = m2->prefill(RGBImage{}, exp["prompt"].get<std::string>(), "{prompt}", false);
  GenerateOptions g;
  g.max_new_tokens = static_cast<int>(greedy.size());
  g.stop_at_eos = false;
  const DecodeResult r = m2->decode(st, nullptr, g);
  ASSERT_LT(r.generated_ids.size(), greedy.size());
  EXPECT_GE(r.generated_ids.size(), 3u);
  EXPECT_EQ(r.generated_ids, std::vector<int>(greedy.begin(), greedy.begin() + static_cast<std::ptrdiff_t>(r.generated_ids.size())));
}

// The span a template marks is what the methods treat as the visual segment: text before it
// (after BOS), the span and the text after it tokenized each on its own and tagged system,
// visual and post-vision. A span around the whole prompt tokenizes as the prompt alone does, so
// the full cache still gives HF's ids, and so does one whose ends fall at spaces. Markers used
// wrongly are refused.
TEST(TextOnlyModel, ATemplateSpanIsTheMethodsVisualSegment) {
  const auto exp = kt::read_json(kLlama + "/expected.json");
  const std::string prompt = exp["prompt"].get<std::string>();
  const auto want = exp["prompt_ids"].get<std::vector<int>>();
  const std::unique_ptr<Model> m = load_model(kLlama);
  const Tokenizer& tok = m->tokenizer();
  const PrefillState whole = m->prefill(RGBImage{}, prompt, "<span>{prompt}</span>", false);
  ASSERT_EQ(whole.ids, want);
  EXPECT_EQ(whole.n_visual, static_cast<int>(want.size()) - 1);
  EXPECT_EQ(whole.kinds.front(), SegmentKind::System);  // BOS
  for (size_t t = 1; t < whole.kinds.size(); ++t) EXPECT_EQ(whole.kinds[t], SegmentKind::Visual) << t;
  GenerateOptions g;
  const auto greedy = exp["greedy_ids"].get<std::vector<int>>();
  g.max_new_tokens = static_cast<int>(greedy.size());
  g.stop_at_eos = false;
  EXPECT_EQ(m->decode(whole, nullptr, g).generated_ids, greedy);

  // Spans that start and end at spaces move no token boundary: the ids of the text without the
  // markers, the span from the first word's "▁" on.
  const PrefillState st = m->prefill(RGBImage{}, "the light", "Read: <span>{prompt}</span> is", false);
  const std::vector<int> ids = tok.encode_prompt("Read: {prompt} is", "the light", 0);
  const std::vector<int> pre = tok.encode("Read:"), mid = tok.encode("the light");
  ASSERT_EQ(st.ids, ids);
  EXPECT_EQ(st.n_visual, static_cast<int>(mid.size()));
  EXPECT_TRUE(std::equal(mid.begin(), mid.end(), ids.begin() + 1 + static_cast<long>(pre.size())));
  for (size_t t = 0; t < ids.size(); ++t) {
    const SegmentKind k = t < 1 + pre.size() ? SegmentKind::System
                          : t < 1 + pre.size() + mid.size() ? SegmentKind::Visual
                                                            : SegmentKind::PostVisionText;
    EXPECT_EQ(st.kinds[t], k) << t;
  }
  for (const char* bad : {"<span>{prompt}", "{prompt}</span>", "</span>{prompt}<span>", "<span>{prompt}</span><span></span>",
                          "{prompt} <span></span>", "{pro<span>mpt}</span>"})
    expect_input_error([&] { m->prefill(RGBImage{}, "the light", bad, false); }, "span");
  expect_input_error([&] { m->prefill(RGBImage{}, "a <span>b</span>", "<span>{prompt}</span>", false); }, "contains <span>");
  expect_input_error([&] { m->prefill(RGBImage{}, "a <image> b", "<span>{prompt}</span>", false); }, "contains <image>");
}
