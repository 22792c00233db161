// libFuzzer harness: method spec text → validated parameters → policy. Bad input may only ever
// throw InputError; accepted parameters read back from their canonical spec unchanged.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/errors.h"
#include "core/compress/method.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string spec(reinterpret_cast<const char*>(data), size);
  try {
    const kvlens::Params p = kvlens::parse_method_spec(spec);
    if (kvlens::parse_method_spec(p.spec()).values() != p.values()) __builtin_trap();
    if (kvlens::parse_method_spec(p.short_spec()).values() != p.values()) __builtin_trap();
    if (!kvlens::make_policy(p)) __builtin_trap();
  } catch (const kvlens::InputError&) {
  }
  return 0;
}
