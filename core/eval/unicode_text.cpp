#include "core/eval/unicode_text.h"

#include <algorithm>
#include <iterator>

#include "core/errors.h"

namespace kvlens {

namespace {

struct Range {
  char32_t lo, hi;
};

bool in_ranges(const Range* begin, const Range* end, char32_t c) {
  const Range* it = std::upper_bound(begin, end, c, [](char32_t x, const Range& r) { return x < r.lo; });
  return it != begin && c <= (it - 1)->hi;
}

// Letters (Unicode general categories Lu, Ll, Lt, Lm, Lo) of the supported blocks, sorted.
const Range kLetters[] = {
    {0x0041, 0x005A}, {0x0061, 0x007A}, {0x00AA, 0x00AA}, {0x00B5, 0x00B5}, {0x00BA, 0x00BA},
    {0x00C0, 0x00D6}, {0x00D8, 0x00F6}, {0x00F8, 0x02C1}, {0x02C6, 0x02D1}, {0x02E0, 0x02E4},
    {0x02EC, 0x02EC}, {0x02EE, 0x02EE}, {0x0370, 0x0374}, {0x0376, 0x0377}, {0x037A, 0x037D},
    {0x0386, 0x0386}, {0x0388, 0x038A}, {0x038C, 0x038C}, {0x038E, 0x03A1}, {0x03A3, 0x03F5},
    {0x03F7, 0x0481}, {0x048A, 0x0527}, {0x0531, 0x0556}, {0x0559, 0x0559}, {0x0561, 0x0587},
    {0x05D0, 0x05EA}, {0x05F0, 0x05F2}, {0x0620, 0x064A}, {0x066E, 0x066F}, {0x0671, 0x06D3},
    {0x06D5, 0x06D5}, {0x06E5, 0x06E6}, {0x06EE, 0x06EF}, {0x06FA, 0x06FC}, {0x06FF, 0x06FF},
    {0x0904, 0x0939}, {0x093D, 0x093D}, {0x0950, 0x0950}, {0x0958, 0x0961}, {0x0971, 0x0977},
    {0x0979, 0x097F}, {0x0E01, 0x0E30}, {0x0E32, 0x0E33}, {0x0E40, 0x0E46}, {0x10A0, 0x10C5},
    {0x10D0, 0x10FA}, {0x10FC, 0x10FC}, {0x1100, 0x1248}, {0x1E00, 0x1F15}, {0x1F18, 0x1F1D},
    {0x1F20, 0x1F45}, {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59}, {0x1F5B, 0x1F5B},
    {0x1F5D, 0x1F5D}, {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC}, {0x1FBE, 0x1FBE},
    {0x1FC2, 0x1FC4}, {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB}, {0x1FE0, 0x1FEC},
    {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FFC}, {0x3041, 0x3096}, {0x309D, 0x309F}, {0x30A1, 0x30FA},
    {0x30FC, 0x30FF}, {0x3400, 0x4DB5}, {0x4E00, 0x9FCB}, {0xAC00, 0xD7A3}, {0xFB00, 0xFB06},
    {0xFF21, 0xFF3A}, {0xFF41, 0xFF5A}, {0xFF66, 0xFFBE},
};

const Range kDigits[] = {{0x0030, 0x0039}, {0x0660, 0x0669}, {0x06F0, 0x06F9}, {0x0966, 0x096F},
                         {0x0E50, 0x0E59}, {0xFF10, 0xFF19}};

// Upper-case letter → lower-case letter for the alphabets with a simple offset or pairing.
char32_t lower_one(char32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  if ((c >= 0xC0 && c <= 0xD6) || (c >= 0xD8 && c <= 0xDE)) return c + 32;
  if (c >= 0x0100 && c <= 0x0137) return c | 1;
  if (c >= 0x0139 && c <= 0x0148) return (c & 1) ? c + 1 : c;
  if (c >= 0x014A && c <= 0x0177) return c | 1;
  if (c == 0x0178) return 0x00FF;
  if (c >= 0x0179 && c <= 0x017E) return (c & 1) ? c + 1 : c;
  if (c == 0x01C4 || c == 0x01C5) return 0x01C6;
  if (c == 0x01C7 || c == 0x01C8) return 0x01C9;
  if (c == 0x01CA || c == 0x01CB) return 0x01CC;
  if (c == 0x01F1 || c == 0x01F2) return 0x01F3;
  if (c >= 0x01CD && c <= 0x01DC) return (c & 1) ? c + 1 : c;
  if ((c >= 0x01DE && c <= 0x01EF) || (c >= 0x01F8 && c <= 0x021F) || (c >= 0x0222 && c <= 0x0233)) return c | 1;
  if (c == 0x0386) return 0x03AC;
  if (c >= 0x0388 && c <= 0x038A) return c + 37;
  if (c == 0x038C) return 0x03CC;
  if (c == 0x038E || c == 0x038F) return c + 63;
  if ((c >= 0x0391 && c <= 0x03A1) || (c >= 0x03A3 && c <= 0x03AB)) return c + 32;
  if (c >= 0x0400 && c <= 0x040F) return c + 80;
  if (c >= 0x0410 && c <= 0x042F) return c + 32;
  if ((c >= 0x0460 && c <= 0x0481) || (c >= 0x048A && c <= 0x04BF) || (c >= 0x04D0 && c <= 0x0527)) return c | 1;
  if (c >= 0x0531 && c <= 0x0556) return c + 48;
  if ((c >= 0x1E00 && c <= 0x1E95) || (c >= 0x1EA0 && c <= 0x1EFF)) return c | 1;
  if (c >= 0x2160 && c <= 0x216F) return c + 16;
  if (c >= 0x24B6 && c <= 0x24CF) return c + 26;
  if (c >= 0xFF21 && c <= 0xFF3A) return c + 32;
  return c;
}


// Letters with case (Java's ConditionalSpecialCasing.isCased, for the blocks above).
bool cased(char32_t c) {
  return (c < 0x80 && ((c | 32) >= 'a' && (c | 32) <= 'z')) || c == 0xB5 || (c >= 0xC0 && c <= 0x24F && c != 0xD7 &&
         c != 0xF7 && c != 0x1BB && !(c >= 0x1C0 && c <= 0x1C3)) || (c >= 0x250 && c <= 0x2AF) ||
         (c >= 0x2B0 && c <= 0x2B8) || (c >= 0x2C0 && c <= 0x2C1) || (c >= 0x2E0 && c <= 0x2E4) ||
         (c >= 0x370 && c <= 0x3FF && is_letter(c) && c != 0x374) || (c >= 0x400 && c <= 0x52F && is_letter(c)) ||
         (c >= 0x531 && c <= 0x587 && is_letter(c)) || (c >= 0x1E00 && c <= 0x1FFF && is_letter(c)) ||
         (c >= 0x2160 && c <= 0x217F) || (c >= 0x24B6 && c <= 0x24E9) || (c >= 0xFB00 && c <= 0xFB06) ||
         (c >= 0xFF21 && c <= 0xFF3A) || (c >= 0xFF41 && c <= 0xFF5A);
}

}  // namespace

bool is_letter(char32_t c) { return in_ranges(std::begin(kLetters), std::end(kLetters), c); }
bool is_digit(char32_t c) { return in_ranges(std::begin(kDigits), std::end(kDigits), c); }
bool is_upper(char32_t c) { return c != 0x0130 ? lower_one(c) != c : true; }

std::u32string to_lower(std::u32string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    const char32_t c = s[i];
    if (c == 0x0130) {  // İ → i + combining dot above
      out += U'i';
      out += char32_t{0x0307};
    } else if (c == 0x03A3) {  // Σ: final form when a cased letter precedes it and none follows
      // Within the word around it (as Java's word break iterator finds it, approximately): letters
      // other than kana and CJK ideographs, digits, marks, '_', superscripts and fractions, joined
      // by ' . : and hyphens or dashes between them.
      auto ideograph = [](char32_t x) { return (x >= 0x3040 && x <= 0x9FFF) || (x >= 0xFF10 && x <= 0xFF19); };
      auto word = [&](char32_t x) {
        return !ideograph(x) && (is_letter(x) || is_digit(x) || (x >= 0x300 && x <= 0x36F) || x == U'_' || x == 0xB2 || x == 0xB3 ||
               x == 0xB9 || (x >= 0xBC && x <= 0xBE) || (x >= 0x2070 && x <= 0x2089));
      };
      auto mid = [](char32_t x) { return x == U'\'' || x == U'.' || x == U':' || x == U'-' || x == 0x2010 || x == 0x2011 ||
               x == 0x2013 || x == 0x2014; };
      bool after_cased = false, before_cased = false;
      for (size_t k = i; k > 0 && (word(s[k - 1]) || (mid(s[k - 1]) && k >= 2 && word(s[k - 2])));
           --k)
        after_cased = after_cased || cased(s[k - 1]);
      for (size_t k = i + 1;
           k < s.size() && (word(s[k]) || (mid(s[k]) && k + 1 < s.size() && word(s[k + 1])));
           ++k)
        before_cased = before_cased || cased(s[k]);
      out += (after_cased && !before_cased) ? char32_t{0x03C2} : char32_t{0x03C3};
    } else {
      out += lower_one(c);
    }
  }
  return out;
}

std::u32string utf8_decode(std::string_view s, const std::string& what) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  auto bad = [&]() { throw InputError(what + ": invalid UTF-8 at byte " + std::to_string(i)); };
  while (i < s.size()) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    int n = 0;
    char32_t c = 0;
    if (b0 < 0x80) {
      c = b0;
    } else if ((b0 & 0xE0) == 0xC0) {
      n = 1, c = b0 & 0x1F;
    } else if ((b0 & 0xF0) == 0xE0) {
      n = 2, c = b0 & 0x0F;
    } else if ((b0 & 0xF8) == 0xF0) {
      n = 3, c = b0 & 0x07;
    } else {
      bad();
    }
    for (int k = 1; k <= n; ++k) {
      if (i + k >= s.size()) bad();
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) bad();
      c = (c << 6) | (b & 0x3F);
    }
    const char32_t min_for_len[] = {0, 0x80, 0x800, 0x10000};
    if (c < min_for_len[n] || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) bad();
    out += c;
    i += n + 1;
  }
  return out;
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

std::string utf8_encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) utf8_append(out, c);
  return out;
}

}  // namespace kvlens
