// An image's reference captions found beside it (a scene set from `kvlens scenes`), each
// caption's CIDEr-D against them with the dataset's document frequencies, and the report's and
// the comparison table's CIDEr-D.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "app/figures/figures_report.h"
#include "app/lab/references.h"
#include "core/eval/eval_dataset.h"
#include "core/eval/ptb_tokenizer.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;

namespace {

// A scene set of `n` images in a temporary folder.
std::string scene_set(const std::string& tag, int n) {
  const std::string dir = kt::make_temp_dir(tag) + "/set";
  const kt::RunResult r = kt::run(kt::cli() + " scenes --n " + std::to_string(n) + " --out " + dir);
  EXPECT_EQ(r.code, 0) << r.output;
  return dir;
}

}  // namespace

// The references of an image of the set, and CIDEr-D as cider_d_per_image (the metric pinned to
// pycocoevalcap) gives that image over the whole set's references.
TEST(ImageReferences, FoundBesideTheImageAndScoredWithTheSetsFrequencies) {
  const std::string dir = scene_set("refs", 6);
  const EvalDataset ds = load_eval_dataset(dir);
  ASSERT_EQ(ds.images.size(), 6u);
  const size_t pick = ds.images[2];
  const auto refs = find_image_references(ds.image_path(pick));
  ASSERT_NE(refs, nullptr);
  EXPECT_EQ(refs->annotations, ds.ann.path);
  const std::vector<std::string>& caps = ds.ann.captions.at(ds.ann.images[pick].id);
  EXPECT_EQ(refs->refs, coco_tokenize(caps));
  TokenizedCorpus c;
  for (size_t p : ds.images) {
    c.refs.push_back(coco_tokenize(ds.ann.captions.at(ds.ann.images[p].id)));
    c.cands.push_back("a small red square");
  }
  for (const std::string& cand : {caps.front(), std::string("three shapes: a small blue ring"), std::string("nothing")}) {
    c.cands[2] = coco_tokenize({cand}).at(0);
    const double want = cider_d_per_image(c)[2];
    EXPECT_NEAR(refs->cider_d(cand), want, 1e-12 * std::max(1.0, want)) << cand;
  }
  EXPECT_GT(refs->cider_d(caps.front()), refs->cider_d("nothing"));
  // Another image of the set has other references; an image no dataset lists, a folder whose
  // annotations cannot be read and a path that is not a file have none (never an error).
  EXPECT_NE(find_image_references(ds.image_path(ds.images[3]))->refs, refs->refs);
  EXPECT_EQ(find_image_references(kt::source_dir() + "/assets/images/scene_000.png"), nullptr);
  const std::string bad = kt::make_temp_dir("refs_bad");
  kt::write_file(bad + "/annotations.json", "{not json");
  kt::write_file(bad + "/x.png", kt::read_file(kt::source_dir() + "/assets/images/scene_000.png"));
  EXPECT_EQ(find_image_references(bad + "/x.png"), nullptr);
  EXPECT_EQ(find_image_references(dir), nullptr);
  // The set's references are read once and kept while its annotations stay as they were: a
  // changed file is read again.
  nlohmann::json ann = nlohmann::json::parse(kt::read_file(ds.ann.path));
  for (auto& a : ann["annotations"])
    if (a["image_id"] == ds.ann.images[pick].id) a["caption"] = "a grey background with nothing on it at all";
  kt::write_file(ds.ann.path, ann.dump());
  const auto changed = find_image_references(ds.image_path(pick));
  ASSERT_NE(changed, nullptr);
  EXPECT_EQ(changed->refs, std::vector<std::string>(5, "a grey background with nothing on it at all"));
}

// `kvlens run` on an image of a scene set prints and reports each caption's CIDEr-D against the
// image's references (the full cache's too); the comparison table gains the CIDEr-D column with those values, and a
// report without references has no such column (sorting by it leaves the order).
TEST(ImageReferences, RunReportsCiderAndTheComparisonTableShowsIt) {
  const std::string dir = scene_set("refs_run", 3);
  const EvalDataset ds = load_eval_dataset(dir);
  const std::string image = ds.image_path(ds.images[1]), out = kt::make_temp_dir("refs_run_out") + "/r.json";
  const kt::RunResult r =
      kt::run(kt::cli() + " run --image " + image + " --method snapkv:budget=0.1 --method calibquant --report " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("CIDEr-D against the 5 reference captions of this image"), std::string::npos) << r.output;
  const nlohmann::json rep = nlohmann::json::parse(kt::read_file(out));
  ASSERT_TRUE(rep.contains("references")) << rep.dump().substr(0, 400);
  EXPECT_EQ(rep["references"]["captions"], 5);
  const auto refs = find_image_references(image);
  ASSERT_NE(refs, nullptr);
  EXPECT_DOUBLE_EQ(rep["full"]["cider_d"].get<double>(), refs->cider_d(rep["full"]["caption"].get<std::string>()));
  fig::ComparisonTable t = fig::comparison_table(rep);
  ASSERT_EQ(t.columns.back().key, "cider_d");
  ASSERT_EQ(t.rows.size(), 2u);
  for (const auto& row : t.rows) {
    const nlohmann::json& m = rep["methods"][static_cast<size_t>(row.method)];
    EXPECT_DOUBLE_EQ(row.values.back(), m["cider_d"].get<double>());
    EXPECT_DOUBLE_EQ(m["cider_d"].get<double>(), refs->cider_d(m["caption"].get<std::string>()));
  }
  fig::sort_comparison(t, "cider_d", true);
  EXPECT_GE(t.rows[0].values.back(), t.rows[1].values.back());
  // Without references: no column, and a sort by it keeps the rows as they are.
  nlohmann::json plain = rep;
  plain.erase("references");
  fig::ComparisonTable u = fig::comparison_table(plain);
  EXPECT_NE(u.columns.back().key, "cider_d");
  EXPECT_NO_THROW(fig::sort_comparison(u, "cider_d", true));
  EXPECT_EQ(u.rows[0].method, 0);
  EXPECT_THROW(fig::sort_comparison(u, "no_such_column", true), InputError);
}
