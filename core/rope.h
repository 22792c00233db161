// Rotary position embedding's inverse frequencies, as HF transformers' ROPE_INIT_FUNCTIONS compute
// them in fp32: "default" (1 / theta^(2i/D)) and "llama3" (Llama-3.1's scaling: low frequencies
// divided by `factor`, high ones kept, the band between blended smoothly). Every backend turns
// the same table into its rotations.
#pragma once
#include <string>
#include <vector>

namespace kvlens {

struct Rope {
  float theta = 10000.0f;
  std::string type = "default";  // "default" or "llama3"
  // llama3: the scaling's parameters (rope_parameters / rope_scaling in config.json).
  float factor = 1.0f, low_freq_factor = 1.0f, high_freq_factor = 4.0f;
  int original_max_position = 8192;

  Rope() = default;
  Rope(float base) : theta(base) {}  // NOLINT: a default rope of base theta
  // The D / 2 inverse frequencies of a head of D dimensions.
  std::vector<float> inv_freq(int D) const;
  // What tells two tables apart (the type, theta and the scaling), for caches of tables.
  std::string key() const;
};

}  // namespace kvlens
