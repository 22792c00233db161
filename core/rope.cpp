#include "core/rope.h"

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "core/errors.h"

namespace kvlens {

std::vector<float> Rope::inv_freq(int D) const {
  std::vector<float> inv(static_cast<size_t>(D / 2));
  if (type == "axial") {  // HF Qwen2VLVisionRotaryEmbedding: 1 / theta^(2j/(D/2)) for each section
    const int n = rows(), per = D / 2 / n;
    if (per * n != D / 2) throw InternalError("rope: axial sections do not split " + std::to_string(D / 2) + " frequencies evenly");
    for (int i = 0; i < D / 2; ++i)
      inv[static_cast<size_t>(i)] =
          1.0f / std::pow(theta, static_cast<float>(2 * (i % per)) / static_cast<float>(D / 2));
    return inv;
  }
  for (int i = 0; i < D / 2; ++i)  // 1 / theta^(2i/D) in fp32, as HF computes it
    inv[static_cast<size_t>(i)] = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(D));
  if (type == "default") return inv;
  if (type != "llama3") throw InternalError("rope: type '" + type + "' has no frequencies");
  // HF _compute_llama3_parameters, its fp32 tensor arithmetic in the same order.
  const float old_len = static_cast<float>(original_max_position);
  const float low_wavelen = static_cast<float>(static_cast<double>(original_max_position) / low_freq_factor);
  const float high_wavelen = static_cast<float>(static_cast<double>(original_max_position) / high_freq_factor);
  const float two_pi = static_cast<float>(2.0 * M_PI);
  const float span = static_cast<float>(static_cast<double>(high_freq_factor) - low_freq_factor);
  for (float& f : inv) {
    const float wavelen = (1.0f / f) * two_pi;
    const float scaled = wavelen > low_wavelen ? f / factor : f;
    if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
      const float smooth = ((1.0f / wavelen) * old_len - low_freq_factor) / span;
      f = (1.0f - smooth) * scaled / factor + smooth * scaled;
    } else {
      f = scaled;
    }
  }
  return inv;
}

std::vector<int> Rope::row_of(int D) const {
  std::vector<int> r(static_cast<size_t>(D / 2), 0);
  if (sections.empty()) return r;
  int64_t sum = 0;
  for (int s : sections) sum += s;
  if (sum != D / 2) throw InternalError("rope: sections cover " + std::to_string(sum) + " of " + std::to_string(D / 2) + " frequencies");
  size_t i = 0;
  for (size_t s = 0; s < sections.size(); ++s)
    for (int k = 0; k < sections[s]; ++k) r[i++] = static_cast<int>(s);
  return r;
}

std::string Rope::key() const {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s/%.9g/%.9g/%.9g/%.9g/%d", type.c_str(), theta, factor, low_freq_factor,
                high_freq_factor, original_max_position);
  std::string k = buf;
  for (int s : sections) k += "/" + std::to_string(s);
  return k;
}

}  // namespace kvlens
