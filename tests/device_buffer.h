// Device memory for the tests that call CUDA kernels directly: a cudaMalloc'd buffer (at least 4
// bytes) freed at scope end, optionally filled from a host vector, read back with host<T>(n).
// Include only where KVLENS_HAVE_CUDA is defined.
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

namespace kvlens::testing {

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t n) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 4)), cudaSuccess); }
  template <class T>
  Dev(const std::vector<T>& v) : Dev(v.size() * sizeof(T)) {
    EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
  // The first n T's, copied to the host.
  template <class T>
  std::vector<T> host(size_t n) const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

}  // namespace kvlens::testing
