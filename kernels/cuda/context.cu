// The CUDA backend's shared state (context.h): the device, its stream and cuBLAS handle,
// allocations from the stream-ordered pool, page-locked staging and the copies through it.
#include <algorithm>
#include <exception>
#include <limits>
#include <string>

#include "core/errors.h"
#include "core/parallel.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "core/trace.h"

namespace kvlens::cuda {

void check_blas(cublasStatus_t st, const char* call, const std::string& what, const char* file, int line) {
  if (st == CUBLAS_STATUS_SUCCESS) return;
  throw DeviceError(std::string(call) + " failed for " + what + ": " + cublasGetStatusString(st) + " at " + file +
                    ":" + std::to_string(line));
}

Context::Context(int dev) : device(dev) {
  KV_CUDA(cudaSetDevice(dev), "device " + std::to_string(dev));
  cudaDeviceProp p{};
  KV_CUDA(cudaGetDeviceProperties(&p, dev), "device " + std::to_string(dev));
  name = p.name;
  n_sm = p.multiProcessorCount;
  sm90 = p.major >= 9;
  total_mem = static_cast<int64_t>(p.totalGlobalMem);
  KV_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "the run's stream");
  cudaMemPool_t pool;
  KV_CUDA(cudaDeviceGetDefaultMemPool(&pool, dev), "memory pool");
  uint64_t keep = std::numeric_limits<uint64_t>::max();
  KV_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "memory pool");
  KV_BLAS(cublasCreate(&blas), "cuBLAS handle");
  KV_BLAS(cublasSetStream(blas, stream), "cuBLAS stream");
  constexpr size_t kWs = 32u << 20;  // a fixed workspace lets cuBLAS calls be captured in graphs
  KV_CUDA(cudaMalloc(&blas_workspace, kWs), "cuBLAS workspace (32 MiB)");
  KV_BLAS(cublasSetWorkspace(blas, blas_workspace, kWs), "cuBLAS workspace");
  for (int i = 0; i < 2; ++i) {
    land_ring[i] = pinned(kLandChunk, "landing buffer (16 MiB, page-locked)");
    land_done[i] = event("landing buffer");
  }
}

Context::~Context() {
  if (stream) cudaStreamSynchronize(stream);
  if (blas) cublasDestroy(blas);
  if (blas_workspace) cudaFree(blas_workspace);
  inv_freq.clear();
  if (stream) cudaStreamDestroy(stream);
}

void Context::free_memory(int64_t& free_bytes, int64_t& total) const {
  size_t f = 0, t = 0;
  cudaMemGetInfo(&f, &t);
  free_bytes = static_cast<int64_t>(f);
  total = static_cast<int64_t>(t);
  // The stream-ordered pool keeps what was freed (release threshold: never): that memory is free
  // to this process's next allocations too.
  int dev = 0;
  cudaMemPool_t pool;
  uint64_t reserved = 0, in_use = 0;
  if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess &&
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) == cudaSuccess &&
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &in_use) == cudaSuccess && reserved > in_use)
    free_bytes += static_cast<int64_t>(reserved - in_use);
}

std::shared_ptr<void> Context::alloc(int64_t bytes, const std::string& what) {
  if (capturing) throw InternalError("cuda: allocation of " + what + " inside a captured step");
  void* p = nullptr;
  const cudaError_t e = cudaMallocAsync(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1)), stream);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    int64_t f = 0, t = 0;
    free_memory(f, t);
    throw OutOfMemory("out of GPU memory allocating " + what + " (" + mib(bytes) + "): " + mib(f) + " free of " +
                      mib(t) + " on " + name);
  }
  KV_CUDA(e, what + " (" + mib(bytes) + ")");
  std::shared_ptr<Context> self = shared_from_this();
  return std::shared_ptr<void>(p, [self](void* q) { cudaFreeAsync(q, self->stream); });
}

std::shared_ptr<void> Context::pinned(int64_t bytes, const std::string& what) {
  void* p = nullptr;
  const cudaError_t e = cudaMallocHost(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1)));
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    throw OutOfMemory("out of page-locked host memory allocating " + what + " (" + mib(bytes) + ")");
  }
  KV_CUDA(e, what + " (" + mib(bytes) + " of page-locked host memory)");
  return std::shared_ptr<void>(p, [](void* q) { cudaFreeHost(q); });
}

void* Context::staging(int64_t bytes, const std::string& what) {
  if (bytes <= staging_bytes) return staging_mem.get();
  sync(what);  // a copy into the old buffer may still be in flight
  if (bytes > staging_largest) {  // (copies with pageable memory are done when their call returns)
    staging_largest = bytes;
    staging_pageable.reset(new char[static_cast<size_t>(bytes)]);  // (not zeroed: copies fill it)
    return staging_pageable.get();
  }
  staging_mem.reset();
  staging_bytes = 0;  // (none, should the allocation fail)
  staging_mem = pinned(bytes, what);
  staging_bytes = bytes;
  if (bytes == staging_largest) staging_pageable.reset();  // (the pinned buffer now serves that size)
  return staging_mem.get();
}

std::shared_ptr<CUevent_st> Context::event(const std::string& what) {
  cudaEvent_t e = nullptr;
  KV_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), what + " (event)");
  return std::shared_ptr<CUevent_st>(e, [](cudaEvent_t q) { cudaEventDestroy(q); });
}

void Context::download_async(void* dst, const void* src, int64_t bytes, const std::string& what) {
  if (bytes == 0) return;
  KV_CUDA(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, stream),
          what + " (" + std::to_string(bytes) + " bytes from the device)");
}

void Context::upload(void* dst, const void* src, int64_t bytes, const std::string& what) {
  if (bytes == 0) return;
  KV_CUDA(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream),
          what + " (" + std::to_string(bytes) + " bytes to the device)");
}

void Context::download(void* dst, const void* src, int64_t bytes, const std::string& what) {
  trace::Scope span("cuda.download");
  if (bytes == 0) return;
  KV_CUDA(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, stream),
          what + " (" + std::to_string(bytes) + " bytes from the device)");
  KV_CUDA(cudaStreamSynchronize(stream), what + " (" + std::to_string(bytes) + " bytes from the device)");
}

void Context::land_later(std::shared_ptr<void> src, int64_t bytes, std::function<void(const char*)> land) {
  landings.push_back(Landing{std::move(src), bytes, std::move(land)});
}

char* Context::upload_room(int64_t bytes) {
  const int64_t b = (bytes + 15) / 16 * 16;
  if (b <= 0 || b > kLandChunk) return nullptr;
  // The two buffers as one run of 2·kLandChunk bytes, a piece never across their boundary.
  int64_t at = room_used.load();
  for (;;) {
    int64_t from = at;
    if (from < kLandChunk && from + b > kLandChunk) from = kLandChunk;
    if (from + b > 2 * kLandChunk) return nullptr;
    if (room_used.compare_exchange_weak(at, from + b)) {
      const int k = from >= kLandChunk ? 1 : 0;
      return static_cast<char*>(land_ring[k].get()) + (from - k * kLandChunk);
    }
  }
}

void Context::land_all(const std::string& what) {
  trace::Scope span("cuda.land_all");
  std::vector<Landing> all = std::move(landings);
  landings.clear();
  // Batches of consecutive landings within kLandChunk, each landing at `from` bytes into its
  // batch's buffer (16-byte aligned); a larger one alone, through the staging buffer.
  struct Batch {
    size_t first = 0, end = 0;
    int64_t bytes = 0;
    char* host = nullptr;  // where its copies went
    bool staged() const { return bytes > kLandChunk; }
  };
  std::vector<int64_t> from(all.size());
  std::vector<Batch> batches;
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t b = (all[i].bytes + 15) / 16 * 16;
    if (batches.empty() || batches.back().bytes + b > kLandChunk || b > kLandChunk) batches.push_back({i, i, 0, nullptr});
    from[i] = batches.back().bytes;
    batches.back().end = i + 1;
    batches.back().bytes += b;
  }
  // Batch k's copies into its buffer, then its event (the buffer's previous batch has landed).
  auto copy = [&](size_t k) {
    Batch& B = batches[k];
    B.host = B.staged() ? static_cast<char*>(staging(B.bytes, what)) : static_cast<char*>(land_ring[k % 2].get());
    for (size_t i = B.first; i < B.end; ++i)
      if (all[i].bytes) download_async(B.host + from[i], all[i].src.get(), all[i].bytes, what);
    KV_CUDA(cudaEventRecord(land_done[k % 2].get(), stream), what + " (landing event)");
  };
  std::exception_ptr failed;
  if (!batches.empty()) copy(0);
  for (size_t k = 0; k < batches.size(); ++k) {
    const Batch& B = batches[k];
    // The next batch copied while this one lands, unless either goes through the staging buffer.
    const bool next = k + 1 < batches.size(), ahead = next && !B.staged() && !batches[k + 1].staged();
    if (ahead) copy(k + 1);
    {
      trace::Scope wait("cuda.land_wait");
      KV_CUDA(cudaEventSynchronize(land_done[k % 2].get()), what);
    }
    try {
      parallel_for(static_cast<int>(B.end - B.first), 8, [&](int j) {
        const size_t i = B.first + static_cast<size_t>(j);
        all[i].land(B.host + from[i]);
      });
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
    if (next && !ahead) copy(k + 1);
  }
  // The upload room back once the uploads from it are done (waited for with the batches).
  if (room_used.load() > 0) {
    if (batches.empty()) sync(what);
    room_used = 0;
  }
  if (failed) std::rethrow_exception(failed);
}

void defer_landing(Context& ctx, quant::QuantPayload& out, std::shared_ptr<void> src, int64_t bytes, KVBytes counted,
                   std::function<void(const char*)> land) {
  const std::string what = "a payload's arrays kept on the device";
  std::shared_ptr<CUevent_st> made = ctx.event(what);
  KV_CUDA(cudaEventRecord(made.get(), ctx.stream), what);
  const int device = ctx.device;
  out.defer(counted, [src = std::move(src), bytes, made, device, land = std::move(land), what] {
    trace::Scope span("cuda.land_deferred");
    KV_CUDA(cudaSetDevice(device), what);
    KV_CUDA(cudaEventSynchronize(made.get()), what);
    std::vector<char> host(static_cast<size_t>(std::max<int64_t>(bytes, 1)));
    if (bytes > 0)
      KV_CUDA(cudaMemcpy(host.data(), src.get(), static_cast<size_t>(bytes), cudaMemcpyDeviceToHost),
              what + " (" + std::to_string(bytes) + " bytes to the host)");
    land(host.data());
  });
}

void Context::sync(const std::string& what) {
  trace::Scope span("cuda.sync");
  KV_CUDA(cudaStreamSynchronize(stream), what);
}

}  // namespace kvlens::cuda
