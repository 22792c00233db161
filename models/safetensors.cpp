#include "models/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/json_file.h"

namespace kvlens {

namespace {

struct DTypeEntry { const char* name; DType dt; int size; };
constexpr DTypeEntry kDTypes[] = {
    {"F32", DType::F32, 4},   {"F16", DType::F16, 2},   {"BF16", DType::BF16, 2},
    {"F64", DType::F64, 8},   {"I8", DType::I8, 1},     {"U8", DType::U8, 1},
    {"I16", DType::I16, 2},   {"U16", DType::U16, 2},   {"I32", DType::I32, 4},
    {"U32", DType::U32, 4},   {"I64", DType::I64, 8},   {"U64", DType::U64, 8},
    {"BOOL", DType::BOOL, 1}, {"F8_E4M3", DType::F8_E4M3, 1}, {"F8_E5M2", DType::F8_E5M2, 1},
};

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

}  // namespace

const char* dtype_name(DType d) {
  for (const auto& e : kDTypes)
    if (e.dt == d) return e.name;
  return "?";
}

int dtype_size(DType d) {
  for (const auto& e : kDTypes)
    if (e.dt == d) return e.size;
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = open_input_file(path, "safetensors file", &size_);
  if (size_ < 8) {
    ::close(fd);
    parse_safetensors(nullptr, size_, path);  // throws: too short for the header length
  }
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw InputError(path + ": cannot memory-map file");
  }
  try {
    parse_header();
  } catch (...) {
    ::munmap(map_, size_);  // the destructor does not run when the constructor throws
    map_ = nullptr;
    throw;
  }
}

void SafetensorsFile::parse_header() {
  tensors_ = parse_safetensors(static_cast<const uint8_t*>(map_), size_, path_);
}

std::map<std::string, TensorView> parse_safetensors(const uint8_t* base, uint64_t size_, const std::string& path) {
  std::map<std::string, TensorView> tensors_;
  if (size_ < 8)
    throw InputError(path + ": truncated safetensors file (" + std::to_string(size_) +
                     " bytes, expected at least the 8-byte header length)");
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= static_cast<uint64_t>(base[i]) << (8 * i);
  if (hlen > kMaxSafetensorsHeader)
    throw InputError(path + ": header length " + std::to_string(hlen) + " exceeds the " +
                     std::to_string(kMaxSafetensorsHeader) + "-byte cap");
  if (hlen > size_ - 8)
    throw InputError(path + ": header length " + std::to_string(hlen) +
                     " is larger than the file (" + std::to_string(size_) + " bytes): truncated?");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(base + 8, base + 8 + hlen);
  } catch (const std::exception& e) {
    throw InputError(path + ": header is not valid JSON (" + e.what() + ")");
  }
  if (!header.is_object()) throw InputError(path + ": header is not a JSON object");
  const uint64_t data_start = 8 + hlen;
  const uint64_t data_size = size_ - data_start;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const auto& e = it.value();
    const std::string where = path + ": tensor '" + name + "'";
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") ||
        !e.contains("data_offsets"))
      throw InputError(where + ": entry needs dtype, shape and data_offsets");
    TensorView v;
    v.name = name;
    v.file = path;
    const std::string ds = e["dtype"].is_string() ? e["dtype"].get<std::string>() : "";
    bool known = false;
    for (const auto& d : kDTypes)
      if (ds == d.name) {
        v.dtype = d.dt;
        known = true;
      }
    if (!known) throw InputError(where + ": unknown dtype '" + ds + "'");
    if (!e["shape"].is_array()) throw InputError(where + ": shape is not a list");
    for (const auto& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        throw InputError(where + ": shape has a non-integer or negative dimension");
      v.shape.push_back(d.get<int64_t>());
    }
    const auto& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned())
      throw InputError(where + ": data_offsets must be two non-negative integers");
    const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    if (b > en) throw InputError(where + ": data_offsets begin > end");
    if (en > data_size)
      throw InputError(where + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(en) +
                       ") reach past the end of the file (data section is " +
                       std::to_string(data_size) + " bytes): truncated?");
    v.nbytes = en - b;
    // A hostile shape can make numel() (and numel × dtype size) overflow int64 and wrap to a
    // size that matches the offsets: check the product before multiplying. A zero dimension
    // makes the tensor empty whatever the others are. (A product that fits but disagrees with
    // the offsets is caught just below.)
    const uint64_t max_elems = static_cast<uint64_t>(INT64_MAX) / static_cast<uint64_t>(dtype_size(v.dtype));
    if (std::find(v.shape.begin(), v.shape.end(), int64_t{0}) == v.shape.end()) {
      uint64_t elems = 1;
      for (int64_t d : v.shape) {
        const uint64_t du = static_cast<uint64_t>(d);
        if (elems > max_elems / du)
          throw InputError(where + ": shape " + shape_str(v.shape) + " × " + dtype_name(v.dtype) +
                           " overflows 64-bit byte counts (data section is " +
                           std::to_string(data_size) + " bytes)");
        elems *= du;
      }
    }
    const uint64_t want = static_cast<uint64_t>(v.numel()) * dtype_size(v.dtype);
    if (want != v.nbytes)
      throw InputError(where + ": shape " + shape_str(v.shape) + " × " + dtype_name(v.dtype) +
                       " needs " + std::to_string(want) + " bytes, data_offsets give " +
                       std::to_string(v.nbytes));
    v.data = base + data_start + b;
    if (v.nbytes > 0) ranges.push_back({b, en});
    tensors_[name] = std::move(v);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second)
      throw InputError(path + ": tensor byte ranges overlap at offset " +
                       std::to_string(ranges[i].first));
  return tensors_;
}

std::map<std::string, std::string> parse_shard_index(const nlohmann::json& j, const std::string& index) {
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw InputError(index + ": missing 'weight_map' object");
  std::map<std::string, std::string> shard_of;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string())
      throw InputError(index + ": shard of tensor '" + it.key() + "' is not a file name");
    const std::string shard = it.value().get<std::string>();
    // Shards sit beside the index: a plain file name, never a path out of the folder.
    if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
        shard.find('\0') != std::string::npos)
      throw InputError(index + ": shard of tensor '" + it.key() + "' must be a file name in the model folder, got '" +
                       shard + "'");
    shard_of[it.key()] = shard;
  }
  return shard_of;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, size_);
}

void SafetensorsFile::release() const {
  // A private read-only file mapping holds no page of its own: dropping them loses nothing.
  if (map_) ::madvise(map_, size_, MADV_DONTNEED);
}

void WeightStore::release() const {
  for (const auto& f : files_) f->release();
}

WeightStore WeightStore::open_dir(const std::string& dir) {
  WeightStore ws;
  ws.dir_ = dir;
  const std::string single = dir + "/model.safetensors";
  const std::string index = dir + "/model.safetensors.index.json";
  if (file_exists(index)) {
    const std::map<std::string, std::string> shard_of = parse_shard_index(read_json_file(index, "shard index"), index);
    std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;
    for (const auto& [tensor, shard] : shard_of) {
      if (!shards.count(shard)) {
        const std::string p = dir + "/" + shard;
        if (!file_exists(p))
          throw InputError(index + ": shard '" + shard + "' (for tensor '" + tensor +
                           "') is missing");
        shards[shard] = std::make_shared<SafetensorsFile>(p);
      }
      const auto& tensors = shards[shard]->tensors();
      auto t = tensors.find(tensor);
      if (t == tensors.end())
        throw InputError(index + ": tensor '" + tensor + "' is not in shard '" + shard + "'");
      ws.index_[tensor] = &t->second;
    }
    for (auto& kv : shards) ws.files_.push_back(kv.second);
  } else if (file_exists(single)) {
    auto f = std::make_shared<SafetensorsFile>(single);
    for (const auto& kv : f->tensors()) ws.index_[kv.first] = &kv.second;
    ws.files_.push_back(f);
  } else {
    throw InputError(dir + ": no model.safetensors or model.safetensors.index.json");
  }
  return ws;
}

const TensorView& WeightStore::view(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) throw InputError(dir_ + ": checkpoint has no tensor '" + name + "'");
  return *it->second;
}

Tensor WeightStore::load(const std::string& name, const std::vector<int64_t>& shape) const {
  const TensorView& v = view(name);
  if (!shape.empty() && shape != v.shape)
    throw InputError(v.file + ": tensor '" + name + "' has shape " + shape_str(v.shape) +
                     ", the config needs " + shape_str(shape));
  Tensor t(name, v.shape);
  const int64_t n = v.numel();
  float* out = t.ptr();
  switch (v.dtype) {
    case DType::F32: std::memcpy(out, v.data, n * 4); break;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, v.data + 2 * i, 2);
        out[i] = half_to_float(h);
      }
      break;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, v.data + 2 * i, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(out + i, &bits, 4);
      }
      break;
    default:
      throw InputError(v.file + ": tensor '" + name + "' has dtype " + dtype_name(v.dtype) +
                       "; kvlens computes from F32, F16 or BF16 weights");
  }
  return t;
}

HostTensor WeightStore::host(const std::string& name, const std::vector<int64_t>& shape) const {
  const TensorView& v = view(name);
  if (!shape.empty() && shape != v.shape)
    throw InputError(v.file + ": tensor '" + name + "' has shape " + shape_str(v.shape) +
                     ", the config needs " + shape_str(shape));
  HostTensor t;
  t.name = name;
  t.shape = v.shape;
  t.data = v.data;
  switch (v.dtype) {
    case DType::F32: t.dt = Dt::F32; break;
    case DType::F16: t.dt = Dt::F16; break;
    case DType::BF16: t.dt = Dt::BF16; break;
    default:
      throw InputError(v.file + ": tensor '" + name + "' has dtype " + dtype_name(v.dtype) +
                       "; kvlens computes from F32, F16 or BF16 weights");
  }
  return t;
}

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> r;
  for (const auto& kv : index_) r.push_back(kv.first);
  return r;
}

}  // namespace kvlens
