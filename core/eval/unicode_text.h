// UTF-8 text as code points, and the character classes and case mapping that the PTB tokenizer
// (core/eval/ptb_tokenizer.h) needs. The classes follow Java's Character.isLetter / isDigit /
// isUpperCase over the scripts that captions use (Latin, Greek, Cyrillic, Armenian, Hebrew,
// Arabic, Devanagari, Thai, Georgian, Hangul, kana, CJK ideographs, full-width forms); code
// points outside those blocks count as neither letter nor digit.
#pragma once
#include <string>
#include <string_view>

namespace kvlens {

// Decodes UTF-8; throws InputError naming `what` and the byte offset of an invalid sequence.
std::u32string utf8_decode(std::string_view s, const std::string& what);
std::string utf8_encode(std::u32string_view s);
void utf8_append(std::string& out, char32_t c);

bool is_letter(char32_t c);
bool is_digit(char32_t c);
bool is_upper(char32_t c);
// Java's String.toLowerCase() in the root locale for the blocks above (İ → i + U+0307, a final
// capital sigma → ς).
std::u32string to_lower(std::u32string_view s);

}  // namespace kvlens
