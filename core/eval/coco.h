// COCO caption files: annotations (captions_val2014.json layout: "images" with id and
// file_name, "annotations" with image_id and caption, optionally "questions" as in kvlens scene
// sets), results ([{"image_id", "caption"}]), and scoring results against annotations the way
// pycocoevalcap's COCOEvalCap does with params['image_id'] set to the results' images:
// images in the order of the annotation file, references in the order of their annotations,
// both lists tokenized by coco_tokenize, then BLEU-1..4, METEOR, ROUGE-L and CIDEr-D.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlens {

class MeteorScorer;

struct CocoQuestion {
  int64_t image_id = 0;
  std::string question, answer, type;
};

struct CocoAnnotations {
  struct Image {
    int64_t id = 0;
    std::string file_name;
  };
  std::string path;
  std::vector<Image> images;                              // file order
  std::map<int64_t, std::vector<std::string>> captions;   // per image, file order
  std::vector<CocoQuestion> questions;                    // "questions", when present
};

struct CocoResult {
  int64_t image_id = 0;
  std::string caption;
};

// Throw InputError naming the file and the entry that is malformed.
CocoAnnotations load_coco_annotations(const std::string& path);
std::vector<CocoResult> load_coco_results(const std::string& path);
// Questions file: a list of {"image_id", "question", "answer"[, "type"]} or {"questions": [...]}.
std::vector<CocoQuestion> load_coco_questions(const std::string& path);
nlohmann::json coco_results_json(const std::vector<CocoResult>& results);

struct CaptionScores {
  size_t images = 0;
  std::array<double, 4> bleu{};
  std::optional<double> meteor;  // empty when METEOR could not run
  std::string meteor_status;     // why METEOR is missing ("" when it ran)
  double rouge_l = 0, cider_d = 0;
  std::vector<std::string> warnings;  // inputs that pycocoevalcap mishandles, reproduced as it does
  // Metric name → value ("BLEU-1" ... "CIDEr-D"; METEOR null when missing).
  nlohmann::json to_json() const;
};

// The metric names in table order: BLEU-1..4, METEOR, ROUGE-L, CIDEr-D.
const std::vector<std::string>& caption_metric_names();
double metric_value(const CaptionScores& s, const std::string& name);  // NaN for a missing METEOR

// Scores `results` against `ann`. Every result's image must be in the annotations with at
// least one caption, and have exactly one result. `meteor` may be null (METEOR reported
// missing with `meteor_status`).
CaptionScores score_captions(const CocoAnnotations& ann, const std::vector<CocoResult>& results,
                             MeteorScorer* meteor, const std::string& meteor_status = "not requested");

}  // namespace kvlens
