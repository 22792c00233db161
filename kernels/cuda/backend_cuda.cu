// The CUDA backend: the op table of core/backend.h on kernels/cuda. Weights are uploaded once
// in the checkpoint's dtype (f16 / bf16; f32 as f32, or f16 on request); matrix products go
// through cuBLAS (fp32 accumulation; the one-token case through the own gemv kernel); every
// other op is an own kernel. One stream; memory from the device's stream-ordered pool.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>

#include "core/errors.h"
#include "core/kv_format.h"
#include "core/tensor.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/profiler.h"
#include "core/trace.h"

namespace kvlens::cuda {

namespace {

uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7f800000u) == 0x7f800000u && (x & 0x7fffffu)) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(x >> 16);
}
float bf16_to_f32(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// Checkpoint values of `t` converted to dtype `to` into out (host).
void convert_host(const HostTensor& t, Dt to, void* out) {
  const int64_t n = t.numel();
  if (t.dt == to) {
    std::memcpy(out, t.data, static_cast<size_t>(n * dt_size(to)));
    return;
  }
  const auto* src = static_cast<const unsigned char*>(t.data);
  for (int64_t i = 0; i < n; ++i) {
    float f;
    if (t.dt == Dt::F32) {
      std::memcpy(&f, src + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      f = t.dt == Dt::F16 ? quant::from_half(h) : bf16_to_f32(h);
    }
    if (to == Dt::F32) {
      std::memcpy(static_cast<unsigned char*>(out) + 4 * i, &f, 4);
    } else {
      const uint16_t h = to == Dt::F16 ? quant::to_half(f) : f32_to_bf16(f);
      std::memcpy(static_cast<unsigned char*>(out) + 2 * i, &h, 2);
    }
  }
}

cudaDataType blas_type(Dt d) {
  switch (d) {
    case Dt::F32: return CUDA_R_32F;
    case Dt::F16: return CUDA_R_16F;
    case Dt::BF16: return CUDA_R_16BF;
    case Dt::I32: break;
  }
  throw InternalError("cuda: no cuBLAS type for i32");
}

void need(bool ok, const std::string& what) {
  if (!ok) throw InternalError("cuda backend: " + what);
}

struct CudaStep : StepCache {
  cudaGraphExec_t exec = nullptr;
  uint64_t key = 0;
  bool warmed = false;
  ~CudaStep() override {
    if (exec) cudaGraphExecDestroy(exec);
  }
};

class CudaBackend : public Backend {
 public:
  CudaBackend(std::shared_ptr<Context> ctx, bool fp32_as_fp16) : ctx_(std::move(ctx)), fp32_as_fp16_(fp32_as_fp16) {}
  std::vector<std::pair<std::string, double>> profile_report() override { return prof_.report(); }

  std::string name() const override { return "cuda"; }
  std::string device() const override {
    return ctx_->name + " (" + std::to_string(ctx_->n_sm) + " SMs, " + mib(ctx_->total_mem) + ")";
  }
  bool supports(Op op) const override { return op != Op::Count; }

  Buffer alloc(const std::string& name, std::vector<int64_t> shape, Dt dt) override {
    Buffer b;
    b.name = name;
    b.shape = std::move(shape);
    b.dt = dt;
    b.hold = ctx_->alloc(std::max<int64_t>(b.bytes(), 1), name + " " + b.shape_str() + " " + dt_name(dt));
    b.data = b.hold.get();
    return b;
  }
  void upload(const void* host, Buffer& dst) override {
    const std::string what = dst.name + " " + dst.shape_str();
    if (dst.numel() == 0) return;
    if (dst.dt == Dt::F32 || dst.dt == Dt::I32) {
      ctx_->upload(dst.data, host, dst.bytes(), what);
      return;
    }
    std::vector<unsigned char> tmp(static_cast<size_t>(dst.bytes()));
    convert_host({dst.name, Dt::F32, dst.shape, host}, dst.dt, tmp.data());
    ctx_->upload(dst.data, tmp.data(), dst.bytes(), what);
  }
  void download(const Buffer& src, void* host) override {
    const std::string what = src.name + " " + src.shape_str();
    if (src.numel() == 0) return;
    if (src.dt == Dt::F32 || src.dt == Dt::I32) {
      ctx_->download(host, src.data, src.bytes(), what);
      return;
    }
    std::vector<unsigned char> tmp(static_cast<size_t>(src.bytes()));
    ctx_->download(tmp.data(), src.data, src.bytes(), what);
    convert_host({src.name, src.dt, src.shape, tmp.data()}, Dt::F32, host);
  }
  Buffer matrix(const std::string& name, const std::vector<HostTensor>& parts) override {
    need(!parts.empty(), name + ": no parts");
    if (!have_mdt_) {
      mdt_ = parts[0].dt == Dt::F32 && fp32_as_fp16_ ? Dt::F16 : parts[0].dt;
      have_mdt_ = true;
    }
    const int64_t cols = parts[0].numel() / parts[0].shape[0];
    int64_t rows = 0;
    for (const HostTensor& p : parts) {
      need(p.numel() == p.shape[0] * cols, name + ": parts differ in columns");
      rows += p.shape[0];
    }
    Buffer b = alloc(name, {rows, cols}, mdt_);
    char* at = static_cast<char*>(b.data);
    for (const HostTensor& p : parts) {
      const int64_t bytes = p.numel() * dt_size(mdt_);
      if (p.dt == mdt_) {
        ctx_->upload(at, p.data, bytes, name + " (" + p.name + ")");
      } else {
        std::vector<unsigned char> tmp(static_cast<size_t>(bytes));
        convert_host(p, mdt_, tmp.data());
        ctx_->upload(at, tmp.data(), bytes, name + " (" + p.name + ")");
      }
      at += bytes;
    }
    return b;
  }
  Buffer vector(const HostTensor& t) override {
    Buffer b = alloc(t.name, t.shape, Dt::F32);
    std::vector<float> tmp(static_cast<size_t>(t.numel()));
    convert_host(t, Dt::F32, tmp.data());
    ctx_->upload(b.data, tmp.data(), b.bytes(), t.name);
    return b;
  }
  void synchronize() override { ctx_->sync("synchronize"); }
  double copy_bandwidth() override {
    // 1 GiB device to device, median of 20 after 3 warm-ups, bytes read + written.
    const int64_t n = int64_t{1} << 30;
    auto a = ctx_->alloc(n, "copy bandwidth source"), b = ctx_->alloc(n, "copy bandwidth target");
    KV_CUDA(cudaMemsetAsync(a.get(), 1, n, ctx_->stream), "copy bandwidth source");
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    std::vector<float> ms;
    for (int i = 0; i < 23; ++i) {
      cudaEventRecord(e0, ctx_->stream);
      KV_CUDA(cudaMemcpyAsync(b.get(), a.get(), n, cudaMemcpyDeviceToDevice, ctx_->stream), "copy bandwidth (1 GiB)");
      cudaEventRecord(e1, ctx_->stream);
      cudaEventSynchronize(e1);
      float t = 0;
      cudaEventElapsedTime(&t, e0, e1);
      if (i >= 3) ms.push_back(t);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::sort(ms.begin(), ms.end());
    return 2.0 * static_cast<double>(n) / (ms[ms.size() / 2] * 1e-3);
  }
  void memory_info(int64_t& used, int64_t& free_bytes) override {
    int64_t total = 0;
    ctx_->free_memory(free_bytes, total);
    used = total - free_bytes;
  }

  void linear(const Buffer& x, const Buffer& W, const Buffer* bias, Buffer& y, bool accumulate) override {
    const int64_t M = x.rows(), K = x.cols(), N = W.rows();
    need(x.dt == W.dt && y.dt == Dt::F32 && W.cols() == K && y.rows() == M && y.cols() == N,
         "linear: " + x.name + x.shape_str() + dt_name(x.dt) + " · " + W.name + W.shape_str() + dt_name(W.dt) +
             "ᵀ → " + y.name + y.shape_str() + dt_name(y.dt));
    if (bias) need(bias->numel() == N && bias->dt == Dt::F32, "linear: bias " + bias->name);
    if (ctx_->replay) return;
    auto prof_scope = prof_.scope("linear", *ctx_);
    const bool aligned = (reinterpret_cast<uintptr_t>(x.data) & 15) == 0 && (reinterpret_cast<uintptr_t>(W.data) & 15) == 0;
    if (M == 1 && gemv_supported(W.dt, static_cast<int>(K)) && aligned) {
      GemvParams p;
      p.W = W.data, p.dt = W.dt, p.N = static_cast<int>(N), p.K = static_cast<int>(K), p.x = x.data;
      p.bias = bias ? bias->as<float>() : nullptr, p.y = y.as<float>(), p.accumulate = accumulate;
      gemv(p, ctx_->stream);
      return;
    }
    if (bias) add_bias_rows(y.as<float>(), bias->as<float>(), M, N, accumulate, ctx_->stream);
    const float alpha = 1.0f, beta = (bias || accumulate) ? 1.0f : 0.0f;
    const cudaDataType t = blas_type(W.dt);
    KV_BLAS(cublasGemmEx(ctx_->blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
                         static_cast<int>(K), &alpha, W.data, t, static_cast<int>(K), x.data, t, static_cast<int>(K),
                         &beta, y.data, CUDA_R_32F, static_cast<int>(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            W.name + " " + std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K));
  }
  void norm_linear(const Buffer& h, const Buffer& g, float eps, Buffer& x, const Buffer& W, const Buffer* bias,
                   Buffer& y, const std::string* check) override {
    const int64_t K = h.cols();
    const bool fused = h.rows() == 1 && h.dt == Dt::F32 && gemv_supported(W.dt, static_cast<int>(K)) &&
                       W.cols() == K && y.dt == Dt::F32 && y.cols() == W.rows() && g.numel() == K &&
                       ((reinterpret_cast<uintptr_t>(h.data) | reinterpret_cast<uintptr_t>(g.data) |
                         reinterpret_cast<uintptr_t>(W.data)) & 15) == 0;
    if (!fused) return Backend::norm_linear(h, g, eps, x, W, bias, y, check);
    if (bias) need(bias->numel() == W.rows() && bias->dt == Dt::F32, "norm_linear: bias " + bias->name);
    // The check of h rides on the product: its first block looks at every value of h as it
    // computes the norm, so the check costs no kernel of its own.
    unsigned long long* slot = check ? check_slot(*check) : nullptr;
    if (ctx_->replay) return;
    auto prof_scope = prof_.scope("norm_linear", *ctx_);
    GemvParams p;
    p.check = slot;
    p.W = W.data, p.dt = W.dt, p.N = static_cast<int>(W.rows()), p.K = static_cast<int>(K);
    p.h = h.as<float>(), p.g = g.as<float>(), p.eps = eps;
    p.bias = bias ? bias->as<float>() : nullptr, p.y = y.as<float>();
    gemv(p, ctx_->stream);
  }
  void norm_gate_up(const Buffer& h, const Buffer& g, float eps, Buffer& x, const Buffer& W, Act act, Buffer& gu,
                    Buffer& out, const std::string* check) override {
    const int64_t K = h.cols(), I = out.cols();
    const bool fused = h.rows() == 1 && h.dt == Dt::F32 && gemv_supported(W.dt, static_cast<int>(K)) && W.cols() == K &&
                       W.rows() == 2 * I && out.rows() == 1 && out.dt == W.dt && g.numel() == K &&
                       ((reinterpret_cast<uintptr_t>(h.data) | reinterpret_cast<uintptr_t>(g.data) |
                         reinterpret_cast<uintptr_t>(W.data)) & 15) == 0;
    if (!fused) return Backend::norm_gate_up(h, g, eps, x, W, act, gu, out, check);
    unsigned long long* slot = check ? check_slot(*check) : nullptr;
    if (ctx_->replay) return;
    auto prof_scope = prof_.scope("norm_gate_up", *ctx_);
    GemvParams p;
    p.check = slot;
    p.W = W.data, p.dt = W.dt, p.N = static_cast<int>(I), p.K = static_cast<int>(K);
    p.h = h.as<float>(), p.g = g.as<float>(), p.eps = eps;
    p.act = static_cast<int>(act), p.out = out.data;
    gemv(p, ctx_->stream);
  }
  void rms_norm(const Buffer& x, const Buffer& g, float eps, Buffer& y) override {
    need(x.dt == Dt::F32 && x.numel() == y.numel() && g.numel() == x.cols(), "rms_norm: " + x.name + " → " + y.name);
    if (ctx_->replay) return;
    auto prof_scope = prof_.scope("rms_norm", *ctx_);
    cuda::rms_norm(x.as<float>(), y.data, y.dt, static_cast<int>(x.rows()), static_cast<int>(x.cols()), g.as<float>(),
                   eps, ctx_->stream);
  }
  void layer_norm(const Buffer& x, const Buffer& g, const Buffer* b, float eps, Buffer& y) override {
    need(x.dt == Dt::F32 && x.numel() == y.numel() && g.numel() == x.cols(), "layer_norm: " + x.name + " → " + y.name);
    if (ctx_->replay) return;
    auto prof_scope = prof_.scope("layer_norm", *ctx_);
    cuda::layer_norm(x.as<float>(), y.data, y.dt, static_cast<int>(x.rows()), static_cast<int>(x.cols()),
                     g.as<float>(), b ? b->as<float>() : nullptr, eps, ctx_->stream);
  }
  // The device slot of a new check named `tensor` (in replay too, so names keep their slots).
  unsigned long long* check_slot(const std::string& tensor) {
    if (!checks_.mem) {
      if (ctx_->replay || ctx_->capturing) throw InternalError("check_finite: first check inside a captured step");
      checks_ = {ctx_->alloc(kChecks * 8, "finiteness checks"), kChecks * 8};
      KV_CUDA(cudaMemsetAsync(checks_.mem.get(), 0xff, kChecks * 8, ctx_->stream), "finiteness checks");
    }
    if (static_cast<int64_t>(check_names_.size()) >= kChecks) finish_checks();
    const size_t slot = check_names_.size();
    check_names_.push_back(tensor);
    return checks_.as<unsigned long long>() + slot;
  }
  void check_finite(const Buffer& x, const std::string& tensor) override {
    need(x.dt == Dt::F32, "check_finite: " + x.name + " must be f32");
    unsigned long long* slot = check_slot(tensor);
    if (ctx_->replay) return;
    first_nonfinite(x.as<float>(), x.numel(), slot, ctx_->stream);
  }
  void finish_checks() override {
    if (check_names_.empty()) return;
    const size_t n = check_names_.size();
    std::vector<unsigned long long> v(n);
    ctx_->download(v.data(), checks_.mem.get(), static_cast<int64_t>(n) * 8, "finiteness checks");
    KV_CUDA(cudaMemsetAsync(checks_.mem.get(), 0xff, n * 8, ctx_->stream), "finiteness checks");
    std::vector<std::string> names;
    names.swap(check_names_);
    raise_failed_check(names, v.data());
  }

  // ---- chained greedy steps ----
  bool chains_steps() const override { return true; }
  void next_token(const Buffer& logits, Buffer& ids, Buffer& pos) override {
    need(logits.dt == Dt::F32 && logits.rows() == 1 && logits.numel() > 0 && ids.dt == Dt::I32 && ids.numel() >= 1 &&
             pos.dt == Dt::I32 && pos.numel() >= 1,
         "next_token: " + logits.name + logits.shape_str() + " → " + ids.name + ", " + pos.name);
    if (ctx_->replay) return;
    auto prof_scope = prof_.scope("next_token", *ctx_);
    cuda::next_token(logits.as<float>(), static_cast<int>(logits.numel()), ids.as<int32_t>(), pos.as<int32_t>(),
                     ctx_->stream);
  }
  // A readback's host side: logits, the token (at an 8-byte offset), then the check words.
  int start_readback(const Buffer& logits, const Buffer& ids) override {
    need(logits.dt == Dt::F32 && logits.rows() == 1 && ids.dt == Dt::I32 && ids.numel() >= 1,
         "start_readback: " + logits.name + logits.shape_str() + ", " + ids.name);
    Readback& r = rb_[tickets_ % kReadbacks];
    if (r.ticket >= 0)
      throw InternalError("start_readback: more than " + std::to_string(kReadbacks) + " decode steps in flight");
    const int64_t nl = logits.numel(), nc = static_cast<int64_t>(check_names_.size());
    const int64_t tok_at = (nl * 4 + 7) / 8 * 8, chk_at = tok_at + 8, bytes = chk_at + nc * 8;
    if (r.cap < bytes) {
      r.host = ctx_->pinned(bytes, "decode step readback");
      r.cap = bytes;
    }
    if (!r.done) r.done = ctx_->event("decode step readback");
    char* h = static_cast<char*>(r.host.get());
    ctx_->download_async(h, logits.data, nl * 4, "step logits " + logits.name);
    ctx_->download_async(h + tok_at, ids.data, 4, "step token " + ids.name);
    if (nc) {
      ctx_->download_async(h + chk_at, checks_.mem.get(), nc * 8, "finiteness checks");
      KV_CUDA(cudaMemsetAsync(checks_.mem.get(), 0xff, static_cast<size_t>(nc) * 8, ctx_->stream), "finiteness checks");
    }
    KV_CUDA(cudaEventRecord(r.done.get(), ctx_->stream), "decode step readback");
    r.names.swap(check_names_);
    check_names_.clear();
    r.n_logits = nl;
    r.ticket = tickets_;
    return tickets_++;
  }
  void finish_readback(int ticket, float* logits, int32_t* token) override {
    Readback& r = rb_[ticket % kReadbacks];
    if (ticket != finished_ || r.ticket != ticket)
      throw InternalError("finish_readback: ticket " + std::to_string(ticket) + " is not the oldest in flight (" +
                          std::to_string(finished_) + ")");
    {
      trace::Scope wait("cuda.step_wait");
      KV_CUDA(cudaEventSynchronize(r.done.get()), "decode step readback");
    }
    r.ticket = -1;
    ++finished_;
    const char* h = static_cast<const char*>(r.host.get());
    const int64_t tok_at = (r.n_logits * 4 + 7) / 8 * 8;
    std::memcpy(logits, h, static_cast<size_t>(r.n_logits) * 4);
    std::memcpy(token, h + tok_at, 4);
    std::vector<std::string> names;
    names.swap(r.names);
    std::vector<unsigned long long> v(names.size());
    std::memcpy(v.data(), h + tok_at + 8, v.size() * 8);
    raise_failed_check(names, v.data());
  }
  void drop_readbacks() override {
    // The bookkeeping first, so that a failing sync leaves no step counted as in flight.
    for (Readback& r : rb_) {
      r.ticket = -1;
      r.names.clear();
    }
    finished_ = tickets_;
    const size_t nc = check_names_.size();
    check_names_.clear();
    if (nc) KV_CUDA(cudaMemsetAsync(checks_.mem.get(), 0xff, nc * 8, ctx_->stream), "finiteness checks");
    ctx_->sync("decode steps launched ahead");
  }

  void add(Buffer& x, const Buffer& y) override {
    need(x.dt == Dt::F32 && y.dt == Dt::F32 && x.numel() == y.numel(), "add: " + x.name + " + " + y.name);
    if (ctx_->replay) return;
    auto prof_scope = prof_.scope("add", *ctx_);
    cuda::add(x.as<float>(), y.as<float>(), x.numel(), ctx_->stream);
  }
  void bias_act(const Buffer& y, const Buffer* bias, Act act, bool apply_act, Buffer& out) override {
    need(y.dt == Dt::F32 && y.numel() == out.numel(), "bias_act: " + y.name + " → " + out.name);
    if (ctx_->replay) return;
    auto prof_scope = prof_.scope("bias_act", *ctx_);
    cuda::bias_act(y.as<float>(), bias ? bias->as<float>() : nullptr, y.rows(), y.cols(),
                   apply_act ? static_cast<int>(act) : -1, out.data, out.dt, ctx_->stream);
  }
  void gated_act(const Buffer& gu, Act act, Buffer& out) override {
    need(gu.dt == Dt::F32 && out.rows() == gu.rows() && out.cols() * 2 == gu.cols(), "gated_act: " + gu.name);
    if (ctx_->replay) return;
    auto prof_scope = prof_.scope("gated_act", *ctx_);
    cuda::gated_act(gu.as<float>(), gu.rows(), out.cols(), static_cast<int>(act), out.data, out.dt, ctx_->stream);
  }
  void rope(Buffer& qkv, const AttnLayout& l, const Buffer& pos, const Rope& rope) override {
    // One row of positions, or one per section ([rows][T]).
    const bool sectioned = rope.sectioned(pos.numel(), l.T);
    need(qkv.dt == Dt::F32 && pos.dt == Dt::I32 && (sectioned || pos.numel() >= l.T) && l.head_dim % 2 == 0,
         "rope: " + qkv.name);
    const float* inv = inv_freq(l.head_dim, rope);
    const int32_t* rows = sectioned ? rope_rows(l.head_dim, rope) : nullptr;
    if (ctx_->replay) return;
    auto prof_scope = prof_.scope("rope", *ctx_);
    cuda::rope(qkv.as<float>(), l.T, l.row_stride, l.q_col, l.n_heads, l.k_col, l.n_kv_heads, l.head_dim,
               pos.as<int32_t>(), inv, rows, ctx_->stream);
  }
  void embed(const Buffer& table, const Buffer& ids, Buffer& out) override {
    need(ids.dt == Dt::I32 && out.dt == Dt::F32 && out.cols() == table.cols() && out.rows() == ids.numel(),
         "embed: " + out.name);
    if (ctx_->replay) return;
    auto prof_scope = prof_.scope("embed", *ctx_);
    cuda::embed(table.data, table.dt, table.rows(), table.cols(), ids.as<int32_t>(), static_cast<int>(ids.numel()),
                out.as<float>(), ctx_->stream);
  }
  void copy_block(const Buffer& src, int64_t sr, int64_t sc, Buffer& dst, int64_t dr, int64_t dc, int64_t n,
                  int64_t cols) override {
    need(src.dt == dst.dt && sr + n <= src.rows() && sc + cols <= src.cols() && dr + n <= dst.rows() &&
             dc + cols <= dst.cols(),
         "copy_block: " + src.name + " → " + dst.name + " out of range or of another dtype");
    if (ctx_->replay || n == 0 || cols == 0) return;
    auto prof_scope = prof_.scope("copy_block", *ctx_);
    const int64_t e = dt_size(src.dt);
    KV_CUDA(cudaMemcpy2DAsync(dst.as<char>() + (dr * dst.cols() + dc) * e, dst.cols() * e,
                              src.as<char>() + (sr * src.cols() + sc) * e, src.cols() * e, cols * e, n,
                              cudaMemcpyDeviceToDevice, ctx_->stream),
            src.name + " → " + dst.name + " (" + std::to_string(n) + "x" + std::to_string(cols) + ")");
  }
  void attention(const Buffer& qkv, const AttnLayout& l, Buffer& out, float* scores, float* probs) override {
    need(qkv.dt == Dt::F32 && out.rows() == l.T && out.cols() == static_cast<int64_t>(l.n_heads) * l.head_dim,
         "attention: " + qkv.name + " → " + out.name);
    if (ctx_->replay) return;
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());
    auto prof_scope = prof_.scope("attention", *ctx_);
    attention_prefill(qkv.as<float>(), l, out.data, out.dt, ctx_->stream);
    if (!scores && !probs) return;
    // Capture on request: the T×T scores and probabilities, computed in fp32 and copied out.
    const int64_t n = static_cast<int64_t>(l.n_heads) * l.T * l.T;
    const auto s = ctx_->alloc(n * 4, "attention capture scores");
    attention_scores(qkv.as<float>(), l, static_cast<float*>(s.get()), ctx_->stream);
    if (scores) ctx_->download(scores, s.get(), n * 4, "attention scores");
    softmax_rows(static_cast<float*>(s.get()), static_cast<int64_t>(l.n_heads) * l.T, l.T, ctx_->stream);
    if (probs) ctx_->download(probs, s.get(), n * 4, "attention probabilities");
  }

  // The research path's reductions and LOOK-M's assignment: kernels/cuda/research_ops.cu.
  bool attention_reduce(const Buffer& qkv, const AttnLayout& l, const AttentionReduction& r) override {
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());
    auto prof_scope = prof_.scope("attention_reduce", *ctx_);
    reduce_prefill_attention(*ctx_, qkv, l, r);
    return true;
  }
  bool attention_reduce_later(const Buffer& qkv, const AttnLayout& l, const AttentionReduction& r) override {
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());
    auto prof_scope = prof_.scope("attention_reduce", *ctx_);
    queue_prefill_reduction(*ctx_, qkv, l, r);
    return true;
  }
  void finish_reductions() override {
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());
    ctx_->land_all("queued reductions");
  }
  bool queues_reductions() const override { return true; }
  bool cosine_assign(int d, const std::vector<const std::vector<float>*>& k, const std::vector<const std::vector<int>*>& keep,
                     std::vector<std::vector<RowAssignment>>& out) override {
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());
    auto prof_scope = prof_.scope("cosine_assign", *ctx_);
    assign_by_cosine(*ctx_, d, k, keep, out);
    return true;
  }
  bool kv_lookm_merge(DeviceKV& dev, const LookMMergeSpec& spec, std::vector<LayerMerge>& layers) override {
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());
    auto prof_scope = prof_.scope("kv_lookm_merge", *ctx_);
    cuda::kv_lookm_merge(*ctx_, dev, spec, layers);
    return true;
  }
  std::unique_ptr<DeviceKV> kv_create(int n_layers, int n_kv_heads, int head_dim) override {
    return cuda::kv_create(ctx_, n_layers, n_kv_heads, head_dim);
  }
  void kv_append(SeqKV& kv, int layer, const Buffer& qkv, const AttnLayout& l, const Buffer& pos,
                 const int32_t* pos_host, const SegmentKind* kinds, int T) override {
    auto prof_scope = prof_.scope("kv_append", *ctx_);
    cuda::kv_append(*ctx_, kv, layer, qkv, l, pos, pos_host, kinds, T);
  }
  void rope_append_attend(SeqKV& kv, int layer, Buffer& qkv, const AttnLayout& l, const Buffer& pos,
                          const int32_t* pos_host, const SegmentKind* kinds, const Rope& rope, Buffer& out) override {
    {
      auto prof_scope = prof_.scope("rope_append_attend", *ctx_);
      if (cuda::kv_rope_attend(*ctx_, kv, layer, qkv, l, pos, pos_host, kinds, inv_freq(l.head_dim, rope), out)) return;
    }
    Backend::rope_append_attend(kv, layer, qkv, l, pos, pos_host, kinds, rope, out);
  }
  void rope_append(SeqKV& kv, int layer, Buffer& qkv, const AttnLayout& l, const Buffer& pos, const int32_t* pos_host,
                   const SegmentKind* kinds, int T, const Rope& rope) override {
    need(qkv.dt == Dt::F32 && pos.dt == Dt::I32 && l.head_dim % 2 == 0, "rope_append: " + qkv.name);
    const float* inv = inv_freq(l.head_dim, rope);
    {
      auto prof_scope = prof_.scope("rope_append", *ctx_);
      if (cuda::kv_rope_append(*ctx_, kv, layer, qkv, l, pos, pos_host, kinds, T, inv)) return;
    }
    Backend::rope_append(kv, layer, qkv, l, pos, pos_host, kinds, T, rope);
  }
  void decode_attention(const Buffer& qkv, const AttnLayout& l, SeqKV& kv, int layer, const ScoreTransform* transform,
                        Buffer& out, const DecodeTaps& taps) override {
    auto prof_scope = prof_.scope("decode_attention", *ctx_);
    kv_decode_attention(*ctx_, qkv, l, kv, layer, transform, out, taps);
  }
  bool defers_decode_taps() const override { return true; }
  void decode_attention_deferred(const Buffer& qkv, const AttnLayout& l, SeqKV& kv, int layer,
                                 const ScoreTransform* transform, Buffer& out, bool want_out) override {
    auto prof_scope = prof_.scope("decode_attention", *ctx_);
    kv_decode_deferred(*ctx_, qkv, l, kv, layer, transform, out, want_out);
  }
  void collect_deferred(SeqKV& kv, int layer, const ScoreTransform* transform, const DecodeTaps& taps) override {
    auto prof_scope = prof_.scope("collect_deferred", *ctx_);
    kv_collect_deferred(*ctx_, kv, layer, transform, taps);
  }
  bool records_decode_queries() const override { return true; }
  void recorded_attention(SeqKV& kv, int layer, const Buffer& q_rows, const AttnLayout& l,
                          const std::vector<int32_t>& positions, const ScoreTransform* transform,
                          std::vector<RecordedAttention>& out) override {
    auto prof_scope = prof_.scope("recorded_attention", *ctx_);
    kv_recorded_attention(*ctx_, kv, layer, q_rows, l, positions, transform, out);
  }
  bool recorded_span_attention(SeqKV& kv, int layer, const Buffer& q_rows, const AttnLayout& l,
                               const std::vector<int32_t>& positions, const ScoreTransform* transform, int first, int n,
                               std::vector<float>& out) override {
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());  // (its sums join the context's queue)
    auto prof_scope = prof_.scope("recorded_span_attention", *ctx_);
    return kv_recorded_span_attention(*ctx_, kv, layer, q_rows, l, positions, transform, first, n, out);
  }
  bool exact_decode_attention(const Buffer& qkv, const AttnLayout& l, const Buffer& prompt, const AttnLayout& pl,
                              const ExtraRows& extra, ExactAttention& out) override {
    auto prof_scope = prof_.scope("exact_decode_attention", *ctx_);
    std::vector<ExactAttention> one;
    cuda::exact_decode_attention(*ctx_, qkv, l, {&prompt}, pl, {extra}, one);
    out = std::move(one.front());
    return true;
  }
  bool exact_decode_attention_layers(const Buffer& qkv_rows, const AttnLayout& l, const std::vector<const Buffer*>& prompts,
                                     const AttnLayout& pl, const std::vector<ExtraRows>& extras,
                                     std::vector<ExactAttention>& out) override {
    auto prof_scope = prof_.scope("exact_decode_attention", *ctx_);
    cuda::exact_decode_attention(*ctx_, qkv_rows, l, prompts, pl, extras, out);
    return true;
  }
  bool quantize_rows(DeviceKV& dev, int layer, const KVSegment& seg, const quant::UniformSpec& k,
                     const quant::UniformSpec& v, quant::QuantPayload& out) override {
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());
    auto prof_scope = prof_.scope("quantize_rows", *ctx_);
    return cuda::kv_quantize_rows(*ctx_, dev, layer, seg, k, v, out, false);
  }
  bool quantize_rows_later(DeviceKV& dev, int layer, const KVSegment& seg, const quant::UniformSpec& k,
                           const quant::UniformSpec& v, quant::QuantPayload& out) override {
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());
    auto prof_scope = prof_.scope("quantize_rows", *ctx_);
    return cuda::kv_quantize_rows(*ctx_, dev, layer, seg, k, v, out, true);
  }
  bool code_rows(DeviceKV& dev, int layer, const KVSegment& seg, const quant::RowCodec& k, const quant::RowCodec& v,
                 quant::QuantPayload& out) override {
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());
    auto prof_scope = prof_.scope("code_rows", *ctx_);
    return cuda::kv_code_rows(*ctx_, dev, layer, seg, k, v, out, false);
  }
  bool code_rows_later(DeviceKV& dev, int layer, const KVSegment& seg, const quant::RowCodec& k,
                       const quant::RowCodec& v, quant::QuantPayload& out) override {
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());
    auto prof_scope = prof_.scope("code_rows", *ctx_);
    return cuda::kv_code_rows(*ctx_, dev, layer, seg, k, v, out, true);
  }
  bool zip_quantize_rows(DeviceKV& dev, const std::vector<ZipRowsGroup>& groups) override {
    std::lock_guard<std::recursive_mutex> lock(ops_mutex());
    auto prof_scope = prof_.scope("zip_quantize_rows", *ctx_);
    return cuda::kv_zip_quantize(*ctx_, dev, groups);
  }
  void kv_hydrate(const DeviceKV& dev, KVStore& host, bool rows) override { cuda::kv_hydrate(*ctx_, dev, host, rows); }
  void kv_sync(DeviceKV& dev, KVStore& host, int layer) override { cuda::kv_sync(*ctx_, dev, host, layer); }
  void kv_reserve(DeviceKV& dev, int rows, const StepQuant& quant) override { cuda::kv_reserve(*ctx_, dev, rows, quant); }
  void kv_before_step(SeqKV& kv) override {
    if (!kv.dev || !cuda::kv_has_groups(*kv.dev)) return;
    auto prof_scope = prof_.scope("kv_quantize_groups", *ctx_);
    cuda::kv_before_step(*ctx_, kv);
  }
  bool kv_quantizes_before_step(const SeqKV& kv) const override {
    return kv.dev && cuda::kv_groups_due(*kv.dev);
  }
  bool quantizes_steps(const StepQuant& quant, int head_dim) const override {
    return cuda::kv_quantizes_steps(quant, head_dim);
  }
  void kv_pull_rows(SeqKV& kv, const std::vector<int>& layers, const int32_t* pos_host, const SegmentKind* kinds,
                    int T) override {
    cuda::kv_pull_rows(*ctx_, kv, layers, pos_host, kinds, T);
  }

  // A step is run eagerly the first time its key is seen (library handles and scratch are set
  // up then), captured as a CUDA graph the second time, and replayed after that: the graph is
  // launched first and the body then runs with launches off, for its host bookkeeping.
  void run_step(std::unique_ptr<StepCache>& cache, uint64_t key, const std::function<void()>& body) override {
    if (key == 0 || prof_.on()) {  // profiling times every op: no replay
      body();
      return;
    }
    if (!cache) cache = std::make_unique<CudaStep>();
    auto* st = dynamic_cast<CudaStep*>(cache.get());
    if (!st) throw InternalError("run_step: a step cache of another backend");
    if (st->exec && st->key == key) {
      KV_CUDA(cudaGraphLaunch(st->exec, ctx_->stream), "decode step graph");
      ctx_->replay = true;
      try {
        body();
      } catch (...) {
        ctx_->replay = false;
        throw;
      }
      ctx_->replay = false;
      return;
    }
    if (st->key != key) {
      if (st->exec) cudaGraphExecDestroy(st->exec);
      st->exec = nullptr;
      st->key = key;
      st->warmed = false;
    }
    if (!st->warmed) {
      trace::Scope eager("cuda.step_eager");
      body();
      st->warmed = true;
      return;
    }
    trace::Scope captured("cuda.step_capture");
    cudaGraph_t graph = nullptr;
    KV_CUDA(cudaStreamBeginCapture(ctx_->stream, cudaStreamCaptureModeThreadLocal), "decode step capture");
    ctx_->capturing = true;
    try {
      body();
    } catch (...) {
      ctx_->capturing = false;
      cudaStreamEndCapture(ctx_->stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    ctx_->capturing = false;
    KV_CUDA(cudaStreamEndCapture(ctx_->stream, &graph), "decode step capture");
    const cudaError_t e = cudaGraphInstantiate(&st->exec, graph, 0);
    cudaGraphDestroy(graph);
    KV_CUDA(e, "decode step graph instantiation");
    KV_CUDA(cudaGraphLaunch(st->exec, ctx_->stream), "decode step graph");
  }

 private:
  // A rope table on the device, made once for its key (the context's cache of tables).
  template <class T>
  const T* rope_table(const std::pair<int, std::string>& key, const std::function<std::vector<T>()>& make,
                      const char* what) {
    auto it = ctx_->inv_freq.find(key);
    if (it != ctx_->inv_freq.end()) return static_cast<const T*>(it->second.get());
    if (ctx_->capturing || ctx_->replay) throw InternalError(std::string("rope: ") + what + " created inside a captured step");
    const std::vector<T> t = make();
    void* p = nullptr;
    KV_CUDA(cudaMalloc(&p, t.size() * sizeof(T)), what);
    std::shared_ptr<void> mem(p, [](void* q) { cudaFree(q); });
    ctx_->upload(p, t.data(), static_cast<int64_t>(t.size() * sizeof(T)), what);
    ctx_->sync(what);
    ctx_->inv_freq[key] = mem;
    return static_cast<const T*>(p);
  }
  // The inverse frequencies (the table kernels/cpu uses, core/rope.h).
  const float* inv_freq(int D, const Rope& rope) {
    return rope_table<float>({D, rope.key()}, [&] { return rope.inv_freq(D); }, "rope table");
  }

  // The position row of each frequency of a sectioned rope (Rope::row_of), kept beside the tables.
  const int32_t* rope_rows(int D, const Rope& rope) {
    return rope_table<int32_t>({D, "rows/" + rope.key()}, [&] {
      const std::vector<int> r = rope.row_of(D);
      return std::vector<int32_t>(r.begin(), r.end());
    }, "rope sections");
  }

  // NonFiniteError for the first of `names` whose check word (first bad index << 32 | value bits)
  // was written.
  static void raise_failed_check(const std::vector<std::string>& names, const unsigned long long* v) {
    for (size_t i = 0; i < names.size(); ++i) {
      if (v[i] == ~0ull) continue;
      const uint32_t bits = static_cast<uint32_t>(v[i] & 0xffffffffu);
      float x;
      std::memcpy(&x, &bits, 4);
      // The message core/tensor.h's check_finite gives on the host.
      throw NonFiniteError(names[i] + " is not finite (value " + std::to_string(x) + " at index " +
                           std::to_string(v[i] >> 32) +
                           "): the checkpoint's weights hold NaN or Inf, or the activations overflow");
    }
  }

  // Readbacks of chained decode steps: at most two in flight (the step the host waits for and
  // the one launched ahead), finished in ticket order.
  struct Readback {
    std::shared_ptr<void> host;  // pinned
    int64_t cap = 0, n_logits = 0;
    std::shared_ptr<CUevent_st> done;
    std::vector<std::string> names;
    int ticket = -1;  // -1: free
  };
  static constexpr int kReadbacks = 2;
  Readback rb_[kReadbacks];
  int tickets_ = 0, finished_ = 0;

  static constexpr int64_t kChecks = 4096;
  std::shared_ptr<Context> ctx_;
  Profiler prof_;
  DevMem checks_;
  std::vector<std::string> check_names_;
  bool fp32_as_fp16_ = false;
  bool have_mdt_ = false;
  Dt mdt_ = Dt::F32;
};

}  // namespace

std::string unavailable_reason(int device) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no usable CUDA device (") + cudaGetErrorString(e) + ")";
  }
  if (n == 0) return "no CUDA device";
  if (device < 0 || device >= n)
    return "CUDA device " + std::to_string(device) + " does not exist (" + std::to_string(n) + " present)";
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess) return "cannot query CUDA device " + std::to_string(device);
  if (p.major < 8)
    return std::string(p.name) + " is compute capability " + std::to_string(p.major) + "." + std::to_string(p.minor) +
           "; kvlens's kernels need 8.0 or newer";
  return "";
}

std::shared_ptr<Backend> make_backend(const BackendOptions& opt) {
  auto ctx = std::make_shared<Context>(opt.device);
  return std::make_shared<CudaBackend>(ctx, opt.fp32_as_fp16);
}

}  // namespace kvlens::cuda
