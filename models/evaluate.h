// Caption and VQA accuracy of a model (optionally under a compression method) on a scene set
// written by `kvlens scenes`: greedy decoding, the caption must equal one of the 5 references,
// a VQA answer must equal the reference answer (after trimming).
#pragma once
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/llava.h"

namespace kvlens {

struct SceneSet {
  struct Image {
    int64_t id = 0;
    std::string file;
    std::vector<std::string> captions;
  };
  struct Question {
    int64_t image_id = 0;
    std::string question, answer, type;
  };
  std::string dir;
  std::vector<Image> images;
  std::vector<Question> questions;
};

// Reads DIR/annotations.json (COCO caption layout + questions). Throws InputError naming the
// file and what is missing.
SceneSet load_scene_set(const std::string& dir);

struct EvalOptions {
  int max_images = 0;          // 0 = all
  bool vqa = true;
  int max_new_tokens = 40;
  std::string method;          // empty = full cache
  RowStorage kv_storage = RowStorage::Fp16;  // dense rows of the decode cache
};

struct EvalResult {
  std::string method;
  std::string kv_storage;      // dense rows of the decode cache ("fp16" / "fp32")
  int images = 0, caption_exact = 0;
  int questions = 0, vqa_correct = 0;
  std::map<std::string, std::pair<int, int>> vqa_by_type;  // type → (correct, total)
  double kv_bytes_mean = 0;    // after prefill compression, caption prompts
  double caption_ms_mean = 0;  // vision + prefill + decode per caption
  std::vector<std::string> captions;
  double caption_accuracy() const { return images ? static_cast<double>(caption_exact) / images : 0.0; }
  double vqa_accuracy() const { return questions ? static_cast<double>(vqa_correct) / questions : 0.0; }
  nlohmann::json to_json() const;
};

EvalResult evaluate_scenes(const LlavaModel& model, const SceneSet& set, const EvalOptions& opt);

}  // namespace kvlens
