#include "app/lab/memory_plan.h"

#include <algorithm>
#include <cstdio>

#include "core/errors.h"
#include "models/llama.h"

namespace kvlens {

std::string bytes_text(int64_t b) {
  char buf[32];
  if (b >= 1000000000) std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  else if (b >= 1000000) std::snprintf(buf, sizeof buf, "%.0f MB", b / 1e6);
  else std::snprintf(buf, sizeof buf, "%.0f kB", b / 1e3);
  return buf;
}

std::string MemoryPlan::breakdown() const {
  return "capture of the prompt's attention " + bytes_text(capture) + ", KV caches " + bytes_text(caches) +
         ", attention recomputed " + bytes_text(attention) + ", prefill work " + bytes_text(prefill_work);
}

MemoryPlan plan_experiment(const Model& model, const ExperimentOptions& opt, const VisualLayout& image) {
  const ModelInfo& f = model.info();
  MemoryPlan p;
  p.backend = model.backend().name();
  p.prompt_tokens = static_cast<int>(model.prompt_ids(opt.prompt, opt.templ, image).size());
  const int64_t T = p.prompt_tokens, L = f.n_layers, H = f.n_heads, KVH = f.n_kv_heads, D = f.head_dim;
  const int64_t row = (H + 2 * KVH) * D;  // q, k and v of one token
  const bool device = p.backend != "cpu";
  // The capture: each layer's q/k/v projection input in the matrices' dtype, and the q, k and v
  // of the layers it recomputed last (CapturedAttention::kept_slots, fp32).
  const int64_t slots = CapturedAttention::kept_slots(L, T, row);
  p.capture = L * T * f.hidden * f.matrix_bytes + slots * T * row * 4;
  // K and V of every token (prompt and new), fp16 on a device unless fp32 rows are asked for,
  // fp32 values on the CPU, and an int32 position; the prefill's cache and a decode's copy.
  const int64_t value = device && opt.kv_storage == RowStorage::Fp16 ? 2 : 4;
  p.caches = 2 * L * KVH * (T + opt.max_new_tokens) * (2 * D * value + 4);
  // On a device, each decode step's queries kept for the observers that read them afterwards
  // (LlamaDecoder::record_queries: every layer's q, fp32; without observers, ZipCache's probe
  // queries of one gap in their place, fewer), and the queries of the observed steps
  // put off to compare with the capture together (LlamaWorkspace::kStashSlots steps, every
  // layer's q/k/v row, fp32, and one call's copy).
  const int64_t jobs = LlamaDecoder::kExactLayersAtOnce * LlamaWorkspace::kStashSlots;
  if (device)
    p.caches += L * opt.max_new_tokens * H * D * 4 +
                (L + LlamaDecoder::kExactLayersAtOnce) * LlamaWorkspace::kStashSlots * row * 4;
  p.attention = H * T * T * 4 + T * H * D * 4;
  // The layers' prompt q, k, v that comparison holds beyond the capture's own
  // (LlamaDecoder::kExactLayersAtOnce a call), and on a device one call's arguments and results:
  // for each of its steps and layers the generated rows (keys and values, fp32) and the scores,
  // probabilities (fp32) and output (fp64) over every key.
  p.attention += std::max<int64_t>(0, std::min<int64_t>(L, LlamaDecoder::kExactLayersAtOnce) - slots) * T * row * 4;
  if (device)
    p.attention += jobs * (KVH * opt.max_new_tokens * D * 8 + H * (T + opt.max_new_tokens) * 8 + H * D * 8);
  // On a device, the recorded steps' sums over the patch overlay's span (the visual tokens, at
  // most the prompt) queued for every layer before they land, at most 256 MB at a time
  // (LlamaDecoder::hand_over_recorded).
  if (device) p.attention += std::min<int64_t>(LlamaDecoder::kHandOverBytes, L * opt.max_new_tokens * H * T * 4);
  p.prefill_work = T * (3 * static_cast<int64_t>(f.hidden) + row + H * D + 3 * static_cast<int64_t>(f.intermediate)) * 4;
  return p;
}

int64_t available_memory(const Model& model, const ExperimentOptions& opt) {
  int64_t used = 0, free_bytes = 0;
  model.backend().memory_info(used, free_bytes);
  const int64_t have = used + free_bytes > 0 ? free_bytes : -1;  // 0, 0: the backend does not say
  if (opt.memory_limit > 0) return have < 0 ? opt.memory_limit : std::min(have, opt.memory_limit);
  return have;
}

void check_memory(const Model& model, const ExperimentOptions& opt, const VisualLayout& image) {
  const int64_t have = available_memory(model, opt);
  if (have < 0) return;
  const MemoryPlan p = plan_experiment(model, opt, image);
  if (p.total() <= have) return;
  const std::string where = p.backend == "cpu" ? "memory" : p.backend + " device memory";
  std::string fix = p.backend == "cpu" ? "a shorter prompt or a larger --memory-limit-mb would fit"
                                       : "--backend cpu, a shorter prompt or fewer new tokens would fit";
  throw InputError("the run needs " + bytes_text(p.total()) + " of " + where + " beyond the weights for a " +
                   std::to_string(p.prompt_tokens) + "-token prompt (" + p.breakdown() + "), " + bytes_text(have) +
                   (opt.memory_limit > 0 && have == opt.memory_limit ? " allowed (--memory-limit-mb)" : " free") +
                   ": " + fix);
}

}  // namespace kvlens
