// The evaluation loop of `kvlens eval`: for each image of a dataset, one vision pass and one
// prefill per prompt (the caption prompt and each question), shared by every variant; each
// variant compresses a copy of that prefill with a fresh policy and decodes greedily. Each
// finished image is written at once as images/<id>.json under the output folder, so an
// interrupted run loses at most the image in progress and resumes from the records it finds.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/eval/eval_dataset.h"
#include "app/lab/experiment.h"
#include "models/model.h"

namespace kvlens {

struct EvalSettings : GenerationSetup {
  EvalSettings() { max_new_tokens = 40; }
  bool vqa = true;
  bool softmax_mse = false;  // also the mean softmax MSE against the full cache (caption prompt)
  nlohmann::json to_json() const;
};

// Identifies a checkpoint cheaply: its config, tokenizer and the size, head and tail of each
// weight file (hex). Records made with another model or other settings are recomputed.
std::string model_fingerprint(const std::string& model_dir);
std::string record_fingerprint(const std::string& model_fp, const EvalSettings& s);

// Hash of the image file of position `pos` and of its questions (ImageRecord::source).
std::string image_source(const EvalDataset& ds, size_t pos);

// Computes the variants that `record` lacks for the image at position `pos` of ds.images.
void evaluate_image(const Model& model, const EvalDataset& ds, size_t pos, const std::vector<EvalVariant>& variants,
                    const EvalSettings& s, ImageRecord& record);

struct EvalProgress {
  size_t done = 0, total = 0;
  size_t computed = 0;  // images computed in this run (the others came from records on disk)
  double seconds = 0;   // spent computing them
};

// Evaluates the images at `positions`. With `out_dir`, records found in out_dir/images whose
// fingerprint is `fingerprint` are reused and every computed record is written there.
std::map<int64_t, ImageRecord> run_eval(const Model& model, const EvalDataset& ds, const std::vector<size_t>& positions,
                                        const std::vector<EvalVariant>& variants, const EvalSettings& s,
                                        const std::string& fingerprint, const std::string& out_dir,
                                        const std::function<void(const EvalProgress&)>& progress = {});

// The record of image `id` under out_dir/images, if present and readable.
bool read_image_record(const std::string& out_dir, int64_t id, ImageRecord& r);

}  // namespace kvlens
