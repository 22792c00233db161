// A plain fp32 tensor: row-major data with its shape written beside it. Intermediates are
// named with their layer ("l3.attn.scores") so CPU and CUDA activations can be compared.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/errors.h"

namespace kvlens {

// Activation functions of the graphs' MLPs, as the backend ops (core/backend.h) and the CPU
// reference ops (kernels/cpu/ops.h) take them.
enum class Act { Gelu, GeluTanh, QuickGelu, Silu, Relu };

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;

  Tensor() = default;
  Tensor(std::string n, std::vector<int64_t> s) : name(std::move(n)), shape(std::move(s)) {
    data.assign(static_cast<size_t>(numel()), 0.0f);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t dim(int i) const { return shape.at(i < 0 ? shape.size() + i : i); }
  // Item i along the first dimension, as a tensor of the remaining ones (tile i of [tiles][3][S][S]).
  Tensor item(int64_t i) const {
    Tensor t(name, std::vector<int64_t>(shape.begin() + 1, shape.end()));
    std::copy(data.begin() + i * t.numel(), data.begin() + (i + 1) * t.numel(), t.data.begin());
    return t;
  }
  float* ptr() { return data.data(); }
  const float* ptr() const { return data.data(); }
  std::string shape_str() const {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

// Throws NonFiniteError naming `tensor` when one of the n values is NaN or ±Inf. The models
// check each layer's output once (one pass over it), so a checkpoint whose weights hold NaN is
// reported at the first tensor it reaches instead of producing a garbage caption.
inline void check_finite(const float* x, int64_t n, const std::string& tensor) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i]))
      throw NonFiniteError(tensor + " is not finite (value " + std::to_string(x[i]) + " at index " +
                           std::to_string(i) + "): the checkpoint's weights hold NaN or Inf, or the activations overflow");
}

}  // namespace kvlens
