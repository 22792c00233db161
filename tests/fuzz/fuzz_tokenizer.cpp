// libFuzzer harness: text → byte-level BPE ids → text, through the Llama-3-style tokenizer.json
// fixture (no normalizer, so valid UTF-8 comes back byte for byte) and the Qwen2-style one (NFC).
// Text that is not UTF-8 may only ever throw InputError; every id is in the vocabulary.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/errors.h"
#include "core/json_file.h"
#include "models/bpe_tokenizer.h"

namespace {

const kvlens::ByteLevelBpe& tokenizer(const char* name) {
  static const kvlens::ByteLevelBpe llama = kvlens::ByteLevelBpe::from_json(
      kvlens::read_json_file(KVLENS_SOURCE_DIR "/tests/fixtures/tokenizers/llama3_style/tokenizer.json", "tokenizer"), "llama3");
  static const kvlens::ByteLevelBpe qwen = kvlens::ByteLevelBpe::from_json(
      kvlens::read_json_file(KVLENS_SOURCE_DIR "/tests/fixtures/tokenizers/qwen2_style/tokenizer.json", "tokenizer"), "qwen2");
  return std::string(name) == "llama" ? llama : qwen;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (const char* name : {"llama", "qwen"}) {
    const kvlens::ByteLevelBpe& t = tokenizer(name);
    try {
      const std::vector<int> ids = t.encode(text);
      for (int id : ids)
        if (id < 0 || id >= t.vocab_size()) __builtin_trap();
      // Without a normalizer the ids spell the text exactly (special tokens included).
      if (std::string(name) == "llama" && t.decode(ids, false) != text) __builtin_trap();
    } catch (const kvlens::InputError&) {
    }
  }
  return 0;
}
