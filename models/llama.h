// Llama decoder (HF LlamaForCausalLM): RMSNorm, RoPE, GQA attention, SiLU-gated MLP, lm_head.
// Attention in decode reads the KV store as it is; the policy and observers are called at one
// hook point each.
#pragma once
#include <string>
#include <vector>

#include "core/kv_store.h"
#include "core/observer.h"
#include "core/policy.h"
#include "core/tensor.h"
#include "models/config.h"
#include "models/safetensors.h"

namespace kvlens {

struct LlamaLayer {
  Tensor ln1, q_w, k_w, v_w, o_w, q_b, k_b, v_b, o_b, ln2, gate_w, up_w, down_w;
};

// What prefill may keep per layer for policies and diagnostics.
struct PrefillCapture {
  bool keep = false;
  std::vector<std::vector<float>> q;       // [layer][T][n_heads][head_dim]
  std::vector<std::vector<float>> scores;  // [layer][n_heads][T][T]
  std::vector<std::vector<float>> probs;   // [layer][n_heads][T][T]
};

class LlamaDecoder {
 public:
  LlamaConfig cfg;
  Tensor embed, norm, lm_head;  // lm_head may alias embed (tied)
  bool tied = false;
  std::vector<LlamaLayer> layers;

  static LlamaDecoder load(const WeightStore& ws, const std::string& prefix,
                           const std::string& lm_head_name, bool tie, const LlamaConfig& cfg);

  // Writes token embeddings of ids into out [n][hidden]; ids must be < vocab_size.
  void embed_tokens(const std::vector<int>& ids, float* out) const;
  // Runs the prompt x [T][hidden] (positions 0..T-1), appends every layer's K/V to `store`
  // tagged by `kinds`, and returns the logits of the last position.
  std::vector<float> prefill(const Tensor& x, const std::vector<SegmentKind>& kinds, KVStore& store,
                             const std::vector<AttentionObserver*>& observers,
                             PrefillCapture* capture) const;
  // One decode step for token embedding x [hidden] at position `pos` (step = 0 for the first
  // generated token's forward); returns logits.
  std::vector<float> decode(const float* x, int pos, int step, KVStore& store, KVPolicy* policy,
                            const std::vector<AttentionObserver*>& observers) const;

 private:
  std::vector<float> logits_of(const float* h) const;
};

}  // namespace kvlens
