// The results table of `kvlens eval` in the layout of CalibQuant's Table 1: one row per
// variant (method, bits), BLEU-1..4, METEOR, ROUGE-L, CIDEr-D as pycocoevalcap computes them,
// VQA accuracy where the dataset has questions, mean KV bytes and the compression ratio
// against the fp16 full cache; as Markdown, CSV and JSON, plus each row's COCO results file.
// Built from per-image records alone, so a merged set of shards gives the same table as one run.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/eval/coco.h"
#include "core/eval/eval_dataset.h"

namespace kvlens {

struct EvalRow {
  EvalVariant variant;
  CaptionScores scores;
  size_t caption_exact = 0;                 // captions equal to one of the references
  size_t questions = 0, vqa_correct = 0;
  std::map<std::string, std::pair<size_t, size_t>> vqa_by_type;  // type → (correct, total)
  double kv_bytes = 0;                      // mean over images
  double ratio = 0;                         // mean fp16 full-cache bytes / kv_bytes
  std::optional<double> softmax_mse;        // mean over images, when every record has it
  std::vector<CocoResult> results;
  std::string results_file;                 // results/<name>.json

  std::optional<double> vqa_accuracy() const;
};

struct EvalTable {
  std::string dataset;
  size_t images = 0;
  bool has_questions = false;
  std::string meteor_status;                // "" when METEOR was computed
  std::vector<std::string> notes;           // variants skipped, warnings
  std::vector<EvalRow> rows;

  nlohmann::json to_json() const;
  std::string markdown() const;
  std::string csv() const;
};

// Rows for `variants` over the images at `positions` (into ds.images), from `records` (by
// image id; each must hold every variant; with `vqa`, an answer to each of the image's
// questions). Throws InputError naming a missing record.
EvalTable build_eval_table(const EvalDataset& ds, const std::vector<size_t>& positions,
                           const std::vector<EvalVariant>& variants, const std::map<int64_t, ImageRecord>& records,
                           bool vqa, MeteorScorer* meteor, const std::string& meteor_status);

// Writes table.md, table.csv, table.json and results/<row>.json under `dir`.
void write_eval_table(const EvalTable& t, const std::string& dir);

// A caption or answer as compared for exact match: surrounding white space removed.
std::string trim_answer(const std::string& s);

}  // namespace kvlens
