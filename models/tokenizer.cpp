#include "models/tokenizer.h"

#include <sentencepiece_processor.h>

#include <cstdint>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/json_file.h"
#include "core/numbers.h"
#include "models/bpe_tokenizer.h"
#include "models/chat_template.h"

namespace kvlens {


Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

namespace {

// The serialized ModelProto without its self-test samples (field 4): SentencePiece checks them
// when it loads a model, and they were encoded with the model's own normalizer settings.
std::string without_self_test(const std::string& proto, const std::string& file) {
  std::string out;
  size_t at = 0;
  auto varint = [&](uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at >= proto.size()) throw InputError(file + ": a truncated SentencePiece model");
      const auto byte = static_cast<uint8_t>(proto[at++]);
      v |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return;
    }
    throw InputError(file + ": a malformed SentencePiece model");
  };
  while (at < proto.size()) {
    const size_t start = at;
    uint64_t tag = 0, n = 0;
    varint(tag);
    switch (tag & 7) {
      case 0: varint(n); n = 0; break;
      case 1: n = 8; break;
      case 2: varint(n); break;
      case 5: n = 4; break;
      default: throw InputError(file + ": a malformed SentencePiece model");
    }
    if (n > proto.size() - at) throw InputError(file + ": a truncated SentencePiece model");
    at += n;
    if ((tag >> 3) != 4) out.append(proto, start, at - start);
  }
  return out;
}

// tokenizer_config.json's bos_token / eos_token: a string, or an object with its "content".
std::string token_text(const nlohmann::json& j, const char* key) {
  if (!j.contains(key)) return "";
  const auto& v = j[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& dir, int image_token_index, bool with_image) {
  Tokenizer t;
  const std::string model = dir + "/tokenizer.model", json_path = dir + "/tokenizer.json";
  const std::string tc = dir + "/tokenizer_config.json";
  const nlohmann::json cfg = read_json_file_if_present(tc, "tokenizer config");
  if (file_exists(model)) {
    // The model as transformers uses it: its normalizer's remove_extra_whitespaces (field 4 of
    // NormalizerSpec, field 3 of ModelProto) off, as HF's Llama tokenizer ignores it (a message
    // field given twice is merged, its later scalars winning); then a copy with add_dummy_prefix
    // (field 3) off as well, for the sections that get no "▁". Neither keeps the model's
    // self-test samples (field 4), made with its own settings: SentencePiece checks them at load.
    const std::string proto = read_input_file(model, "SentencePiece tokenizer.model", uint64_t{1} << 30);
    auto check = [&](const sentencepiece::util::Status& st) {
      if (!st.ok()) throw InputError(model + ": not a SentencePiece model (" + st.ToString() + ")");
    };
    const std::string base = without_self_test(proto, model) + std::string("\x1a\x02\x20\x00", 4);
    t.sp_ = std::make_unique<sentencepiece::SentencePieceProcessor>();
    check(t.sp_->LoadFromSerializedProto(base));
    t.sp_bare_ = std::make_unique<sentencepiece::SentencePieceProcessor>();
    check(t.sp_bare_->LoadFromSerializedProto(base + std::string("\x1a\x02\x18\x00", 4)));
    t.bos_ = t.sp_->bos_id();
    t.eos_ = t.sp_->eos_id();
    auto added = [&](const std::string& text, int id) {
      if (text.empty() || text == "<image>" || id < 0) return;
      for (const auto& a : t.sp_added_)
        if (a.content == text) return;
      t.sp_added_.push_back({text, id});
    };
    for (int id : {t.bos_, t.eos_, t.sp_->unk_id()})
      if (id >= 0 && id < t.sp_->GetPieceSize()) added(t.sp_->IdToPiece(id), id);
    if (cfg.contains("added_tokens_decoder") && cfg["added_tokens_decoder"].is_object())
      for (const auto& [key, v] : cfg["added_tokens_decoder"].items())
        if (v.is_object() && v.contains("content") && v["content"].is_string())
          added(v["content"].get<std::string>(),
                static_cast<int>(parse_integer(key, tc + ": added_tokens_decoder id", 0, (1 << 24) - 1)));
    if (const std::string at = dir + "/added_tokens.json"; file_exists(at)) {
      const auto j = read_json_file(at, "added tokens");
      if (j.is_object())
        for (const auto& [text, v] : j.items()) added(text, json_int(v, at + ": '" + text + "'", 0, (1 << 24) - 1));
    }
    sort_longest_first(t.sp_added_);
    if (cfg.contains("add_bos_token") && cfg["add_bos_token"].is_boolean()) t.add_bos_ = cfg["add_bos_token"].get<bool>();
    auto flag = [&](const char* key, bool& v) {
      if (!cfg.contains(key) || cfg[key].is_null()) return false;
      if (!cfg[key].is_boolean()) throw InputError(tc + ": '" + key + "' must be true, false or null");
      v = cfg[key].get<bool>();
      return true;
    };
    bool legacy = false, prefix_space = true;
    if (flag("add_prefix_space", prefix_space) && !prefix_space) t.prefix_ = SpacePrefix::None;
    else t.prefix_ = flag("legacy", legacy) && legacy ? SpacePrefix::EverySection : SpacePrefix::FirstSection;
  } else if (file_exists(json_path)) {
    t.bpe_ = std::make_unique<ByteLevelBpe>(ByteLevelBpe::from_json(read_json_file(json_path, "tokenizer"), json_path));
    // BOS: what the post-processor puts first (Llama-3), else tokenizer_config's bos_token when
    // add_bos_token says so; none for a tokenizer with neither (Qwen2).
    const std::string bos = token_text(cfg, "bos_token"), eos = token_text(cfg, "eos_token");
    t.bos_ = t.bpe_->template_bos() >= 0 ? t.bpe_->template_bos() : bos.empty() ? -1 : t.bpe_->id_of(bos);
    t.add_bos_ = t.bpe_->template_bos() >= 0 || (cfg.value("add_bos_token", false) && t.bos_ >= 0);
    t.eos_ = eos.empty() ? -1 : t.bpe_->id_of(eos);
    t.bos_text_ = t.bos_ >= 0 ? t.bpe_->piece(t.bos_) : "";
    if (!bos.empty() && t.bpe_->id_of(bos) < 0) throw InputError(tc + ": bos_token '" + bos + "' is not a token");
    if (!eos.empty() && t.eos_ < 0) throw InputError(tc + ": eos_token '" + eos + "' is not a token");
  } else {
    throw InputError(dir + ": no tokenizer.model (SentencePiece) or tokenizer.json (byte-level BPE)");
  }
  if (t.bos_text_.empty()) t.bos_text_ = token_text(cfg, "bos_token");
  t.eos_text_ = token_text(cfg, "eos_token");
  t.load_chat_template(dir, cfg);
  t.image_token_ = with_image ? image_token_index : -1;
  if (!with_image) return t;
  const std::string at = dir + "/added_tokens.json";
  if (file_exists(at)) {
    const auto j = read_json_file(at, "added tokens");
    if (j.contains("<image>")) t.image_token_ = json_int(j["<image>"], at + ": '<image>'", 0, (1 << 24) - 1);
  }
  const int piece_id = t.bpe_ ? t.bpe_->id_of("<image>") : t.sp_->PieceToId("<image>");
  if (t.image_token_ < 0 && piece_id >= 0 && (t.bpe_ || piece_id != t.sp_->unk_id())) t.image_token_ = piece_id;
  if (t.image_token_ < 0) throw InputError(dir + ": no id for the <image> token");
  return t;
}

void Tokenizer::load_chat_template(const std::string& dir, const nlohmann::json& cfg) {
  // As transformers looks for it: the raw chat_template.jinja, the processor's chat_template.json,
  // then tokenizer_config.json's (a string, or named templates of which "default").
  const std::string jinja = dir + "/chat_template.jinja", json_file = dir + "/chat_template.json";
  if (file_exists(jinja)) {
    chat_template_ = read_input_file(jinja, "chat template", uint64_t{1} << 24);
    chat_template_file_ = jinja;
    return;
  }
  auto take = [&](const nlohmann::json& v, const std::string& file) {
    if (v.is_string()) {
      chat_template_ = v.get<std::string>();
    } else if (v.is_array()) {
      for (const auto& t : v)
        if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string())
          chat_template_ = t["template"].get<std::string>();
      if (chat_template_.empty()) throw InputError(file + ": chat_template lists no template named 'default'");
    } else {
      throw InputError(file + ": chat_template must be a string or a list of named templates");
    }
    chat_template_file_ = file;
  };
  if (file_exists(json_file)) {
    const auto j = read_json_file(json_file, "chat template");
    if (!j.is_object() || !j.contains("chat_template")) throw InputError(json_file + ": no 'chat_template'");
    take(j["chat_template"], json_file);
  } else if (cfg.contains("chat_template") && !cfg["chat_template"].is_null()) {
    take(cfg["chat_template"], dir + "/tokenizer_config.json");
  }
}

std::string Tokenizer::chat_prompt(bool with_image) const {
  if (chat_template_.empty()) return "";
  nlohmann::ordered_json user = {{"role", "user"}};
  if (with_image)
    user["content"] = {{{"type", "image"}}, {{"type", "text"}, {"text", "{prompt}"}}};
  else
    user["content"] = "{prompt}";
  const nlohmann::ordered_json ctx = {{"messages", {user}}, {"add_generation_prompt", true},
                                      {"bos_token", bos_text_}, {"eos_token", eos_text_}};
  std::string r = render_chat_template(chat_template_, ctx, chat_template_file_);
  // A template that writes the image as its own token (InternVL's <IMG_CONTEXT>) marks it for
  // encode_prompt as <image>.
  const std::string own = with_image && bpe_ && image_token_ >= 0 ? bpe_->piece(image_token_) : "";
  if (!own.empty() && own != "<image>")
    for (size_t at = r.find(own); at != std::string::npos; at = r.find(own, at + 7)) r.replace(at, own.size(), "<image>");
  if (r.find("{prompt}") == std::string::npos)
    throw InputError(chat_template_file_ + ": the chat template dropped the user's text (no {prompt} in '" + r + "')");
  if (with_image && r.find("<image>") == std::string::npos)
    throw InputError(chat_template_file_ + ": the chat template writes no <image> for the user's image (got '" + r +
                     "'); give --template");
  return r;
}

bool Tokenizer::needs_bos(const std::string& text) const {
  if (!add_bos_) return false;
  return !(bpe_ && !bos_text_.empty() && text.rfind(bos_text_, 0) == 0);
}

int Tokenizer::sp_vocab_size() const { return bpe_ ? bpe_->vocab_size() : sp_->GetPieceSize(); }

std::vector<int> Tokenizer::encode(const std::string& text) const { return encode_section(text, true); }

std::vector<int> Tokenizer::encode_section(const std::string& text, bool first) const {
  std::vector<int> ids;
  if (text.empty()) return ids;
  if (bpe_) return bpe_->encode(text);
  split_added_tokens(
      text, sp_added_,
      [&](const std::string& part, size_t offset) {
        // (A section that starts with a space, or with "▁", gets none added: it has its own.)
        const bool own = part[0] == ' ' || part.rfind("\xe2\x96\x81", 0) == 0;
        const bool prefix =
            !own && (prefix_ == SpacePrefix::EverySection || (prefix_ == SpacePrefix::FirstSection && first && offset == 0));
        std::vector<int> enc;
        const auto status = (prefix ? sp_ : sp_bare_)->Encode(part, &enc);
        if (!status.ok()) throw InputError("tokenizer: cannot encode text (" + status.ToString() + ")");
        ids.insert(ids.end(), enc.begin(), enc.end());
      },
      [&](const AddedToken& a) { ids.push_back(a.id); });
  return ids;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  if (bpe_) return bpe_->decode(ids, true);  // (special tokens, BOS and EOS among them, skipped)
  std::vector<int> keep;
  const int n = sp_->GetPieceSize();
  for (int id : ids)
    if (id >= 0 && id < n && id != eos_ && id != bos_) keep.push_back(id);
  std::string text;
  sp_->Decode(keep, &text);
  return text;
}

std::string Tokenizer::piece(int id) const {
  if (id == image_token_) return "<image>";
  if (bpe_) {
    if (id < 0 || id >= bpe_->vocab_size()) return "<" + std::to_string(id) + ">";
    return bpe_->is_special(id) ? bpe_->piece(id) : bpe_->decode({id}, false);
  }
  if (id < 0 || id >= sp_->GetPieceSize()) return "<" + std::to_string(id) + ">";
  return sp_->IdToPiece(id);
}

std::vector<int> Tokenizer::encode_prompt(const std::string& templ, const std::string& prompt,
                                          int n_visual) const {
  std::string text = templ;
  const auto p = text.find("{prompt}");
  if (p == std::string::npos) throw InputError("prompt template '" + templ + "' has no {prompt}");
  if (prompt.find("<image>") != std::string::npos)
    throw InputError("prompt '" + prompt + "' contains <image>; the image marker belongs in the template");
  text.replace(p, 8, prompt);
  if (image_token_ < 0 && text.find("<image>") != std::string::npos)
    throw InputError("prompt template '" + templ + "' has an <image> marker, and the model takes no image");
  std::vector<int> ids;
  if (needs_bos(text)) ids.push_back(bos_);
  size_t start = 0;
  bool first = true;
  while (true) {
    const size_t at = text.find("<image>", start);
    const std::string chunk = text.substr(start, at == std::string::npos ? std::string::npos : at - start);
    if (!first) ids.insert(ids.end(), n_visual, image_token_);
    const auto enc = encode_section(chunk, first);
    ids.insert(ids.end(), enc.begin(), enc.end());
    first = false;
    if (at == std::string::npos) break;
    start = at + 7;
  }
  return ids;
}

}  // namespace kvlens
