// Memory-mapped safetensors checkpoints: one file, or shards listed by
// model.safetensors.index.json. Every header is validated on open (length cap, JSON, dtype,
// shape × dtype size = byte range, ranges inside the file and not overlapping).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/backend.h"
#include "core/tensor.h"

namespace kvlens {

enum class DType { F32, F16, BF16, F64, I8, U8, I16, U16, I32, U32, I64, U64, BOOL, F8_E4M3, F8_E5M2 };
const char* dtype_name(DType d);
int dtype_size(DType d);

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  uint64_t nbytes = 0;
  std::string file;
  int64_t numel() const;
};

// Largest header accepted (the reference implementation uses the same cap).
constexpr uint64_t kMaxSafetensorsHeader = 100ULL * 1024 * 1024;

// Validates a safetensors file's bytes (header length, JSON, dtypes, shapes against byte
// ranges, ranges inside the data and not overlapping) and returns its tensors, pointing into
// `base`. `path` names the file in messages. SafetensorsFile maps a file and calls this.
std::map<std::string, TensorView> parse_safetensors(const uint8_t* base, uint64_t size, const std::string& path);

// model.safetensors.index.json: tensor name → shard file name (a plain name in the folder).
std::map<std::string, std::string> parse_shard_index(const nlohmann::json& index, const std::string& path);

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // throws InputError naming the file
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::string& path() const { return path_; }
  // Hands the pages of the mapping this process has read back to the system: the tensors stay
  // readable (a page touched again is read again from the file), but a loader that copied them
  // elsewhere (a device) no longer holds them resident as well.
  void release() const;

 private:
  void parse_header();

  std::string path_;
  void* map_ = nullptr;
  uint64_t size_ = 0;
  std::map<std::string, TensorView> tensors_;
};

// All tensors of a model directory, from model.safetensors or from the shards named in
// model.safetensors.index.json.
class WeightStore {
 public:
  static WeightStore open_dir(const std::string& dir);
  bool has(const std::string& name) const { return index_.count(name) > 0; }
  const TensorView& view(const std::string& name) const;
  // Converts to fp32. When `shape` is not empty, it must match the stored shape.
  Tensor load(const std::string& name, const std::vector<int64_t>& shape = {}) const;
  // The stored bytes (F32, F16 or BF16) for a backend to upload, shape checked as by load().
  // The view lives as long as this store.
  HostTensor host(const std::string& name, const std::vector<int64_t>& shape = {}) const;
  std::vector<std::string> names() const;
  const std::string& dir() const { return dir_; }
  // SafetensorsFile::release for every file: a loader calls it once a layer's weights are
  // uploaded, so the checkpoint is never resident in host memory as a whole.
  void release() const;

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

}  // namespace kvlens
