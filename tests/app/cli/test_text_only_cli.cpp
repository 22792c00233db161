// Text-only checkpoints (HF LlamaForCausalLM, MistralForCausalLM) through the CLI: `caption` and
// `run` take no image and the prompt alone as the template, give HF transformers' greedy ids
// (recorded by tests/make_hf_text_fixtures.py), and refuse an image or an <image> marker with
// exit code 2 and a message that names the model.
#include <gtest/gtest.h>

#include <dirent.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace kt = kvlens::testing;

namespace {

const std::string kLlama = kt::source_dir() + "/tests/fixtures/hf/llama_text_fp32_tied";
const std::string kMistral = kt::source_dir() + "/tests/fixtures/hf/mistral_gqa_bf16_shard";

// Files in dir whose names begin with `prefix`.
int files_in(const std::string& dir, const std::string& prefix = "") {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.' && std::string(e->d_name).rfind(prefix, 0) == 0;
    closedir(d);
  }
  return n;
}

}  // namespace

TEST(TextOnlyCli, CaptionGivesTransformersIdsWithoutAnImage) {
  for (const std::string& fix : {kLlama, kMistral}) {
    SCOPED_TRACE(fix);
    const auto exp = kt::read_json(fix + "/expected.json");
    ASSERT_TRUE(exp.value("text_only", false));
    const std::string tmp = kt::make_temp_dir("textcap");
    const auto greedy = exp["greedy_ids"].get<std::vector<int>>();
    const auto r = kt::run(kt::cli() + " caption --backend cpu --model " + fix + " --prompt '" +
                           exp["prompt"].get<std::string>() + "' --max-new-tokens " + std::to_string(greedy.size()) +
                           " --json " + tmp + "/c.json");
    ASSERT_EQ(r.code, 0) << r.output;
    const auto j = kt::read_json(tmp + "/c.json");
    EXPECT_EQ(j["prompt_ids"].get<std::vector<int>>(), exp["prompt_ids"].get<std::vector<int>>());
    EXPECT_EQ(j["n_visual_tokens"].get<int>(), 0);
    EXPECT_EQ(j["template"].get<std::string>(), "{prompt}");
    EXPECT_EQ(j["image"].get<std::string>(), "");
    // HF recorded its greedy ids without stopping at EOS; a caption stops there, so it is a prefix.
    const auto got = j["generated_ids"].get<std::vector<int>>();
    ASSERT_FALSE(got.empty());
    ASSERT_LE(got.size(), greedy.size());
    EXPECT_EQ(got, std::vector<int>(greedy.begin(), greedy.begin() + static_cast<std::ptrdiff_t>(got.size())));
  }
}

TEST(TextOnlyCli, AnImageOrAnImageMarkerIsRefused) {
  const std::string image = kt::source_dir() + "/assets/images/scene_000.png";
  for (const std::string& cmd : {" caption --backend cpu --model " + kLlama + " --image " + image,
                                 " run --backend cpu --model " + kLlama + " --image " + image + " --method snapkv",
                                 " caption --backend cpu --model " + kMistral + " --template 'USER: <image>\n{prompt}'"}) {
    const auto r = kt::run(kt::cli() + cmd);
    EXPECT_EQ(r.code, 2) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("takes no image"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("terminate"), std::string::npos) << r.output;
  }
}

// Every method family runs on a text-only prompt; the report names no visual token and its full
// cache caption is HF's; the figures are drawn without an image, and those of visual tokens
// (token fate over the patch grid, visual score histograms) are left out.
TEST(TextOnlyCli, RunComparesMethodsAndDrawsFigures) {
  const auto exp = kt::read_json(kMistral + "/expected.json");
  const auto greedy = exp["greedy_ids"].get<std::vector<int>>();
  const std::string tmp = kt::make_temp_dir("textrun");
  std::string cmd = kt::cli() + " run --backend cpu --model " + kMistral + " --prompt '" + exp["prompt"].get<std::string>() +
                    "' --max-new-tokens " + std::to_string(greedy.size()) + " --report " + tmp + "/r.json";
  const std::vector<std::string> methods = {"snapkv:budget=0.5", "kivi:residual=4,group=8", "zipcache", "lookm"};
  for (const auto& m : methods) cmd += " --method '" + m + "'";
  const auto r = kt::run(cmd + kt::figures_option(cmd, " --figures " + tmp + "/fig"));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = kt::read_json(tmp + "/r.json");
  const auto full = j["full"]["generated_ids"].get<std::vector<int>>();
  ASSERT_FALSE(full.empty());
  EXPECT_EQ(full, std::vector<int>(greedy.begin(), greedy.begin() + static_cast<std::ptrdiff_t>(full.size())));
  ASSERT_EQ(j["methods"].size(), methods.size());
  for (const auto& m : j["methods"]) EXPECT_FALSE(m["generated_ids"].empty()) << m.dump().substr(0, 200);
  EXPECT_EQ(j["n_visual_tokens"].get<int>(), 0);
  if (!kt::kHaveCairo) GTEST_SKIP() << "the figures are not checked: this kvlens was built without Cairo";
  EXPECT_GT(files_in(tmp + "/fig"), 10);
  EXPECT_EQ(files_in(tmp + "/fig", "attention_l0."), 4) << "the full cache's attention map, in four formats";
  EXPECT_EQ(files_in(tmp + "/fig", "token_fate"), 0);
  EXPECT_EQ(files_in(tmp + "/fig", "score_histogram"), 0);
}

// A span the template marks: `run` says which tokens it is, CalibQuant quantizes it (fewer bytes
// than the full cache), the report locates it and the figures name it.
TEST(TextOnlyCli, RunNamesTheTemplatesSpanAndQuantizesIt) {
  const std::string tmp = kt::make_temp_dir("textspan");
  const std::string cmd = kt::cli() + " run --backend cpu --model " + kMistral +
                          " --prompt 'the light is warm' --template 'Read this: <span>{prompt}</span> Now' --max-new-tokens 4"
                          " --method calibquant:bits=1 --report " + tmp + "/r.json";
  const auto r = kt::run(cmd + kt::figures_option(cmd, " --figures " + tmp + "/fig"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("the methods' visual segment: prompt tokens"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"the light is warm\""), std::string::npos) << r.output;
  const auto j = kt::read_json(tmp + "/r.json");
  const auto& span = j["prompt_span"];
  EXPECT_EQ(span["text"].get<std::string>(), "the light is warm");
  EXPECT_EQ(span["n"].get<int>(), j["n_visual_tokens"].get<int>());
  EXPECT_GT(span["n"].get<int>(), 0);
  const auto kinds = j["token_kinds"];
  EXPECT_EQ(kinds[span["first"].get<int>()].get<std::string>(), "visual");
  EXPECT_NE(kinds[span["first"].get<int>() - 1].get<std::string>(), "visual");
  EXPECT_LT(j["methods"][0]["bytes_after_prefill"]["total"].get<double>(), j["full"]["bytes"]["total"].get<double>());
  if (!kt::kHaveCairo) GTEST_SKIP() << "the figures are not checked: this kvlens was built without Cairo";
  EXPECT_EQ(files_in(tmp + "/fig", "score_histogram"), 8) << "two layers, four formats";
  const std::string svg = kt::read_file(tmp + "/fig/attention_l0.svg");
  EXPECT_NE(svg.find("prompt span begins"), std::string::npos);
}

// `bench` times a text-only model too: no vision, the prompt alone.
TEST(TextOnlyCli, BenchRunsWithoutAnImage) {
  const std::string tmp = kt::make_temp_dir("textbench");
  const auto r = kt::run(kt::cli() + " bench --backend cpu --model " + kLlama + " --repeat 1 --json " + tmp + "/b.json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = kt::read_json(tmp + "/b.json");
  EXPECT_EQ(j["vision_ms"].get<double>(), 0.0);
  EXPECT_GT(j["prefill_ms"].get<double>(), 0.0);
  EXPECT_GT(j["decode_tokens_per_s"].get<double>(), 0.0);
}

// Without --template a caption takes the checkpoint's chat template for one user turn and gives
// HF's apply_chat_template ids: Llama-3's BOS written by the template and not added twice,
// Qwen2's ChatML with no BOS at all. --template still overrides it.
TEST(TextOnlyCli, TheCheckpointsChatTemplateGivesTransformersIds) {
  for (const char* name : {"llama3_bpe_rope_scaled", "qwen2_bpe_chatml"}) {
    SCOPED_TRACE(name);
    const std::string fix = kt::source_dir() + "/tests/fixtures/hf/" + name;
    const auto exp = kt::read_json(fix + "/expected.json");
    const std::string tmp = kt::make_temp_dir("chatcap");
    auto r = kt::run(kt::cli() + " caption --backend cpu --model " + fix + " --prompt '" + exp["prompt"].get<std::string>() +
                     "' --max-new-tokens 2 --json " + tmp + "/c.json");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(kt::read_json(tmp + "/c.json")["prompt_ids"].get<std::vector<int>>(),
              exp["chat_prompt_ids"].get<std::vector<int>>());
    r = kt::run(kt::cli() + " caption --backend cpu --model " + fix + " --template '{prompt}' --prompt '" +
                exp["prompt"].get<std::string>() + "' --max-new-tokens 2 --json " + tmp + "/p.json");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(kt::read_json(tmp + "/p.json")["prompt_ids"].get<std::vector<int>>(), exp["prompt_ids"].get<std::vector<int>>());
  }
}
