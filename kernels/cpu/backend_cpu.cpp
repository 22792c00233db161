#include "kernels/cpu/backend_cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/errors.h"
#include "core/tensor.h"
#include "core/half.h"
#include "core/team.h"
#include "kernels/cpu/ops.h"

namespace kvlens {

namespace {

float bf16_to_float(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// Checkpoint values of any supported dtype as fp32.
void to_f32(const HostTensor& t, float* out) {
  const int64_t n = t.numel();
  switch (t.dt) {
    case Dt::F32: std::memcpy(out, t.data, static_cast<size_t>(n) * 4); break;
    case Dt::F16:
    case Dt::BF16: {
      // Checkpoint data need not be 2-byte aligned: read each value with memcpy.
      const auto* p = static_cast<const unsigned char*>(t.data);
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = t.dt == Dt::F16 ? from_half(h) : bf16_to_float(h);
      }
      break;
    }
    case Dt::I32: throw InternalError(t.name + ": an integer tensor is not a weight");
  }
}

void need(bool ok, const std::string& what) {
  if (!ok) throw InternalError("cpu backend: " + what);
}

void need_f32(const Buffer& b, const char* op) {
  need(b.dt == Dt::F32, std::string(op) + ": " + b.name + " must be f32, is " + dt_name(b.dt));
}

class CpuBackend : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  std::string device() const override { return "CPU (fp32, OpenBLAS)"; }
  bool supports(Op op) const override { return op != Op::PackedKV && op != Op::Count; }

  Buffer alloc(const std::string& name, std::vector<int64_t> shape, Dt dt) override {
    Buffer b;
    b.name = name;
    b.shape = std::move(shape);
    b.dt = dt;
    need(dt == Dt::F32 || dt == Dt::I32, name + ": the CPU backend keeps f32 and i32 buffers only");
    const int64_t n = std::max<int64_t>(b.numel(), 1);
    std::shared_ptr<float> mem(new float[static_cast<size_t>(n)](), std::default_delete<float[]>());
    b.data = mem.get();
    b.hold = mem;
    return b;
  }
  void upload(const void* host, Buffer& dst) override {
    if (dst.numel()) std::memcpy(dst.data, host, static_cast<size_t>(dst.bytes()));
  }
  void download(const Buffer& src, void* host) override {
    if (src.numel()) std::memcpy(host, src.data, static_cast<size_t>(src.bytes()));
  }
  Buffer matrix(const std::string& name, const std::vector<HostTensor>& parts) override {
    need(!parts.empty(), name + ": no parts");
    int64_t rows = 0;
    const int64_t cols = parts[0].shape.size() == 2 ? parts[0].shape[1] : parts[0].numel() / parts[0].shape[0];
    for (const HostTensor& p : parts) rows += p.shape[0];
    Buffer b = alloc(name, {rows, cols}, Dt::F32);
    float* at = b.as<float>();
    for (const HostTensor& p : parts) {
      need(p.numel() == p.shape[0] * cols, name + ": parts differ in columns");
      to_f32(p, at);
      at += p.numel();
    }
    return b;
  }
  Buffer vector(const HostTensor& t) override {
    Buffer b = alloc(t.name, t.shape, Dt::F32);
    to_f32(t, b.as<float>());
    return b;
  }

  double copy_bandwidth() override {
    const size_t n = size_t{256} << 20;
    std::vector<char> a(n, 1), b(n, 0);
    std::vector<double> t;
    for (int i = 0; i < 7; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      std::memcpy(b.data(), a.data(), n);
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      a[i] = b[n - 1 - i];  // keep the copies observable
    }
    std::sort(t.begin(), t.end());
    return 2.0 * n / t[t.size() / 2];
  }

  void linear(const Buffer& x, const Buffer& W, const Buffer* bias, Buffer& y, bool accumulate) override {
    need_f32(x, "linear");
    need_f32(y, "linear");
    const int M = static_cast<int>(x.rows()), K = static_cast<int>(x.cols()), N = static_cast<int>(W.rows());
    need(W.cols() == K && y.rows() == M && y.cols() == N,
         "linear: " + x.name + x.shape_str() + " · " + W.name + W.shape_str() + "ᵀ → " + y.name + y.shape_str());
    if (!accumulate) {
      cpu::linear(x.as<float>(), M, K, W.as<float>(), N, bias ? bias->as<float>() : nullptr, y.as<float>());
      return;
    }
    std::vector<float> t(static_cast<size_t>(M) * N);
    cpu::linear(x.as<float>(), M, K, W.as<float>(), N, bias ? bias->as<float>() : nullptr, t.data());
    cpu::add(y.as<float>(), t.data(), static_cast<int64_t>(M) * N);
  }
  void rms_norm(const Buffer& x, const Buffer& g, float eps, Buffer& y) override {
    need(x.numel() == y.numel() && g.numel() == x.cols(), "rms_norm: " + x.name + " / " + y.name);
    cpu::rms_norm(x.as<float>(), y.as<float>(), static_cast<int>(x.rows()), static_cast<int>(x.cols()),
                  g.as<float>(), eps);
  }
  void layer_norm(const Buffer& x, const Buffer& g, const Buffer* b, float eps, Buffer& y) override {
    need(x.numel() == y.numel() && g.numel() == x.cols(), "layer_norm: " + x.name + " / " + y.name);
    cpu::layer_norm(x.as<float>(), y.as<float>(), static_cast<int>(x.rows()), static_cast<int>(x.cols()),
                    g.as<float>(), b ? b->as<float>() : nullptr, eps);
  }
  void check_finite(const Buffer& x, const std::string& tensor) override {
    need_f32(x, "check_finite");
    kvlens::check_finite(x.as<float>(), x.numel(), tensor);
  }
  void add(Buffer& x, const Buffer& y) override {
    need(x.numel() == y.numel(), "add: " + x.name + x.shape_str() + " + " + y.name + y.shape_str());
    cpu::add(x.as<float>(), y.as<float>(), x.numel());
  }
  void bias_act(const Buffer& y, const Buffer* bias, Act act, bool apply_act, Buffer& out) override {
    need(y.numel() == out.numel(), "bias_act: " + y.name + " / " + out.name);
    float* o = out.as<float>();
    if (o != y.as<float>()) std::memcpy(o, y.data, static_cast<size_t>(y.bytes()));
    if (bias) {
      const int64_t N = y.cols();
      for (int64_t m = 0; m < y.rows(); ++m) cpu::add(o + m * N, bias->as<float>(), N);
    }
    if (apply_act) cpu::activate(o, out.numel(), act);
  }
  void gated_act(const Buffer& gu, Act act, Buffer& out) override {
    const int64_t M = gu.rows(), I = gu.cols() / 2;
    need(out.rows() == M && out.cols() == I, "gated_act: " + gu.name + " / " + out.name);
    for (int64_t m = 0; m < M; ++m) {
      float* o = out.as<float>() + m * I;
      const float* g = gu.as<float>() + m * 2 * I;
      std::memcpy(o, g, static_cast<size_t>(I) * 4);
      cpu::activate(o, I, act);
      cpu::mul(o, g + I, I);
    }
  }
  void rope(Buffer& qkv, const AttnLayout& l, const Buffer& pos, const Rope& rope) override {
    const std::vector<float> inv = rope.inv_freq(l.head_dim);
    const int32_t* p = pos.as<int32_t>();
    // One row of positions, or one per section ([rows][T]).
    const bool sectioned = rope.sectioned(pos.numel(), l.T);
    need(pos.dt == Dt::I32 && (sectioned || pos.numel() >= l.T), "rope: positions of " + qkv.name);
    const std::vector<int> rows = sectioned ? rope.row_of(l.head_dim) : std::vector<int>();
    const int* row_of = sectioned ? rows.data() : nullptr;
    for (int t = 0; t < l.T; ++t) {
      float* row = qkv.as<float>() + static_cast<int64_t>(t) * l.row_stride;
      cpu::rope(row + l.q_col, 1, l.n_heads, l.head_dim, p + t, inv.data(), row_of, l.T);
      cpu::rope(row + l.k_col, 1, l.n_kv_heads, l.head_dim, p + t, inv.data(), row_of, l.T);
    }
  }
  void embed(const Buffer& table, const Buffer& ids, Buffer& out) override {
    const int64_t H = table.cols();
    need(out.cols() == H && out.rows() == ids.numel(), "embed: " + out.name);
    for (int64_t i = 0; i < ids.numel(); ++i) {
      const int32_t id = ids.as<int32_t>()[i];
      need(id >= 0 && id < table.rows(), "embed: id out of range");
      std::memcpy(out.as<float>() + i * H, table.as<float>() + id * H, static_cast<size_t>(H) * 4);
    }
  }
  void copy_block(const Buffer& src, int64_t sr, int64_t sc, Buffer& dst, int64_t dr, int64_t dc, int64_t n,
                  int64_t cols) override {
    need(src.dt == dst.dt && sr + n <= src.rows() && sc + cols <= src.cols() && dr + n <= dst.rows() &&
             dc + cols <= dst.cols(),
         "copy_block: " + src.name + " → " + dst.name + " out of range or of another dtype");
    const int64_t e = dt_size(src.dt);
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(dst.as<char>() + ((dr + i) * dst.cols() + dc) * e, src.as<char>() + ((sr + i) * src.cols() + sc) * e,
                  static_cast<size_t>(cols * e));
  }

  void attention(const Buffer& qkv, const AttnLayout& l, Buffer& out, float* scores, float* probs) override {
    const int T = l.T, NH = l.n_heads, D = l.head_dim, G = NH / l.n_kv_heads;
    std::vector<int32_t> pos(T);
    for (int t = 0; t < T; ++t) pos[t] = t;
    const float* base = qkv.as<float>();
    // Each head's queries in blocks of kAttnRows: a prompt gives every thread work even where the
    // heads are few (4 for kvlens-scenes-14m's decoder).
    const int blocks = (T + cpu::kAttnRows - 1) / cpu::kAttnRows;
    team_each(NH * blocks, cpu::head_threads(NH * blocks, T / blocks, T, D), [&](int64_t item) {
      const int hd = static_cast<int>(item / blocks), i0 = static_cast<int>(item % blocks) * cpu::kAttnRows;
      const int kv = hd / G;
      cpu::AttnHeadArgs a;
      a.q = base + l.q_col + hd * D; a.q_stride = l.row_stride;
      a.k = base + l.k_col + kv * D; a.v = base + l.v_col + kv * D; a.kv_stride = l.row_stride;
      a.out = out.as<float>() + hd * D; a.o_stride = static_cast<int64_t>(NH) * D;
      a.Tq = T; a.Tk = T; a.D = D; a.scale = l.scale;
      if (l.causal) {
        a.query_pos = pos.data();
        a.key_pos = pos.data();
      }
      if (scores) a.scores = scores + static_cast<size_t>(hd) * T * T;
      if (probs) a.probs = probs + static_cast<size_t>(hd) * T * T;
      cpu::attention_rows(a, i0, std::min(cpu::kAttnRows, T - i0));
    });
  }

  void kv_append(SeqKV& kv, int layer, const Buffer& qkv, const AttnLayout& l, const Buffer& pos,
                 const int32_t* pos_host, const SegmentKind* kinds, int T) override {
    const int KD = l.n_kv_heads * l.head_dim;
    std::vector<float> k(static_cast<size_t>(T) * KD), v(k.size());
    for (int t = 0; t < T; ++t) {
      const float* row = qkv.as<float>() + static_cast<int64_t>(t) * l.row_stride;
      std::memcpy(k.data() + static_cast<size_t>(t) * KD, row + l.k_col, static_cast<size_t>(KD) * 4);
      std::memcpy(v.data() + static_cast<size_t>(t) * KD, row + l.v_col, static_cast<size_t>(KD) * 4);
    }
    kv.host->append(layer, k.data(), v.data(), pos_host, kinds, T);
  }

  void decode_attention(const Buffer& qkv, const AttnLayout& l, SeqKV& kv, int layer, const ScoreTransform* transform,
                        Buffer& out, const DecodeTaps& taps) override {
    const int NH = l.n_heads, NKV = l.n_kv_heads, D = l.head_dim, G = NH / NKV;
    const bool transforms = transform && transform->any();
    // The rows in place, segment by segment (a step reads them, copying none).
    std::vector<std::vector<KVStore::RowSpan>> R(NKV);
    std::vector<std::vector<SegmentKind>> S(NKV);  // row kinds, for the score transform
    std::vector<int> N(NKV, 0);
    int n_all = 0;
    for (int h = 0; h < NKV; ++h) {
      R[h] = kv.host->spans(layer, h);
      for (const KVStore::RowSpan& r : R[h]) {
        N[h] += r.n;
        if (transforms) S[h].insert(S[h].end(), r.n, r.kind);
      }
      n_all = std::max(n_all, N[h]);
    }
    const int n_max = taps.n_max;
    if (taps.rows() && n_max < n_all) throw InternalError("decode_attention: n_max below the rows held");
    const float ninf = -std::numeric_limits<float>::infinity();
    const float* q = qkv.as<float>() + l.q_col;
    team_each(NH, cpu::head_threads(NH, 1, n_all, D), [&](int64_t head) {
      const int hd = static_cast<int>(head), h = hd / G, n = N[h];
      std::vector<float> s(n);
      const float* qh = q + hd * D;
      int j = 0;
      for (const KVStore::RowSpan& r : R[h])
        for (int i = 0; i < r.n; ++i, ++j) {
          const float* kj = r.k + static_cast<size_t>(i) * D;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < D; ++d) dot += qh[d] * kj[d];
          s[j] = dot * l.scale;
        }
      auto tap = [&](float* t, float pad) {
        if (!t) return;
        std::copy(s.begin(), s.end(), t + static_cast<size_t>(hd) * n_max);
        std::fill(t + static_cast<size_t>(hd) * n_max + n, t + static_cast<size_t>(hd + 1) * n_max, pad);
      };
      tap(taps.raw_scores, ninf);
      if (transforms) transform->apply(layer, hd, s.data(), S[h].data(), n);
      tap(taps.scores, ninf);
      cpu::softmax_rows(s.data(), 1, n);
      tap(taps.probs, 0.0f);
      float* o = out.as<float>() + hd * D;
      std::fill(o, o + D, 0.0f);
      j = 0;
      for (const KVStore::RowSpan& r : R[h])
        for (int i = 0; i < r.n; ++i, ++j) {
          const float* vj = r.v + static_cast<size_t>(i) * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) o[d] += s[j] * vj[d];
        }
      if (taps.out) std::copy(o, o + D, taps.out + static_cast<size_t>(hd) * D);
    });
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace kvlens
