// libFuzzer harness: a checkpoint's chat template (any text) rendered for one user turn. Bad
// templates may only ever throw InputError; nothing renders without bounds.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/errors.h"
#include "models/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string tmpl(reinterpret_cast<const char*>(data), size);
  static const nlohmann::ordered_json ctx = {
      {"messages", {{{"role", "user"}, {"content", {{{"type", "image"}}, {{"type", "text"}, {"text", "{prompt}"}}}}}}},
      {"add_generation_prompt", true}, {"bos_token", "<s>"}, {"eos_token", "</s>"}, {"tools", nullptr}};
  try {
    const std::string out = kvlens::render_chat_template(tmpl, ctx, "fuzz");
    if (out.size() > (size_t{1} << 25)) __builtin_trap();
  } catch (const kvlens::InputError&) {
  }
  return 0;
}
