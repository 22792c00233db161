#include "models/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#ifdef KVLENS_HAVE_ICU
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>
#endif

#include <algorithm>
#include <climits>

#include "core/errors.h"
#include "core/numbers.h"

namespace kvlens {

namespace {

// GPT-2's pre-tokenizer pattern (ByteLevel with use_regex).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// One code point as UTF-8 (models/ may not reach core/eval's text helpers).
std::string utf8(uint32_t cp) {
  const int n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
  static const unsigned lead[] = {0, 0x00, 0xC0, 0xE0, 0xF0};
  std::string s(static_cast<size_t>(n), '\0');
  for (int k = n - 1; k > 0; --k, cp >>= 6) s[static_cast<size_t>(k)] = static_cast<char>(0x80 | (cp & 0x3F));
  s[0] = static_cast<char>(lead[n] | cp);
  return s;
}

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + n.
struct ByteMap {
  std::string to_char[256];                  // byte → its character (UTF-8)
  std::unordered_map<uint32_t, uint8_t> back;  // character → byte
  ByteMap() {
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    std::vector<bool> printable(256, false);
    for (int b : bs) printable[b] = true;
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const uint32_t cp = printable[b] ? static_cast<uint32_t>(b) : 256u + static_cast<uint32_t>(n++);
      to_char[b] = utf8(cp);
      back[cp] = static_cast<uint8_t>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// The code points of a UTF-8 string, each with its byte length; false when it is not UTF-8.
bool code_points(const std::string& s, std::vector<std::pair<uint32_t, int>>& out) {
  out.clear();
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 2) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    out.push_back({cp, n});
    i += n;
  }
  return true;
}

// Bytes as UTF-8 text the way Python's bytes.decode("utf-8", errors="replace") gives it (and so
// HF's decode): each maximal ill-formed part becomes one U+FFFD. Ids decoded alone or cut short
// can end inside a character.
std::string utf8_or_replacement(const std::string& b) {
  static const std::string repl = "\xEF\xBF\xBD";
  std::string out;
  size_t i = 0;
  while (i < b.size()) {
    const auto c = static_cast<unsigned char>(b[i]);
    if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    int need = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
    if (c >= 0xC2 && c <= 0xDF) need = 1;
    else if (c == 0xE0) need = 2, lo = 0xA0;
    else if (c >= 0xE1 && c <= 0xEC) need = 2;
    else if (c == 0xED) need = 2, hi = 0x9F;
    else if (c >= 0xEE && c <= 0xEF) need = 2;
    else if (c == 0xF0) need = 3, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3) need = 3;
    else if (c == 0xF4) need = 3, hi = 0x8F;
    if (need == 0) {  // not a lead byte
      out += repl;
      ++i;
      continue;
    }
    size_t k = 1;
    for (; k <= static_cast<size_t>(need) && i + k < b.size(); ++k) {
      const auto d = static_cast<unsigned char>(b[i + k]);
      if (k == 1 ? (d < lo || d > hi) : (d < 0x80 || d > 0xBF)) break;
    }
    if (k == static_cast<size_t>(need) + 1) out.append(b, i, k);
    else out += repl;
    i += k;
  }
  return out;
}

}  // namespace

// One compiled pre-tokenizer pattern.
struct ByteLevelBpe::Regex {
  pcre2_code* code = nullptr;
  std::string pattern;
  explicit Regex(const std::string& p, const std::string& where) : pattern(p) {
    int err = 0;
    PCRE2_SIZE at = 0;
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), PCRE2_UTF | PCRE2_UCP, &err, &at, nullptr);
    if (!code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw InputError(where + ": the pre-tokenizer pattern '" + p + "' does not compile at offset " +
                       std::to_string(at) + " (" + reinterpret_cast<const char*>(msg) + ")");
    }
  }
  ~Regex() { pcre2_code_free(code); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Split "Isolated": every match a piece, and every stretch between matches a piece.
  void split(const std::string& s, std::vector<std::string>& out) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
    // A pattern from a file may backtrack without end: bounded, as an error.
    pcre2_match_context* mc = pcre2_match_context_create(nullptr);
    pcre2_set_match_limit(mc, 10'000'000);
    pcre2_set_depth_limit(mc, 100'000);
    size_t pos = 0, last = 0;
    while (pos <= s.size()) {
      const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, 0, md, mc);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        pcre2_match_data_free(md);
        pcre2_match_context_free(mc);
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        throw InputError("tokenizer: the pre-tokenizer pattern '" + pattern + "' cannot split the text (" +
                         reinterpret_cast<const char*>(msg) + ")");
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const size_t a = ov[0], b = ov[1];
      if (a > last) out.push_back(s.substr(last, a - last));
      if (b > a) {
        out.push_back(s.substr(a, b - a));
        pos = last = b;
      } else {  // an empty match: step over one character
        size_t next = a + 1;
        while (next < s.size() && (static_cast<unsigned char>(s[next]) & 0xC0) == 0x80) ++next;
        pos = next;
        last = a;
      }
    }
    if (last < s.size()) out.push_back(s.substr(last));
    pcre2_match_data_free(md);
    pcre2_match_context_free(mc);
  }
};

ByteLevelBpe::ByteLevelBpe() = default;
ByteLevelBpe::~ByteLevelBpe() = default;
ByteLevelBpe::ByteLevelBpe(ByteLevelBpe&&) noexcept = default;
ByteLevelBpe& ByteLevelBpe::operator=(ByteLevelBpe&&) noexcept = default;

ByteLevelBpe ByteLevelBpe::from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
    throw InputError(where + ": no 'model' object");
  const nlohmann::json& m = j["model"];
  const std::string type = m.value("type", std::string("BPE"));
  if (type != "BPE") throw InputError(where + ": model type '" + type + "' is not one kvlens reads (BPE)");
  ByteLevelBpe t;
  if (!m.contains("vocab") || !m["vocab"].is_object()) throw InputError(where + ": model.vocab is not an object");
  int max_id = -1;
  for (const auto& [tok, id] : m["vocab"].items()) {
    const int i = json_int(id, where + ": model.vocab['" + tok + "']", 0, (1 << 24) - 1);
    t.vocab_[tok] = i;
    max_id = std::max(max_id, i);
  }
  if (m.contains("merges") && m["merges"].is_array()) {
    int rank = 0;
    for (const auto& mg : m["merges"]) {
      std::string key;
      if (mg.is_string()) key = mg.get<std::string>();
      else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string())
        key = mg[0].get<std::string>() + " " + mg[1].get<std::string>();
      else
        throw InputError(where + ": model.merges[" + std::to_string(rank) + "] is neither \"a b\" nor [a, b]");
      t.merge_rank_.emplace(key, rank++);
    }
  }
  t.ignore_merges_ = m.value("ignore_merges", false);
  for (const char* unsupported : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(unsupported) && !m[unsupported].is_null() && m[unsupported] != "")
      throw InputError(where + ": model." + unsupported + " is not supported by kvlens's byte-level BPE");
  if (m.value("byte_fallback", false))
    throw InputError(where + ": a byte_fallback BPE (SentencePiece-style) is not byte-level; kvlens reads its tokenizer.model");
  // Normalizer: none or NFC (alone or in a sequence).
  const nlohmann::json& norm = j.contains("normalizer") ? j["normalizer"] : nlohmann::json();
  std::vector<nlohmann::json> norms;
  if (norm.is_object() && norm.value("type", "") == "Sequence" && norm.contains("normalizers"))
    for (const auto& n : norm["normalizers"]) norms.push_back(n);
  else if (!norm.is_null())
    norms.push_back(norm);
  for (const auto& n : norms) {
    const std::string nt = n.is_object() ? n.value("type", "") : "";
    if (nt != "NFC") throw InputError(where + ": normalizer '" + (nt.empty() ? n.dump() : nt) + "' is not one kvlens applies (NFC)");
    t.nfc_ = true;
  }
  // Pre-tokenizer: Split (Isolated, a regex) and ByteLevel, alone or in a sequence.
  const nlohmann::json& pre = j.contains("pre_tokenizer") ? j["pre_tokenizer"] : nlohmann::json();
  std::vector<nlohmann::json> pres;
  if (pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers"))
    for (const auto& p : pre["pretokenizers"]) pres.push_back(p);
  else if (!pre.is_null())
    pres.push_back(pre);
  bool byte_level = false;
  for (const auto& p : pres) {
    const std::string pt = p.is_object() ? p.value("type", "") : "";
    if (pt == "ByteLevel") {
      byte_level = true;
      t.add_prefix_space_ = p.value("add_prefix_space", false);
      if (p.value("use_regex", true)) t.splits_.push_back(std::make_shared<Regex>(kGpt2Pattern, where));
    } else if (pt == "Split") {
      const std::string behavior = p.value("behavior", std::string("Isolated"));
      if (behavior != "Isolated" || p.value("invert", false))
        throw InputError(where + ": a Split pre-tokenizer with behavior '" + behavior + "'" +
                         (p.value("invert", false) ? " inverted" : "") + " is not one kvlens reads (Isolated)");
      if (!p.contains("pattern") || !p["pattern"].is_object() || !p["pattern"].contains("Regex") ||
          !p["pattern"]["Regex"].is_string())
        throw InputError(where + ": a Split pre-tokenizer without a {\"Regex\": …} pattern");
      t.splits_.push_back(std::make_shared<Regex>(p["pattern"]["Regex"].get<std::string>(), where));
    } else {
      throw InputError(where + ": pre-tokenizer '" + (pt.empty() ? p.dump() : pt) +
                       "' is not one kvlens reads (ByteLevel, Split)");
    }
  }
  if (!byte_level)
    throw InputError(where + ": not a byte-level BPE (no ByteLevel pre-tokenizer); kvlens reads byte-level tokenizer.json "
                             "files (GPT-2, Llama-3, Qwen2) and SentencePiece tokenizer.model");
  // Added tokens: split out of the text before anything else, the longest first.
  if (j.contains("added_tokens") && j["added_tokens"].is_array())
    for (const auto& a : j["added_tokens"]) {
      if (!a.is_object() || !a.contains("content") || !a["content"].is_string() || a["content"].get<std::string>().empty())
        throw InputError(where + ": an added token without its content: " + a.dump());
      AddedToken x{a["content"].get<std::string>(), json_int(a.value("id", nlohmann::json()), where + ": added token '" +
                                                                    a["content"].get<std::string>() + "' id", 0, (1 << 24) - 1),
              a.value("special", false)};
      max_id = std::max(max_id, x.id);
      t.added_.push_back(x);
    }
  sort_longest_first(t.added_);
  t.id_to_token_.assign(static_cast<size_t>(max_id + 1), "");
  t.special_.assign(static_cast<size_t>(max_id + 1), false);
  for (const auto& [tok, id] : t.vocab_) t.id_to_token_[static_cast<size_t>(id)] = tok;
  for (const AddedToken& a : t.added_) {
    t.id_to_token_[static_cast<size_t>(a.id)] = a.content;
    t.special_[static_cast<size_t>(a.id)] = a.special;
    t.vocab_.emplace(a.content, a.id);
  }
  // The post-processor's first special token (Llama-3's <|begin_of_text|>), if it puts one first.
  std::vector<nlohmann::json> posts;
  const nlohmann::json& post = j.contains("post_processor") ? j["post_processor"] : nlohmann::json();
  if (post.is_object() && post.value("type", "") == "Sequence" && post.contains("processors"))
    for (const auto& p : post["processors"]) posts.push_back(p);
  else if (!post.is_null())
    posts.push_back(post);
  for (const auto& p : posts)
    if (p.is_object() && p.value("type", "") == "TemplateProcessing" && p.contains("single") && p["single"].is_array() &&
        !p["single"].empty() && p["single"][0].contains("SpecialToken")) {
      const std::string tok = p["single"][0]["SpecialToken"].value("id", std::string());
      t.template_bos_ = t.id_of(tok);
      if (t.template_bos_ < 0) throw InputError(where + ": the post-processor's '" + tok + "' is not a token");
    }
  return t;
}

int ByteLevelBpe::id_of(const std::string& token) const {
  const auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

bool ByteLevelBpe::is_special(int id) const { return id >= 0 && id < static_cast<int>(special_.size()) && special_[id]; }

int ByteLevelBpe::vocab_size() const { return static_cast<int>(id_to_token_.size()); }

std::string ByteLevelBpe::piece(int id) const {
  return id >= 0 && id < static_cast<int>(id_to_token_.size()) ? id_to_token_[static_cast<size_t>(id)] : "";
}

std::vector<int> ByteLevelBpe::encode(const std::string& text) const {
  std::vector<int> ids;
  split_added_tokens(
      text, added_,
      [&](const std::string& stretch, size_t) {
        const std::vector<int> enc = encode_text(stretch);
        ids.insert(ids.end(), enc.begin(), enc.end());
      },
      [&](const AddedToken& a) { ids.push_back(a.id); });
  return ids;
}

bool ByteLevelBpe::nfc_available() {
#ifdef KVLENS_HAVE_ICU
  return true;
#else
  return false;
#endif
}

std::vector<int> ByteLevelBpe::encode_text(const std::string& raw) const {
  if (raw.empty()) return {};
  std::vector<std::pair<uint32_t, int>> cps;
  if (!code_points(raw, cps)) throw InputError("tokenizer: the text is not valid UTF-8");
  std::string text = raw;
  if (nfc_) {
    const bool ascii = std::all_of(raw.begin(), raw.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
    if (!ascii) {
#ifdef KVLENS_HAVE_ICU
      UErrorCode st = U_ZERO_ERROR;
      const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(st);
      if (U_FAILURE(st)) throw InputError("tokenizer: ICU has no NFC normalizer (" + std::string(u_errorName(st)) + ")");
      const icu::UnicodeString n = nfc->normalize(icu::UnicodeString::fromUTF8(raw), st);
      if (U_FAILURE(st)) throw InputError("tokenizer: NFC normalization failed (" + std::string(u_errorName(st)) + ")");
      text.clear();
      n.toUTF8String(text);
#else
      throw InputError("tokenizer: tokenizer.json normalizes text to NFC, and this kvlens was built without ICU; "
                       "non-ASCII text cannot be normalized (install libicu-dev and rebuild)");
#endif
    }
  }
  if (add_prefix_space_ && text[0] != ' ') text = " " + text;
  std::vector<std::string> pieces{text};
  for (const auto& r : splits_) {
    std::vector<std::string> next;
    for (const std::string& p : pieces) r->split(p, next);
    pieces.swap(next);
  }
  std::vector<int> ids;
  const ByteMap& bm = byte_map();
  for (const std::string& p : pieces) {
    std::string mapped;
    for (unsigned char c : p) mapped += bm.to_char[c];
    const std::vector<int> got = encode_piece(mapped);
    ids.insert(ids.end(), got.begin(), got.end());
  }
  return ids;
}

std::vector<int> ByteLevelBpe::encode_piece(const std::string& word) const {
  if (ignore_merges_) {
    const auto it = vocab_.find(word);
    if (it != vocab_.end()) return {it->second};
  }
  // Characters, then the lowest-ranked adjacent pair merged everywhere, until no pair ranks.
  std::vector<std::pair<uint32_t, int>> cps;
  code_points(word, cps);
  std::vector<std::string> parts;
  size_t at = 0;
  for (const auto& [cp, n] : cps) {
    parts.push_back(word.substr(at, static_cast<size_t>(n)));
    at += static_cast<size_t>(n);
  }
  while (parts.size() > 1) {
    int best = INT_MAX;
    std::string best_key;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      const auto it = merge_rank_.find(parts[i] + " " + parts[i + 1]);
      if (it != merge_rank_.end() && it->second < best) {
        best = it->second;
        best_key = it->first;
      }
    }
    if (best == INT_MAX) break;
    std::vector<std::string> merged;
    for (size_t i = 0; i < parts.size(); ++i) {
      if (i + 1 < parts.size() && parts[i] + " " + parts[i + 1] == best_key) {
        merged.push_back(parts[i] + parts[i + 1]);
        ++i;
      } else {
        merged.push_back(parts[i]);
      }
    }
    parts.swap(merged);
  }
  std::vector<int> ids;
  for (const std::string& s : parts) {
    const auto it = vocab_.find(s);
    if (it == vocab_.end()) throw InputError("tokenizer: '" + s + "' is in no vocabulary entry (a byte-level vocabulary lacks a byte)");
    ids.push_back(it->second);
  }
  return ids;
}

std::string ByteLevelBpe::decode(const std::vector<int>& ids, bool skip_special) const {
  std::string chars;
  for (int id : ids) {
    if (id < 0 || id >= static_cast<int>(id_to_token_.size())) continue;
    if (skip_special && special_[static_cast<size_t>(id)]) continue;
    chars += id_to_token_[static_cast<size_t>(id)];
  }
  // Each character back to its byte (characters outside the byte map stand for themselves).
  std::vector<std::pair<uint32_t, int>> cps;
  if (!code_points(chars, cps)) return chars;
  std::string out;
  size_t at = 0;
  const ByteMap& bm = byte_map();
  for (const auto& [cp, n] : cps) {
    const auto it = bm.back.find(cp);
    if (it != bm.back.end()) out += static_cast<char>(it->second);
    else out += chars.substr(at, static_cast<size_t>(n));
    at += static_cast<size_t>(n);
  }
  return utf8_or_replacement(out);
}

}  // namespace kvlens
