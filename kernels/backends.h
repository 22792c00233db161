// Backend construction: "cpu", "cuda" (an error naming the reason when kvlens was built without
// CUDA or no device is usable) or "auto" (CUDA when a device is usable, else the CPU).
#pragma once
#include <memory>
#include <string>

#include "core/backend.h"

namespace kvlens {

std::shared_ptr<Backend> make_backend(const BackendOptions& opt);
// Whether this build has the CUDA backend, and why a device cannot be used (empty = usable).
bool cuda_built();
std::string cuda_unavailable_reason(int device = 0);

}  // namespace kvlens
