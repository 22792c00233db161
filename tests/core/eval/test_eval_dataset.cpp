// Datasets, variants, shards and per-image records of kvlens eval (no model needed).
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "core/errors.h"
#include "core/eval/eval_dataset.h"
#include "tests/test_util.h"

namespace kt = kvlens::testing;
namespace fs = std::filesystem;

namespace kvlens {
namespace {

TEST(EvalVariants, BitsAndBudgetsExpandWhereTheMethodHasThem) {
  std::vector<std::string> skipped;
  const std::vector<EvalVariant> v = expand_variants(
      {"calibquant", "kivi", "vlcache", "zipcache", "calibquant:bits=1"}, {8, 1}, &skipped, {0.05, 0.4});
  std::vector<std::string> labels;
  for (const EvalVariant& x : v) labels.push_back(x.label + "/" + std::to_string(x.bits));
  // calibquant:bits=1 repeats the 1-bit variant and is dropped; zipcache has neither parameter.
  EXPECT_EQ(labels, (std::vector<std::string>{"full/0", "calibquant/8", "calibquant/1", "vlcache:budget=0.05/0",
                                              "vlcache:budget=0.4/0", "zipcache/0"}));
  ASSERT_EQ(skipped.size(), 2u);  // KIVI is 2- or 4-bit only
  EXPECT_EQ(skipped[0].rfind("kivi: bits=8 not accepted", 0), 0u) << skipped[0];
  EXPECT_EQ(v[1].key, parse_method_spec("calibquant:bits=8").spec());
  EXPECT_FALSE(v[0].params.has_value());
  EXPECT_THROW(parse_bits_list("8,,1"), InputError);
  EXPECT_THROW(parse_budget_list("0.1,2"), InputError);
}

TEST(EvalShards, EveryImageInExactlyOneShard) {
  for (int n : {1, 2, 3, 7}) {
    std::multiset<size_t> seen;
    for (int i = 0; i < n; ++i)
      for (size_t p : shard_positions(10, 9, parse_shard(std::to_string(i) + "/" + std::to_string(n)))) seen.insert(p);
    EXPECT_EQ(seen.size(), 9u) << n;
    EXPECT_EQ(std::set<size_t>(seen.begin(), seen.end()).size(), 9u) << n;
    EXPECT_EQ(*seen.rbegin(), 8u);
  }
  EXPECT_EQ(shard_positions(5, 0, parse_shard("1/2")), (std::vector<size_t>{1, 3}));
  EXPECT_THROW(parse_shard("3/3"), InputError);
  EXPECT_THROW(parse_shard("1"), InputError);
}

TEST(EvalRecords, JsonRoundTrip) {
  ImageRecord r;
  r.image_id = 42;
  r.fingerprint = "f";
  r.source = "s";
  r.fp16_bytes = 1234;
  r.variants["full"] = {"a red circle.", 2468, std::nullopt, {"one", "yes"}, 12.5};
  r.variants["calibquant:bits=1"] = {"a red square.", 300, 0.25, {"two", "no"}, 3};
  const ImageRecord b = ImageRecord::from_json(nlohmann::json::parse(r.to_json().dump()), "record");
  EXPECT_EQ(b.to_json(), r.to_json());
  EXPECT_EQ(*b.variants.at("calibquant:bits=1").softmax_mse, 0.25);
  EXPECT_FALSE(b.variants.at("full").softmax_mse.has_value());
  nlohmann::json bad = r.to_json();
  bad["variants"]["full"].erase("caption");
  EXPECT_THROW(ImageRecord::from_json(bad, "record"), InputError);
}

TEST(EvalDatasets, CocoSplitLayoutIsFound) {
  const std::string d = kt::make_temp_dir("cocosplit");
  fs::create_directories(d + "/annotations");
  fs::create_directories(d + "/val2014");
  kt::write_file(d + "/annotations/captions_val2014.json", R"({"images": [
      {"id": 7, "file_name": "COCO_val2014_000000000007.jpg"}, {"id": 9, "file_name": "COCO_val2014_000000000009.jpg"},
      {"id": 11, "file_name": "COCO_val2014_000000000011.jpg"}],
    "annotations": [{"image_id": 9, "caption": "b"}, {"image_id": 7, "caption": "a"}, {"image_id": 7, "caption": "a2"}]})");
  kt::write_file(d + "/val2014/COCO_val2014_000000000007.jpg", "x");
  const EvalDataset ds = load_eval_dataset(d);
  EXPECT_EQ(ds.image_root, d + "/val2014");
  EXPECT_EQ(ds.images, (std::vector<size_t>{0, 1}));  // image 11 has no caption
  EXPECT_EQ(ds.ann.captions.at(7), (std::vector<std::string>{"a", "a2"}));
  EXPECT_EQ(ds.image_path(1), d + "/val2014/COCO_val2014_000000000009.jpg");
  // Two caption files: the message lists them.
  kt::write_file(d + "/captions_train2014.json", R"({"images": [], "annotations": []})");
  const std::string e = kt::error_of([&] { load_eval_dataset(d); });
  EXPECT_NE(e.find("several caption files"), std::string::npos) << e;
  EXPECT_NE(e.find("--annotations"), std::string::npos) << e;
  // An explicit annotations file and a missing image folder.
  const std::string e2 = kt::error_of([&] { load_eval_dataset(d, d + "/annotations/captions_val2014.json", d + "/nope"); });
  EXPECT_NE(e2.find("image file 'COCO_val2014_000000000007.jpg' not found"), std::string::npos) << e2;
  kt::write_file(d + "/q.json", R"([{"image_id": 5, "question": "q?", "answer": "a"}])");
  const std::string e3 =
      kt::error_of([&] { load_eval_dataset(d, d + "/annotations/captions_val2014.json", "", d + "/q.json"); });
  EXPECT_NE(e3.find("question for image_id 5"), std::string::npos) << e3;
}

}  // namespace
}  // namespace kvlens
