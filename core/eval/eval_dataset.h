// What `kvlens eval` evaluates: a COCO-style caption dataset (a scene set from `kvlens scenes`,
// or a COCO split: captions_val2014.json-style annotations and an image folder, with optional
// questions), the method variants (each method × bit-width), the shard of the images one
// process takes, and the per-image record every variant's outputs are kept in.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/eval/coco.h"
#include "core/compress/method.h"

namespace kvlens {

struct EvalDataset {
  std::string dir;
  CocoAnnotations ann;                 // images in file order; only those with a caption are evaluated
  std::vector<CocoQuestion> questions;
  std::vector<size_t> images;          // positions in ann.images that have at least one caption
  std::string image_root;              // file_name is relative to this folder

  std::string image_path(size_t pos) const;  // pos into ann.images
};

// Folder layout: annotations are `annotations` when given, else DIR/annotations.json (scene
// sets), else the one DIR/captions_*.json or DIR/annotations/captions_*.json. Images are found
// under `images` when given, else under DIR, DIR/images or DIR/<split> (captions_val2014.json →
// val2014). Questions come from `questions` when given, else from the annotations'
// "questions". Throws InputError naming what is missing.
EvalDataset load_eval_dataset(const std::string& dir, const std::string& annotations = "",
                              const std::string& images = "", const std::string& questions = "");
// The annotations file load_eval_dataset reads from `dir` when none is given: DIR/annotations.json,
// else the one captions_*.json in DIR or DIR/annotations. InputError when there is none, or several.
std::string find_annotations(const std::string& dir);

// A deterministic split of the images: shard I of N takes every N-th image from the I-th.
struct Shard {
  int index = 0, count = 1;
  std::string text() const { return std::to_string(index) + "/" + std::to_string(count); }
};
Shard parse_shard(const std::string& text);  // "I/N" with 0 <= I < N; InputError otherwise
// Positions (into ds.images) one shard evaluates among the first `limit` images (0 = all).
std::vector<size_t> shard_positions(size_t n_images, size_t limit, const Shard& shard);

// One row of a results table: the full cache, or a method with its parameters (a quantizer at
// one bit-width).
struct EvalVariant {
  std::string key;    // canonical spec, e.g. "calibquant:bits=1,...", or "full"; the cache key
  std::string label;  // short spec without the bit-width, e.g. "vlcache:budget=0.05"
  std::string method;
  int bits = 0;       // the method's bits parameter, 0 when it has none
  std::optional<Params> params;  // none for the full cache
};

// "full" first, then each spec; a spec whose method has a `bits` parameter becomes one variant
// per entry of `bits` (when `bits` is not empty) that the method accepts, and one whose method
// has a `budget` parameter one per entry of `budgets`; values a method refuses are listed in
// `skipped` ("kivi: bits=8 not accepted (...)"). Duplicates are dropped. A label names the
// method and the parameters that differ from their defaults or between rows of the method.
std::vector<EvalVariant> expand_variants(const std::vector<std::string>& specs, const std::vector<int>& bits,
                                         std::vector<std::string>* skipped, const std::vector<double>& budgets = {});
std::vector<int> parse_bits_list(const std::string& text);        // "8,4,2,1"
std::vector<double> parse_budget_list(const std::string& text);  // "0.05,0.1,0.2,0.4"

// Everything kvlens computed for one image, per variant key.
struct VariantOutput {
  std::string caption;
  double kv_bytes = 0;                     // KV cache bytes after compression (caption prompt)
  std::optional<double> softmax_mse;       // when asked for: mean over layers vs the full cache
  std::vector<std::string> answers;        // one per question of the image, in file order
  double ms = 0;                           // compression + decode time of the caption and answers
};

struct ImageRecord {
  int64_t image_id = 0;
  std::string fingerprint;    // model + settings the outputs belong to
  std::string source;         // the image file and its questions the outputs belong to
  double fp16_bytes = 0;      // the full prompt cache stored as fp16 (the ratio's numerator)
  std::map<std::string, VariantOutput> variants;

  nlohmann::json to_json() const;
  static ImageRecord from_json(const nlohmann::json& j, const std::string& where);
};

}  // namespace kvlens
