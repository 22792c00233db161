// kvlens score on the COCO fixture sets: the JSON it writes against pycocoevalcap's numbers,
// and one-line errors for bad inputs.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace kt = kvlens::testing;

namespace {

std::string fixture(const std::string& rel) { return kt::source_dir() + "/tests/fixtures/coco/" + rel; }

TEST(ScoreCli, WritesPycocoevalcapNumbers) {
  const std::string dir = kt::make_temp_dir("score");
  for (const char* set : {"punctuation", "scenes", "natural"}) {
    SCOPED_TRACE(set);
    const std::string out = dir + "/" + set + ".json";
    const kt::RunResult r = kt::run(kt::cli() + " score --no-meteor --annotations " + fixture(std::string(set) + "/annotations.json") +
                                    " --results " + fixture(std::string(set) + "/results.json") + " --json " + out);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("METEOR   unavailable"), std::string::npos) << r.output;
    const nlohmann::json got = nlohmann::json::parse(kt::read_file(out));
    const nlohmann::json want = nlohmann::json::parse(kt::read_file(fixture(std::string(set) + "/expected.json")));
    for (const char* m : {"BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "ROUGE-L", "CIDEr-D"})
      EXPECT_NEAR(got.at(m).get<double>(), want.at(m).get<double>(), 1e-4) << m;
    EXPECT_TRUE(got.at("METEOR").is_null());
    EXPECT_EQ(got.at("images").get<int>(), want.at("images").get<int>());
  }
}

TEST(ScoreCli, BadInputIsOneLineAndExitCode2) {
  const std::string dir = kt::make_temp_dir("score_bad");
  kt::write_file(dir + "/res.json", R"([{"image_id": 424242, "caption": "a dog"}])");
  kt::write_file(dir + "/notlist.json", R"({"image_id": 1})");
  const std::string ann = fixture("scenes/annotations.json");
  kt::RunResult r = kt::run(kt::cli() + " score --no-meteor --annotations " + ann + " --results " + dir + "/res.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("image_id 424242 is not in"), std::string::npos) << r.output;
  r = kt::run(kt::cli() + " score --no-meteor --annotations " + ann + " --results " + dir + "/notlist.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("notlist.json: expected a list"), std::string::npos) << r.output;
  r = kt::run(kt::cli() + " score --no-meteor --annotations " + dir + "/missing.json --results " + dir + "/res.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("missing.json"), std::string::npos) << r.output;
}

}  // namespace
