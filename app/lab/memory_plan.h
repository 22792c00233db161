// The memory a run of the lab needs in the backend's memory beyond the loaded weights (on the
// GPU, device memory), planned before it starts from the model's facts and the run's options,
// and checked against what the backend has free: a run that cannot fit is refused with both
// numbers and what would make it fit, never a CUDA error halfway through.
#pragma once
#include <cstdint>
#include <string>

#include "app/lab/experiment.h"
#include "models/model.h"

namespace kvlens {

struct MemoryPlan {
  std::string backend;       // where it runs ("cuda", "cpu")
  int prompt_tokens = 0;
  int64_t capture = 0;       // each layer's q/k/v input, and the q, k, v of the layers recomputed last
  // The prefill's KV cache and one decode's copy, with rows for every new token (and on a
  // device the decode queries recorded for observers).
  int64_t caches = 0;
  // One layer's [heads][T][T] attention recomputed (scores, then probabilities), and the prompt
  // q/k/v an observed decode step holds beyond the capture's.
  int64_t attention = 0;
  int64_t prefill_work = 0;  // the prefill's activations (hidden states, q/k/v, MLP)
  int64_t total() const { return capture + caches + attention + prefill_work; }
  // "capture 969 MB, KV caches 2 × 124 MB, attention recomputed 49 MB, prefill work 371 MB"
  std::string breakdown() const;
};

// `image`: where the image's visual tokens lie (Model::visual_layout; empty for a text-only model).
MemoryPlan plan_experiment(const Model& model, const ExperimentOptions& opt, const VisualLayout& image);
// What the backend can still give, in bytes: free device memory (with what its pool holds unused),
// or opt.memory_limit when that is set and smaller; -1 where the backend does not say (the CPU).
int64_t available_memory(const Model& model, const ExperimentOptions& opt);
// Throws InputError when plan_experiment(model, opt, image) needs more than available_memory.
void check_memory(const Model& model, const ExperimentOptions& opt, const VisualLayout& image);
// "1.23 GB", "456 MB", "12 kB" (decimal units).
std::string bytes_text(int64_t b);

}  // namespace kvlens
