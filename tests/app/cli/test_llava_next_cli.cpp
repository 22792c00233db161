// The CLI on a LLaVA-NeXT checkpoint: `caption` gives HF's greedy ids for the fixture's anyres
// image, `run` says how many visual tokens the image makes and the report and figures lay them
// out on the tiles' grid; a bad config exits 2 naming the field.
#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace kt = kvlens::testing;

namespace {

const std::string kNext = kt::source_dir() + "/tests/fixtures/hf/next_mistral_bf16_hub";

}  // namespace

TEST(LlavaNextCli, CaptionGivesTransformersIds) {
  const auto exp = kt::read_json(kNext + "/expected.json");
  const std::string tmp = kt::make_temp_dir("nextcap");
  const auto greedy = exp["greedy_ids"].get<std::vector<int>>();
  // (the template's newline stands as it is inside the shell's single quotes)
  const auto r = kt::run(kt::cli() + " caption --backend cpu --model " + kNext + " --image " + kNext +
                         "/image.png --template '" + exp["template"].get<std::string>() + "' --max-new-tokens " +
                         std::to_string(greedy.size()) + " --json " + tmp + "/c.json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = kt::read_json(tmp + "/c.json");
  EXPECT_EQ(j["prompt_ids"].get<std::vector<int>>(), exp["prompt_ids"].get<std::vector<int>>());
  EXPECT_EQ(j["n_visual_tokens"].get<int>(), exp["n_visual_tokens"].get<int>());
  const auto got = j["generated_ids"].get<std::vector<int>>();
  ASSERT_FALSE(got.empty());
  ASSERT_LE(got.size(), greedy.size());
  EXPECT_EQ(got, std::vector<int>(greedy.begin(), greedy.begin() + static_cast<std::ptrdiff_t>(got.size())));
}

TEST(LlavaNextCli, RunLaysTheVisualTokensOutOnTheTiles) {
  const std::string tmp = kt::make_temp_dir("nextrun");
  const std::string cmd = kt::cli() + " run --backend cpu --model " + kNext + " --image " + kNext +
                          "/image.png --method snapkv --method lookm --max-new-tokens 4 --report " + tmp + "/r.json";
  const auto r = kt::run(cmd + kt::figures_option(cmd, " --figures " + tmp + "/fig --figure-formats svg"));
  ASSERT_EQ(r.code, 0) << r.output;
  // 19×50 on 24-px tiles of 6×6 patches: 3×1 tiles, an 18×6 joined grid, one row cut at the top
  // and the bottom by unpadding: 36 + 16 × 7.
  EXPECT_NE(r.output.find("visual tokens of this 19x50 image: 148 = base 6×6 + tiles 16×6 (3×1 tiles) + 16 newlines"),
            std::string::npos)
      << r.output;
  const auto j = kt::read_json(tmp + "/r.json");
  EXPECT_EQ(j["n_visual_tokens"].get<int>(), 148);
  EXPECT_EQ(j["patch_grid"], (nlohmann::json{{"rows", 16}, {"cols", 6}, {"first", 36}, {"row_stride", 7}}));
  ASSERT_EQ(j["visual_layout"]["grids"].size(), 2u);
  if (!kt::kHaveCairo) GTEST_SKIP() << "the token-fate figure is not checked: this kvlens was built without Cairo";
  // The token-fate figure's cells (x = column, y = row in its long CSV): 16 rows of 6 patches,
  // the newline tokens left out.
  std::istringstream csv(kt::read_file(tmp + "/fig/token_fate_kept_m0_snapkv_l0.csv"));
  std::string line;
  std::getline(csv, line);
  ASSERT_EQ(line.rfind("figure,series,kind,x,x_hi,y,", 0), 0u) << line;
  int cells = 0, max_x = -1, max_y = -1;
  while (std::getline(csv, line)) {
    std::vector<std::string> f;
    std::stringstream ls(line);
    for (std::string x; std::getline(ls, x, ',');) f.push_back(x);
    ASSERT_GE(f.size(), 6u) << line;
    ++cells;
    max_x = std::max(max_x, std::stoi(f[3]));
    max_y = std::max(max_y, std::stoi(f[5]));
  }
  EXPECT_EQ(cells, 16 * 6);
  EXPECT_EQ(max_x, 5);
  EXPECT_EQ(max_y, 15);
}

TEST(LlavaNextCli, AnInconsistentConfigExitsTwoNamingTheField) {
  const std::string dir = kt::make_temp_dir("nextbad") + "/model";
  ASSERT_EQ(kt::run("cp -r " + kNext + " " + dir).code, 0);
  nlohmann::json cfg = kt::read_json(dir + "/config.json");
  cfg["image_grid_pinpoints"] = {{24, 40}};
  kt::write_file(dir + "/config.json", cfg.dump());
  const auto r = kt::run(kt::cli() + " caption --backend cpu --model " + dir + " --image " + kNext + "/image.png");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("image_grid_pinpoints[0] = [24, 40] is not a whole number of 24-pixel tiles"), std::string::npos)
      << r.output;
}

// Without --template a caption takes the checkpoint's chat template (chat_template.json, as
// llava-hf ships it) for one user turn; for this fixture that is the template its ids were
// recorded with, so the ids are the same.
TEST(LlavaNextCli, TheCheckpointsChatTemplateIsTheDefault) {
  const auto exp = kt::read_json(kNext + "/expected.json");
  ASSERT_TRUE(exp["chat_template_is_template"].get<bool>());
  const std::string tmp = kt::make_temp_dir("nextchat");
  auto r = kt::run(kt::cli() + " caption --backend cpu --model " + kNext + " --image " + kNext +
                   "/image.png --max-new-tokens 2 --json " + tmp + "/c.json");
  ASSERT_EQ(r.code, 0) << r.output;
  auto j = kt::read_json(tmp + "/c.json");
  EXPECT_EQ(j["template"].get<std::string>(), exp["template"].get<std::string>());
  EXPECT_EQ(j["prompt_ids"].get<std::vector<int>>(), exp["prompt_ids"].get<std::vector<int>>());

}
