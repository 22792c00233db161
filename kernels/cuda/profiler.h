// The CUDA backend's profiler.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/context.h"

namespace kvlens::cuda {

// Per-op timing with CUDA events (KVLENS_CUDA_PROFILE=1): each op records an event before and
// after its launches; the report sums them per op name. Ops called from several threads at once
// (a decode step's layers collected in parallel) share the list under a lock.
class Profiler {
 public:
  Profiler() : on_(std::getenv("KVLENS_CUDA_PROFILE") != nullptr) {}
  bool on() const { return on_; }
  struct Scope {
    Profiler* p;
    size_t i;
    cudaStream_t s;
    ~Scope() {
      if (!p) return;
      std::lock_guard<std::mutex> l(p->mu_);
      cudaEventRecord(p->recs_[i].b, s);
    }
  };
  Scope scope(const char* name, const Context& ctx) {
    if (!on_ || ctx.replay || ctx.capturing) return {nullptr, 0, nullptr};
    Rec r;
    r.name = name;
    cudaEventCreate(&r.a);
    cudaEventCreate(&r.b);
    cudaEventRecord(r.a, ctx.stream);
    std::lock_guard<std::mutex> l(mu_);
    recs_.push_back(r);
    return {this, recs_.size() - 1, ctx.stream};
  }
  std::vector<std::pair<std::string, double>> report() {
    std::lock_guard<std::mutex> l(mu_);
    std::vector<std::pair<std::string, double>> out;
    for (Rec& r : recs_) {
      cudaEventSynchronize(r.b);
      float ms = 0;
      cudaEventElapsedTime(&ms, r.a, r.b);
      auto it = std::find_if(out.begin(), out.end(), [&](const auto& x) { return x.first == r.name; });
      if (it == out.end()) out.push_back({r.name, ms});
      else it->second += ms;
      cudaEventDestroy(r.a);
      cudaEventDestroy(r.b);
    }
    recs_.clear();
    return out;
  }

 private:
  struct Rec {
    std::string name;
    cudaEvent_t a, b;
  };
  bool on_;
  std::mutex mu_;  // recs_
  std::vector<Rec> recs_;
};

}  // namespace kvlens::cuda
