#include "core/backend.h"

#include "core/errors.h"

namespace kvlens {

int dt_size(Dt d) {
  switch (d) {
    case Dt::F32: return 4;
    case Dt::F16: return 2;
    case Dt::BF16: return 2;
    case Dt::I32: return 4;
  }
  return 0;
}

const char* dt_name(Dt d) {
  switch (d) {
    case Dt::F32: return "f32";
    case Dt::F16: return "f16";
    case Dt::BF16: return "bf16";
    case Dt::I32: return "i32";
  }
  return "?";
}

int64_t Buffer::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return shape.empty() ? 0 : n;
}

std::string Buffer::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

Buffer Buffer::row_view(int64_t r0, int64_t n) const {
  if (shape.empty() || r0 < 0 || n < 0 || r0 + n > shape[0])
    throw InternalError(name + " " + shape_str() + ": rows [" + std::to_string(r0) + ", " +
                        std::to_string(r0 + n) + ") are out of range");
  Buffer v = *this;
  const int64_t row_bytes = rows() ? bytes() / rows() : 0;
  v.data = static_cast<char*>(data) + r0 * row_bytes;
  v.shape[0] = n;
  v.name = name + "[" + std::to_string(r0) + ":" + std::to_string(r0 + n) + "]";
  return v;
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const char* op_name(Op op) {
  switch (op) {
    case Op::Linear: return "linear";
    case Op::RmsNorm: return "rms_norm";
    case Op::LayerNorm: return "layer_norm";
    case Op::Add: return "add";
    case Op::BiasAct: return "bias_act";
    case Op::GatedAct: return "gated_act";
    case Op::Rope: return "rope";
    case Op::Embed: return "embed";
    case Op::CopyRows: return "copy_block";
    case Op::Attention: return "attention";
    case Op::KVAppend: return "kv_append";
    case Op::DecodeAttention: return "decode_attention";
    case Op::DecodeAttentionCapture: return "decode_attention_capture";
    case Op::PackedKV: return "packed_kv";
    case Op::Count: break;
  }
  return "?";
}

void Backend::next_token(const Buffer&, Buffer&, Buffer&) {
  throw InternalError("next_token: the " + name() + " backend does not chain decode steps");
}
int Backend::start_readback(const Buffer&, const Buffer&) {
  throw InternalError("start_readback: the " + name() + " backend does not chain decode steps");
}
void Backend::finish_readback(int, float*, int32_t*) {
  throw InternalError("finish_readback: the " + name() + " backend does not chain decode steps");
}

std::string parse_backend_kind(const std::string& s, const std::string& what) {
  if (s == "cpu" || s == "cuda" || s == "auto") return s;
  throw InputError(what + " must be one of cpu|cuda|auto, got '" + s + "'");
}

}  // namespace kvlens
