// COCO caption metrics against pycocoevalcap. The reference numbers and tokenizations under
// tests/fixtures/coco were produced by pycocoevalcap 1.2 and the Stanford tokenizer it runs
// (tests/coco_reference.py), never by kvlens.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/eval/caption_metrics.h"
#include "core/eval/coco.h"
#include "core/errors.h"
#include "core/json_file.h"
#include "core/eval/meteor.h"
#include "core/eval/ptb_tokenizer.h"
#include "tests/test_util.h"

namespace kvlens {
namespace {

using testing::source_dir;

const char* const kSets[] = {"punctuation", "scenes", "natural"};
constexpr double kTol = 1e-4;  // the issue's agreement bound, on every metric and set

std::string fixture(const std::string& rel) { return source_dir() + "/tests/fixtures/coco/" + rel; }

std::vector<std::string> meteor_pythons() { return {"python3", source_dir() + "/.deps/venv/bin/python3"}; }

TEST(PtbTokenizer, MatchesTheStanfordTokenizerOnEveryFixtureString) {
  const nlohmann::json cases = read_json_file(fixture("ptb_cases.json"), "tokenizer cases");
  size_t strings = 0;
  for (const auto& g : cases.at("groups")) {
    const std::vector<std::string> caps = g.at("captions").get<std::vector<std::string>>();
    strings += caps.size();
    std::string text;
    for (size_t i = 0; i < caps.size(); ++i) {
      if (i) text += '\n';
      for (char c : caps[i]) text += c == '\n' ? ' ' : c;
    }
    const std::string want = g.at("ptb_output").get<std::string>();
    const std::string got = ptb_tokenize(text);
    if (got != want) {  // show where, rather than two whole texts
      size_t b = 0;
      while (b < want.size() && b < got.size() && want[b] == got[b]) ++b;
      const size_t from = b > 60 ? b - 60 : 0;
      ADD_FAILURE() << "first difference at byte " << b << "\n  stanford: " << want.substr(from, 120)
                    << "\n  kvlens:   " << got.substr(from, 120);
    }
    const std::vector<std::string> coco = coco_tokenize(caps);
    ASSERT_EQ(coco.size(), caps.size());
    for (size_t i = 0; i < caps.size(); ++i)
      EXPECT_EQ(coco[i], g.at("coco_tokenized")[i].get<std::string>()) << "caption: " << nlohmann::json(caps[i]).dump();
  }
  EXPECT_GT(strings, 2000u);
}

TEST(PtbTokenizer, ClassicCases) {
  // Hand-written expectations from the Penn Treebank conventions the tokenizer follows.
  EXPECT_EQ(ptb_tokenize("It's a DOG's (red) ball."), "it 's a dog 's -lrb- red -rrb- ball .");
  EXPECT_EQ(ptb_tokenize("\"Don't\" cannot"), "`` do n't '' can not");
  EXPECT_EQ(ptb_tokenize("a\nb"), "a\nb");
  EXPECT_EQ(coco_tokenize({"A man's hat, (brown)!", ""}), (std::vector<std::string>{"a man 's hat -lrb- brown -rrb-", ""}));
}

TEST(PtbTokenizer, LineBreaksInsideCaptionsShiftLinesAsInPycocoevalcap) {
  // "a\rb" tokenizes to two lines, so the second caption receives "b" and the third "c".
  EXPECT_EQ(coco_tokenize({"a\rb", "c", "d"}), (std::vector<std::string>{"a", "b", "c"}));
  // A carriage return right before the joining newline makes one line break with it.
  EXPECT_EQ(coco_tokenize({"a\r", "b"}), (std::vector<std::string>{"a", "b"}));
}

TEST(CaptionMetrics, HandComputedValues) {
  // BLEU: candidate "a b c d" against "a b c d e": every precision 1, brevity penalty e^(1-5/4).
  TokenizedCorpus c{{{"a b c d e"}}, {"a b c d"}};
  const auto b = bleu_scores(c);
  for (double x : b) EXPECT_NEAR(x, std::exp(1.0 - 5.0 / 4.0), 1e-8);
  // ROUGE-L: LCS("a b", "a c b") = 2, P = 1, R = 2/3, F = (1+β²)PR / (R + β²P) with β = 1.2.
  const double f = (1 + 1.44) * (2.0 / 3.0) / (2.0 / 3.0 + 1.44);
  EXPECT_NEAR(rouge_l_score({{{"a c b"}}, {"a b"}}), f, 1e-12);
  // CIDEr-D: one image gives log(1) = 0 document weights, hence 0; two images whose candidates
  // equal their only reference (no shared n-gram) score cosine 1 for n = 1..4: 10.
  EXPECT_DOUBLE_EQ(cider_d_score({{{"a b c d"}}, {"a b c d"}}), 0.0);
  EXPECT_NEAR(cider_d_score({{{"a b c d"}, {"e f g h"}}, {"a b c d", "e f g h"}}), 10.0, 1e-12);
  // The Gaussian length penalty uses bigram counts: 4 vs 6 words, δ = 2, exp(−4/72).
  const double pen = std::exp(-4.0 / 72.0);
  const double got = cider_d_per_image({{{"a b c d"}, {"x y z w"}}, {"a b c d a b", "x y z w"}})[0];
  EXPECT_GT(got, 0.0);
  EXPECT_LT(got, 10.0 * pen + 1e-12);
}

TEST(CaptionMetrics, PythonSplitting) {
  EXPECT_EQ(split_whitespace(" a\u00a0b  c "), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(split_spaces(""), std::vector<std::string>{""});
  EXPECT_EQ(split_spaces("a  b"), (std::vector<std::string>{"a", "", "b"}));
}

TEST(CocoMetrics, MatchPycocoevalcapOnEveryFixtureSet) {
  for (const char* set : kSets) {
    SCOPED_TRACE(set);
    const nlohmann::json want = read_json_file(fixture(std::string(set) + "/expected.json"), "expected");
    const CocoAnnotations ann = load_coco_annotations(fixture(std::string(set) + "/annotations.json"));
    const std::vector<CocoResult> res = load_coco_results(fixture(std::string(set) + "/results.json"));
    const CaptionScores s = score_captions(ann, res, nullptr);
    EXPECT_EQ(s.images, want.at("images").get<size_t>());
    for (const std::string& m : caption_metric_names()) {
      if (m == "METEOR") continue;  // MeteorMatchesPycocoevalcap
      EXPECT_NEAR(metric_value(s, m), want.at(m).get<double>(), kTol) << m;
    }
    EXPECT_FALSE(s.meteor.has_value());
    EXPECT_FALSE(s.meteor_status.empty());
  }
}

TEST(CocoMetrics, PerImageValuesAndTokenizationMatch) {
  for (const char* set : kSets) {
    SCOPED_TRACE(set);
    const nlohmann::json want = read_json_file(fixture(std::string(set) + "/expected.json"), "expected");
    TokenizedCorpus c;
    for (const auto& refs : want.at("tokenized").at("references")) c.refs.push_back(refs.get<std::vector<std::string>>());
    c.cands = want.at("tokenized").at("candidates").get<std::vector<std::string>>();
    // The same tokenization from the raw results file.
    std::vector<std::string> cands_raw;
    for (const CocoResult& r : load_coco_results(fixture(std::string(set) + "/results.json")))
      cands_raw.push_back(r.caption);
    EXPECT_EQ(coco_tokenize(cands_raw), c.cands);
    const std::vector<double> rouge = rouge_l_per_image(c), cider = cider_d_per_image(c);
    const auto& per = want.at("per_image");
    for (size_t i = 0; i < c.cands.size(); ++i) {
      EXPECT_NEAR(rouge[i], per.at("ROUGE-L")[i].get<double>(), kTol) << "image #" << i;
      EXPECT_NEAR(cider[i], per.at("CIDEr-D")[i].get<double>(), kTol) << "image #" << i;
    }
  }
}

TEST(CocoMetrics, MeteorMatchesPycocoevalcap) {
  const MeteorSetup setup = find_meteor("", meteor_pythons());
  if (!setup.available()) GTEST_SKIP() << setup.status << " (./setup.sh --tests installs both)";
  MeteorScorer meteor(setup);  // one Java process for every set: it takes seconds to start
  for (const char* set : kSets) {
    SCOPED_TRACE(set);
    const nlohmann::json want = read_json_file(fixture(std::string(set) + "/expected.json"), "expected");
    const CaptionScores s =
        score_captions(load_coco_annotations(fixture(std::string(set) + "/annotations.json")),
                       load_coco_results(fixture(std::string(set) + "/results.json")), &meteor);
    ASSERT_TRUE(s.meteor.has_value());
    EXPECT_NEAR(*s.meteor, want.at("METEOR").get<double>(), kTol);
  }
}

TEST(CocoMetrics, BadResultsAreRefusedNamingTheImage) {
  const CocoAnnotations ann = load_coco_annotations(fixture("scenes/annotations.json"));
  auto message = [&](const std::vector<CocoResult>& r) {
    try {
      score_captions(ann, r, nullptr);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({{999, "x"}}).find("image_id 999 is not in"), std::string::npos);
  EXPECT_NE(message({{1, "x"}, {1, "y"}}).find("image_id 1 has more than one caption"), std::string::npos);
  EXPECT_NE(message({}).find("no caption"), std::string::npos);
}

}  // namespace
}  // namespace kvlens
