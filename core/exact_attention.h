// The exact attention of one decode query: what the method's attention is compared with. Each
// query head attends over the prompt's full-precision keys and values (positions 0 .. T−1, as
// prefill computed them) followed by the generated rows the method holds (positions ≥ T, in
// the method's row order). A device computes it from the prefill's capture, so that a decode
// step's diagnostics need neither the method's rows nor the prompt's on the host; the host
// reference below is what the CPU runs and what the device twin is tested against.
#pragma once
#include <cstdint>
#include <vector>

namespace kvlens {

class KVStore;

// Rows appended to the prompt's, per KV head: [n_kv_heads][n][head_dim] keys and values,
// positions [n_kv_heads][n] (-1: padding, for a head that holds fewer).
struct ExtraRows {
  int n = 0;
  std::vector<float> k, v;
  std::vector<int32_t> pos;
};

// The rows of layer `layer` of `store` at positions ≥ T, per KV head in the store's row order.
ExtraRows rows_from(const KVStore& store, int layer, int T);
// The same from gathered rows: k / v [n_kv_heads][n_k][head_dim] and key_pos [n_kv_heads][n_k].
ExtraRows rows_from(const float* k, const float* v, const int32_t* key_pos, int n_kv_heads, int n_k,
                    int head_dim, int T);

// The prompt's keys and values: k[h][t] is KV head h's key at position t (t < T).
struct PromptRows {
  int T = 0;
  std::vector<std::vector<const float*>> k, v;  // [n_kv_heads][T]
};
// The rows of `store` (a full prefill store: each head holds positions 0 .. T−1) of `layer`;
// the pointers stay valid while the store does.
PromptRows prompt_rows(const KVStore& store, int layer, int T);

struct ExactAttention {
  int n = 0;                   // keys per query head: T + extra.n
  std::vector<float> scores;   // [n_heads][n] q·k · scale, in float, components in ascending order (-inf: padding)
  std::vector<float> probs;    // [n_heads][n] exp(s − max) in float over a double sum (0: padding)
  std::vector<double> out;     // [n_heads][head_dim] Σ_j double(probs_j · v_j) in ascending j
  std::vector<int32_t> pos;    // [n_kv_heads][n] the keys' positions (-1: padding)
};

// The softmax the decode taps hand over (and ExactAttention::probs is): o[i] = float(double(e_i) /
// Σ_j double(e_j)) with e_i = exp(s[i] − max) in float, over the n scores s[0..n).
void softmax_double_sum(const float* s, int n, float* o);

// ExactAttention::pos for T prompt rows followed by `extra`: [n_kv_heads][T + extra.n].
std::vector<int32_t> exact_positions(int n_kv_heads, int T, const ExtraRows& extra);

// The host reference. q: [n_heads][head_dim] (after RoPE); query head h reads KV head
// h / (n_heads / n_kv_heads).
ExactAttention exact_attention(const float* q, int n_heads, int head_dim, float scale, const PromptRows& prompt,
                               const ExtraRows& extra);

}  // namespace kvlens
