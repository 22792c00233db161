// Rotary position embedding's inverse frequencies, as HF transformers' ROPE_INIT_FUNCTIONS compute
// them in fp32: "default" (1 / theta^(2i/D)), "llama3" (Llama-3.1's scaling: low frequencies
// divided by `factor`, high ones kept, the band between blended smoothly) and "axial" (Qwen2-VL's
// vision tower: the table of a D/2-wide head once per section). Every backend turns the same
// table into its rotations.
//
// Sections (Qwen2-VL's M-RoPE `mrope_section`; the axial rope's height and width): the D/2
// frequencies split into consecutive runs, run r rotated by row r of the positions ([rows][T]).
// Given one row of positions, every frequency takes it (a text token's positions are equal).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kvlens {

struct Rope {
  float theta = 10000.0f;
  std::string type = "default";  // "default" or "llama3"
  // llama3: the scaling's parameters (rope_parameters / rope_scaling in config.json).
  float factor = 1.0f, low_freq_factor = 1.0f, high_freq_factor = 4.0f;
  int original_max_position = 8192;
  std::vector<int> sections;  // frequencies a position row rotates (empty: one row)

  Rope() = default;
  Rope(float base) : theta(base) {}  // NOLINT: a default rope of base theta
  // The D / 2 inverse frequencies of a head of D dimensions.
  std::vector<float> inv_freq(int D) const;
  // The position row of each of the D / 2 frequencies (all 0 without sections); the sections
  // must sum to D / 2 (InternalError otherwise: configs are checked when parsed).
  std::vector<int> row_of(int D) const;
  int rows() const { return sections.empty() ? 1 : static_cast<int>(sections.size()); }
  // Whether n_positions positions of T tokens are a row per section ([rows][T]) rather than one.
  bool sectioned(int64_t n_positions, int T) const { return rows() > 1 && n_positions == static_cast<int64_t>(rows()) * T; }
  // What tells two tables apart (the type, theta and the scaling), for caches of tables.
  std::string key() const;
};

}  // namespace kvlens
