// Byte-level BPE tokenizers as HF `tokenizers` writes them to tokenizer.json (GPT-2, Llama-3,
// Qwen2 and the VLMs built on them): added tokens split out first (longest match), an optional
// NFC normalizer, the pre-tokenizer's regex splits (PCRE2, the pattern as the file gives it, or
// GPT-2's for ByteLevel with use_regex), the bytes of each piece mapped to GPT-2's printable
// characters, then the merges by rank (a piece already in the vocabulary stays whole where the
// model sets ignore_merges). Decoding maps the characters back to bytes.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/added_tokens.h"

namespace kvlens {

class ByteLevelBpe {
 public:
  // Whether this build normalizes text to NFC (ICU). Without it, a tokenizer.json that asks for
  // NFC encodes ASCII text and refuses other text, saying so.
  static bool nfc_available();
  // `j`: tokenizer.json's object; `where` names the file in messages. Throws InputError for a
  // model, normalizer or pre-tokenizer kvlens does not read, naming it.
  static ByteLevelBpe from_json(const nlohmann::json& j, const std::string& where);
  ByteLevelBpe();
  ~ByteLevelBpe();
  ByteLevelBpe(ByteLevelBpe&&) noexcept;
  ByteLevelBpe& operator=(ByteLevelBpe&&) noexcept;

  std::vector<int> encode(const std::string& text) const;  // no BOS
  std::string decode(const std::vector<int>& ids, bool skip_special) const;
  std::string piece(int id) const;  // the token's text in the vocabulary ("" when none)
  int id_of(const std::string& token) const;  // -1 when absent
  bool is_special(int id) const;
  int vocab_size() const;  // one past the largest id
  // The first token the post-processor puts before a sequence (TemplateProcessing; -1: none).
  int template_bos() const { return template_bos_; }

 private:
  struct Regex;
  std::vector<int> encode_piece(const std::string& bytes_as_chars) const;
  std::vector<int> encode_text(const std::string& text) const;  // no added tokens inside

  std::unordered_map<std::string, int> vocab_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<std::string, int> merge_rank_;  // "left right" → rank
  bool ignore_merges_ = false;
  bool nfc_ = false;
  bool add_prefix_space_ = false;
  std::vector<std::shared_ptr<const Regex>> splits_;  // applied in order (Isolated)
  std::vector<AddedToken> added_;  // longest first
  std::vector<bool> special_;
  int template_bos_ = -1;
};

}  // namespace kvlens
