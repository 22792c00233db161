// libFuzzer harness: safetensors bytes → header validation, and the same bytes read as a
// model.safetensors.index.json → shard map. Bad input may only ever throw InputError.
#include <cstddef>
#include <cstdint>

#include "core/errors.h"
#include "models/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto tensors = kvlens::parse_safetensors(data, size, "fuzz.safetensors");
    for (const auto& [name, v] : tensors) {
      // Every view the parser hands out lies inside the input.
      if (v.nbytes > 0 && (v.data < data || v.data + v.nbytes > data + size)) __builtin_trap();
    }
  } catch (const kvlens::InputError&) {
  }
  const nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, false);
  if (!j.is_discarded()) {
    try {
      for (const auto& [tensor, shard] : kvlens::parse_shard_index(j, "fuzz.index.json"))
        if (shard.find('/') != std::string::npos) __builtin_trap();
    } catch (const kvlens::InputError&) {
    }
  }
  return 0;
}
