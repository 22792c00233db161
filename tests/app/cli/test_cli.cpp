// The CLI on good and bad input: every bad input gives one clear line naming the file, tensor
// or value, exit code 2, and no crash.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace kt = kvlens::testing;

namespace {

const std::string kFix = kt::source_dir() + "/tests/fixtures/hf/";

std::string copy_fixture(const std::string& name) {
  const std::string d = kt::make_temp_dir("cli") + "/" + name;
  EXPECT_EQ(kt::run("cp -r " + kFix + name + " " + d).code, 0);
  return d;
}

// A copy of a fixture whose config.json was changed by `edit`.
template <typename F>
std::string fixture_with_config(const std::string& name, F edit) {
  const std::string d = copy_fixture(name);
  std::ifstream f(d + "/config.json");
  auto j = nlohmann::json::parse(f);
  edit(j);
  kt::write_file(d + "/config.json", j.dump());
  return d;
}

void expect_exit2(const std::string& args, const std::string& must_contain) {
  const auto r = kt::run(kt::cli() + " " + args);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
  EXPECT_NE(r.output.find(must_contain), std::string::npos) << args << "\n" << r.output;
  EXPECT_EQ(r.output.find("internal error"), std::string::npos) << r.output;
}

}  // namespace

TEST(Cli, CaptionWritesJsonAndLogits) {
  const std::string dir = kFix + "mha_fp32_hub";
  const std::string tmp = kt::make_temp_dir("cap");
  const auto r = kt::run(kt::cli() + " caption --model " + dir + " --image " + dir +
                         "/image.png --max-new-tokens 4 --json " + tmp + "/out.json --dump-logits " + tmp + "/l.f32");
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream f(tmp + "/out.json");
  const auto j = nlohmann::json::parse(f);
  std::ifstream e(dir + "/expected.json");
  const auto exp = nlohmann::json::parse(e);
  EXPECT_EQ(j["prompt_ids"], exp["prompt_ids"]);
  const auto greedy = exp["greedy_ids"].get<std::vector<int>>();
  const auto got = j["generated_ids"].get<std::vector<int>>();
  ASSERT_FALSE(got.empty());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), greedy.begin())) << j["generated_ids"].dump();
  EXPECT_EQ(j["n_visual_tokens"], exp["n_visual_tokens"]);
  for (const char* k : {"vision", "prefill", "decode"}) EXPECT_GE(j["timings_ms"][k].get<double>(), 0.0);
  EXPECT_TRUE(j.contains("caption"));
  const auto logits = kt::read_f32(tmp + "/l.f32");
  const auto ref = kt::read_f32(dir + "/logits.f32");
  ASSERT_EQ(logits.size(), ref.size());
}

// --model takes an embedded model's bare name; a name that is neither a path nor an embedded
// model is refused naming it.
TEST(Cli, ModelByEmbeddedName) {
  const std::string tmp = kt::make_temp_dir("named");
  const std::string img = kt::source_dir() + "/assets/images/scene_000.png";
  for (const auto& [name, visual] : {std::pair<std::string, int>{"kvlens-scenes-6m", 196}, {"kvlens-scenes-14m", 576}}) {
    const auto r = kt::run("cd " + tmp + " && " + kt::cli() + " caption --backend cpu --model " + name + " --image " + img +
                           " --max-new-tokens 1 --json " + tmp + "/" + name + ".json");
    ASSERT_EQ(r.code, 0) << name << ": " << r.output;
    EXPECT_EQ(kt::read_json(tmp + "/" + name + ".json")["n_visual_tokens"], visual) << name;
  }
  const auto bad = kt::run("cd " + tmp + " && " + kt::cli() + " caption --model kvlens-scenes-99m --max-new-tokens 1");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("kvlens-scenes-99m"), std::string::npos) << bad.output;
}

// Without --model and --image: the 12-layer model on its sample image, a held-out rich scene,
// whose canonical caption (from the scene generator) it gives in full; KVLENS_MODEL names another
// default, with that model's own sample image; one set wrong is refused naming it.
TEST(Cli, DefaultModelIsTheDeepOneUnlessKvlensModelSaysOtherwise) {
  const std::string tmp = kt::make_temp_dir("default_model");
  const auto set = kt::run(kt::cli() + " scenes --n 1 --seed 1000001 --generator-version 2 --out " + tmp + "/set");
  ASSERT_EQ(set.code, 0) << set.output;
  const std::string canonical =
      kt::read_json(tmp + "/set/annotations.json")["annotations"][0]["caption"].get<std::string>();  // (the canonical one first)
  const auto r = kt::run("env -u KVLENS_MODEL " + kt::cli() + " caption --backend cpu --json " + tmp + "/d.json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto d = kt::read_json(tmp + "/d.json");
  EXPECT_EQ(d["model"], kt::source_dir() + "/assets/models/kvlens-scenes-14m");
  EXPECT_EQ(d["image"], kt::source_dir() + "/assets/images/rich_000.png");
  EXPECT_EQ(d["caption"], canonical) << "the default's caption ends (EOS) within the default --max-new-tokens";
  EXPECT_EQ(kt::read_file(kt::source_dir() + "/assets/images/rich_000.png"), kt::read_file(tmp + "/set/images/000000.png"))
      << "the sample image is held-out scene 0";

  const auto s = kt::run("env KVLENS_MODEL=kvlens-scenes-6m " + kt::cli() + " caption --backend cpu --max-new-tokens 4 --json " +
                         tmp + "/s.json");
  ASSERT_EQ(s.code, 0) << s.output;
  const auto small = kt::read_json(tmp + "/s.json");
  EXPECT_EQ(small["model"], kt::source_dir() + "/assets/models/kvlens-scenes-6m");
  EXPECT_EQ(small["image"], kt::source_dir() + "/assets/images/scene_000.png");
  EXPECT_EQ(small["n_visual_tokens"], 196);

  const auto bad = kt::run("env KVLENS_MODEL=" + tmp + "/nothere " + kt::cli() + " caption --max-new-tokens 1");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("KVLENS_MODEL='" + tmp + "/nothere' names no model folder"), std::string::npos) << bad.output;
  const auto given = kt::run("env KVLENS_MODEL=" + tmp + "/nothere " + kt::cli() +
                             " caption --model kvlens-scenes-6m --max-new-tokens 1");
  EXPECT_EQ(given.code, 0) << "--model given: KVLENS_MODEL is not read. " << given.output;
}

TEST(Cli, HelpDocumentsCaption) {
  const auto r = kt::run(kt::cli() + " caption --help");
  EXPECT_EQ(r.code, 0);
  for (const char* opt : {"--model", "--image", "--prompt", "--max-new-tokens", "--json", "--dump-logits", "--kv-storage"})
    EXPECT_NE(r.output.find(opt), std::string::npos) << opt;
}

TEST(Cli, KvStorageChoosesTheRowStorage) {
  const std::string dir = kFix + "mha_fp32_hub";
  const std::string tmp = kt::make_temp_dir("kvs");
  int64_t bytes[2] = {0, 0};
  int i = 0;
  for (const char* s : {"fp16", "fp32"}) {
    const auto r = kt::run(kt::cli() + " caption --backend cpu --model " + dir + " --image " + dir + "/image.png --max-new-tokens 3" +
                           " --kv-storage " + s + " --json " + tmp + "/" + s + ".json");
    ASSERT_EQ(r.code, 0) << r.output;
    std::ifstream f(tmp + "/" + s + ".json");
    const auto j = nlohmann::json::parse(f);
    EXPECT_EQ(j["kv_storage"], s);
    bytes[i++] = j["kv_bytes"].get<int64_t>();
  }
  EXPECT_GT(bytes[1], bytes[0]);  // 4 B a value against 2
  const std::string img = " --image " + dir + "/image.png";
  for (const std::string& cmd : std::vector<std::string>{"caption" + img, "run --method full" + img, "eval --scenes /nonexistent"})
    expect_exit2(cmd + " --model " + dir + " --kv-storage bf16", "--kv-storage must be fp16 or fp32, got 'bf16'");
}

TEST(Cli, BadFiles) {
  const std::string good = kFix + "mha_fp32_hub";
  const std::string img = good + "/image.png";
  const std::string tmp = kt::make_temp_dir("bad");
  expect_exit2("caption --model /nonexistent/model --image " + img, "/nonexistent/model");
  expect_exit2("caption --model " + good + " --image /nonexistent/x.png", "/nonexistent/x.png");
  kt::write_file(tmp + "/empty.png", "");
  expect_exit2("caption --model " + good + " --image " + tmp + "/empty.png", "empty.png");
  kt::write_file(tmp + "/notes.png", "this is text, not an image\n");
  expect_exit2("caption --model " + good + " --image " + tmp + "/notes.png", "notes.png");
  expect_exit2("caption --model " + good + " --image " + img + " --max-new-tokens 0", "--max-new-tokens");
  expect_exit2("caption --bogus", "bogus");
  expect_exit2("caption --model " + good + " --image " + img + " --prompt 'x <image> y'", "<image>");
  expect_exit2("caption --model " + good + " --image " + img + " --template 'A <image> B <image> {prompt}'",
               "image tokens");
}

TEST(Cli, HugeImageRefused) {
  // A PNG header claiming 20000×20000: refused before any pixel is decoded.
  const std::string tmp = kt::make_temp_dir("huge");
  std::string png("\x89PNG\r\n\x1a\n", 8);
  const unsigned char ihdr[] = {0, 0, 0, 13, 'I', 'H', 'D', 'R', 0, 0, 0x4e, 0x20, 0, 0, 0x4e, 0x20, 8, 2, 0, 0, 0,
                                0, 0, 0, 0};
  png.append(reinterpret_cast<const char*>(ihdr), sizeof ihdr);
  kt::write_file(tmp + "/huge.png", png);
  expect_exit2("caption --model " + kFix + "mha_fp32_hub --image " + tmp + "/huge.png", "huge.png");
}

// A run that cannot fit the memory it may use is refused before it starts, with what it needs,
// what it may use and what would make it fit (here forced by a 1 MB limit on the CPU).
TEST(Cli, RunThatCannotFitIsRefusedWithBothNumbers) {
  expect_exit2("run --backend cpu --memory-limit-mb 1 --method kivi", "1 MB allowed (--memory-limit-mb)");
  expect_exit2("run --backend cpu --memory-limit-mb 1 --method kivi", "capture of the prompt's attention");
  expect_exit2("run --backend cpu --memory-limit-mb 1 --method kivi", "a shorter prompt or a larger --memory-limit-mb");
  expect_exit2("run --backend cpu --memory-limit-mb x --method kivi", "--memory-limit-mb");
}

TEST(Cli, PromptLongerThanContext) {
  std::string prompt;
  for (int i = 0; i < 300; ++i) prompt += "word ";
  expect_exit2("caption --model " + kFix + "mha_fp32_hub --image " + kFix + "mha_fp32_hub/image.png --prompt '" +
                   prompt + "'",
               "max_position_embeddings");
}

TEST(Cli, BrokenCheckpoints) {
  const std::string img = kFix + "mha_fp32_hub/image.png";
  {  // unknown model_type
    const std::string d = fixture_with_config("mha_fp32_hub", [](nlohmann::json& j) { j["model_type"] = "blip"; });
    expect_exit2("caption --model " + d + " --image " + img, "model_type 'blip'");
  }
  {  // truncated weights
    const std::string d = copy_fixture("mha_fp32_hub");
    EXPECT_EQ(kt::run("truncate -s 300000 " + d + "/model.safetensors").code, 0);
    expect_exit2("caption --model " + d + " --image " + img, "model.safetensors");
  }
  {  // a tensor whose shape disagrees with the config
    const std::string d = fixture_with_config("mha_fp32_hub", [](nlohmann::json& j) { j["text_config"]["intermediate_size"] = 100; });
    expect_exit2("caption --model " + d + " --image " + img, "mlp.gate_proj.weight' has shape");
  }
  {  // missing shard
    const std::string d = copy_fixture("bf16_sharded_inmem");
    EXPECT_EQ(kt::run("rm " + d + "/model-00002-of-00004.safetensors").code, 0);
    expect_exit2("caption --model " + d + " --image " + img, "model-00002-of-00004.safetensors");
  }
  {  // a config value of the wrong JSON type
    const std::string d = fixture_with_config("mha_fp32_hub", [](nlohmann::json& j) { j["text_config"]["eos_token_id"] = "x"; });
    expect_exit2("caption --model " + d + " --image " + img, "config.json");
  }
  {  // missing tokenizer
    const std::string d = copy_fixture("mha_fp32_hub");
    EXPECT_EQ(kt::run("rm " + d + "/tokenizer.model").code, 0);
    expect_exit2("caption --model " + d + " --image " + img, "tokenizer.model");
  }
}

// `kvlens bench session`: a row per edit with both times and a median; a bad edit or session is
// refused with exit 2 and a message that names it.
TEST(Cli, BenchSessionTimesEachEdit) {
  const std::string sess = kt::source_dir() + "/sessions/calibquant_paper.json";
  const auto r = kt::run(kt::cli() + " bench session --backend cpu --session " + sess +
                         " --edit 1:tau1=0.5 --edit 'calibquant:bits=2:tau2=2'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("caption ms"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("hand-over"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tau1 = 0.5"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("calibquant:bits=2: tau2 = 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("median"), std::string::npos) << r.output;
  const auto bad = kt::run(kt::cli() + " bench session --backend cpu --session " + sess + " --edit 1:tau1=99");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--edit '1:tau1=99'"), std::string::npos) << bad.output;
  const auto missing = kt::run(kt::cli() + " bench session --session /nonexistent/s.json");
  EXPECT_EQ(missing.code, 2) << missing.output;
  EXPECT_NE(missing.output.find("/nonexistent/s.json"), std::string::npos) << missing.output;
}
