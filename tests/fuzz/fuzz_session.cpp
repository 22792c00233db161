// libFuzzer harness: session JSON → session. Bad input may only ever throw InputError; an
// accepted session saves and reads back to the same session.
#include <cstddef>
#include <cstdint>

#include "core/errors.h"
#include "app/lab/session.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, false);
  if (j.is_discarded()) return 0;
  try {
    const kvlens::Session s = kvlens::session_from_json(j, "fuzz.json");
    const kvlens::Session back = kvlens::session_from_json(kvlens::session_to_json(s), "round trip");
    if (back.methods.size() != s.methods.size()) __builtin_trap();
    for (size_t i = 0; i < s.methods.size(); ++i)
      if (back.methods[i].spec() != s.methods[i].spec()) __builtin_trap();
  } catch (const kvlens::InputError&) {
  }
  return 0;
}
