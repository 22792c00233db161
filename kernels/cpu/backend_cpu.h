// The CPU backend: the op table on kernels/cpu's reference ops (fp32 everywhere, OpenBLAS for
// the matrix products). Its KV cache is the host KVStore itself.
#pragma once
#include <memory>

#include "core/backend.h"

namespace kvlens {

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace kvlens
