// The CUDA backend (kernels/cuda): construction and the reason a device cannot be used.
#pragma once
#include <memory>
#include <string>

#include "core/backend.h"

namespace kvlens::cuda {

// Empty when device `device` can run kvlens; otherwise why not, in words.
std::string unavailable_reason(int device);
std::shared_ptr<Backend> make_backend(const BackendOptions& opt);

}  // namespace kvlens::cuda
