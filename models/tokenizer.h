// The checkpoint's tokenizer: tokenizer.model through SentencePiece, or where there is none a
// byte-level BPE tokenizer.json (models/bpe_tokenizer.h: GPT-2, Llama-3, Qwen2); then
// tokenizer_config.json (add_bos_token, bos_token, eos_token), added_tokens.json / the config's
// image_token_index for "<image>".
// Prompts are tokenized as HF transformers' processors do: each text section around "<image>" is
// encoded on its own, BOS once at the start, the image token repeated once per visual token. A
// SentencePiece tokenizer puts its "▁" before the sections as transformers (5.x) builds it from
// tokenizer_config.json: before every section with "legacy": true (as LLaVA's own
// tokenizer_image_token does, but for a section that starts with a space), before the text's
// first section only otherwise, and before none with "add_prefix_space": false; never before a
// section that starts with a space (the space is its "▁"). Like transformers, it keeps every
// space even where the model's normalizer says remove_extra_whitespaces, and it takes the text
// of a special or added token (<s>, </s>, ...) in a prompt as that token, which ends a section.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/added_tokens.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace kvlens {
class ByteLevelBpe;
}

namespace kvlens {

constexpr const char* kDefaultTemplate = "USER: <image>\n{prompt} ASSISTANT:";
constexpr const char* kDefaultPrompt = "Describe the image.";

class Tokenizer {
 public:
  // dir holds tokenizer.model (or tokenizer.json); image_token_index comes from the model config and is replaced
  // by added_tokens.json's "<image>" when that file names it. A text-only model's tokenizer
  // (with_image false) has no image token, and a template that names one is refused.
  static Tokenizer load(const std::string& dir, int image_token_index, bool with_image = true);
  Tokenizer();
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Text's ids (no BOS) as the start of a prompt: with the SentencePiece "▁" before it unless
  // "add_prefix_space" is false or the text starts with a space.
  std::vector<int> encode(const std::string& text) const;
  // A text section's ids: with the "▁" before it where the rule above says so (`first`: the
  // section starts the text; later sections, after an <image> or a marker of kvlens's own,
  // get it only with "legacy": true).
  std::vector<int> encode_section(const std::string& text, bool first) const;
  // Text of generated ids; ids outside the SentencePiece vocabulary are skipped.
  std::string decode(const std::vector<int>& ids) const;
  std::string piece(int id) const;
  // "{prompt}" in the template is replaced by prompt; "<image>" becomes n_visual image tokens.
  std::vector<int> encode_prompt(const std::string& templ, const std::string& prompt,
                                 int n_visual) const;

  int bos_id() const { return bos_; }
  int eos_id() const { return eos_; }
  int image_token_id() const { return image_token_; }
  bool add_bos() const { return add_bos_; }
  int sp_vocab_size() const;  // the tokenizer's vocabulary (SentencePiece pieces, or BPE ids)
  bool byte_level() const { return bpe_ != nullptr; }
  // Whether a prompt of this text gets the BOS id first: add_bos, unless the text already starts
  // with the BOS token's text (a chat template that writes it, as HF's processors check).
  bool needs_bos(const std::string& text) const;

  // The checkpoint's chat template (chat_template.jinja, chat_template.json, or
  // tokenizer_config.json's chat_template; "" when none), and where it came from.
  const std::string& chat_template() const { return chat_template_; }
  const std::string& chat_template_file() const { return chat_template_file_; }
  // The chat template rendered for one user turn whose text is "{prompt}" (after an image when
  // `with_image`), with the generation prompt: a template for encode_prompt. "" without one.
  std::string chat_prompt(bool with_image) const;

 private:
  void load_chat_template(const std::string& dir, const nlohmann::json& tokenizer_config);

  enum class SpacePrefix { EverySection, FirstSection, None };

  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_bare_;  // the same model without the "▁"
  SpacePrefix prefix_ = SpacePrefix::EverySection;
  // A SentencePiece tokenizer's added and special tokens by their text (BOS, EOS, UNK,
  // tokenizer_config.json's added_tokens_decoder, added_tokens.json; not <image>): found in a
  // text, they are their own ids, and the text after one is not the text's start.
  std::vector<AddedToken> sp_added_;  // longest first
  std::unique_ptr<ByteLevelBpe> bpe_;
  int bos_ = 1, eos_ = 2, image_token_ = -1;
  bool add_bos_ = true;
  std::string bos_text_, eos_text_;  // tokenizer_config.json's bos_token / eos_token
  std::string chat_template_, chat_template_file_;
};

}  // namespace kvlens
