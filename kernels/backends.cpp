#include "kernels/backends.h"

#include "core/errors.h"
#include "kernels/cpu/backend_cpu.h"
#ifdef KVLENS_HAVE_CUDA
#include "kernels/cuda/backend_cuda.h"
#endif

namespace kvlens {

bool cuda_built() {
#ifdef KVLENS_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

std::string cuda_unavailable_reason(int device) {
#ifdef KVLENS_HAVE_CUDA
  return cuda::unavailable_reason(device);
#else
  (void)device;
  return "kvlens was built without CUDA (configure with -DKVLENS_CUDA=ON or AUTO where nvcc is found)";
#endif
}

std::shared_ptr<Backend> make_backend(const BackendOptions& opt) {
  const std::string kind = parse_backend_kind(opt.kind, "--backend");
  if (kind == "cpu") return make_cpu_backend();
  const std::string why = cuda_unavailable_reason(opt.device);
  if (!why.empty()) {
    if (kind == "auto") return make_cpu_backend();
    throw InputError("--backend cuda: " + why);
  }
#ifdef KVLENS_HAVE_CUDA
  return cuda::make_backend(opt);
#else
  return make_cpu_backend();
#endif
}

}  // namespace kvlens
