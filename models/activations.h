// Activation names as HF configs spell them.
#pragma once
#include <string>

#include "core/errors.h"
#include "kernels/cpu/ops.h"

namespace kvlens {

inline Act activation_from_name(const std::string& name, const std::string& key) {
  if (name == "gelu") return Act::Gelu;
  if (name == "gelu_new" || name == "gelu_pytorch_tanh" || name == "gelu_fast") return Act::GeluTanh;
  if (name == "quick_gelu") return Act::QuickGelu;
  if (name == "silu" || name == "swish") return Act::Silu;
  if (name == "relu") return Act::Relu;
  throw InputError(key + ": activation '" + name +
                   "' is not supported (gelu, gelu_new, gelu_pytorch_tanh, quick_gelu, silu, relu)");
}

}  // namespace kvlens
