// The tokenizer is a longest-match scanner (core/eval/longest_match.h) over an ordered list of token
// rules: at each position every rule is tried, the longest match wins and the earlier rule wins
// a tie; a rule may require a trailing context that counts towards its length but is not part
// of the token. The rules and their order reproduce CoreNLP 3.4.1's PTBTokenizer as
// pycocoevalcap runs it (options -preserveLines -lowerCase, default PTB3 escaping without
// americanization); tests/ptb_probe.py checks them against the real tokenizer.
#include "core/eval/ptb_tokenizer.h"

#include <array>
#include <cstdint>
#include <mutex>

#include "core/errors.h"
#include "core/eval/longest_match.h"
#include "core/eval/unicode_text.h"

namespace kvlens {

namespace {

// What a rule does with its text.
enum class Act {
  Keep,          // the text as matched
  Word,          // soft hyphens (U+00AD) removed
  Pushback2,     // all but the last 2 characters ("gonna" → "gon", then "na")
  Pushback3,     // all but the last 3 ("cannot" → "can", then "not")
  Dash,          // "--"
  Amp,           // "&amp;" → "&"
  QuoteLeft,     // quote characters mapped as an opening quote
  QuoteRight,    // ... as a closing quote
  Ellipsis,      // "..."
  OpenParen, CloseParen, OpenBrace, CloseBrace, OpenSquare, CloseSquare,
  Hyphens,       // 3-4 hyphens → "--", others as matched
  Acronym,       // sentence-final acronym: "U.S." then "." again; "I." → "I" then "."
  AbbrevEnd,     // sentence-final abbreviation: "Jan." then "." again
  Spaced,        // spaces inside the token become U+00A0
  Fraction,      // ¼ ½ ¾ ⅓ ⅔ spelled out
  Currency,      // ¢ → cents, £ → #, € ¤ ₠ → $
  Parens,        // ( ) inside the token → -LRB- -RRB- (smileys, phone numbers)
  Less, Greater, // &lt; → <, &gt; → >
  Skip,          // white space
  Newline,       // a line break of the output
  Delete,        // a character the tokenizer does not know: dropped, separates tokens
};

struct Rule {
  const char* token;
  const char* context;  // nullptr: none
  Act act;
};

// Building blocks of the rules (UTF-8 pattern syntax of core/eval/longest_match.h).
#define SPACE "[ \\t\\u00A0\\u2000-\\u200A\\u3000]"
#define NEWLINE "(\\r\\n|[\\r\\n\\u2028\\u2029\\u000B\\u000C\\u0085])"
#define SPACENL "(" SPACE "|" NEWLINE ")"
#define APOS "(['\\u0092\\u2019]|&apos;)"
#define APOSX "(" APOS "|[`\\u0091\\u2018\\u201B])"
#define LETTER \
  "([\\L\\u00AD\\u0300-\\u036F\\u0483-\\u0487\\u0591-\\u05BD\\u064B-\\u065E\\u0670\\u0900-\\u0903" \
  "\\u093C\\u093E-\\u094E\\u0E31\\u0E34-\\u0E3A\\u0E47-\\u0E4E]|&[aeiouAEIOU](acute|grave|uml);)"
#define ALNUM "[\\L\\D]"
#define WORD LETTER "(" LETTER "|\\D)*([.!?]" LETTER "(" LETTER "|\\D)*)*"
#define REDAUX APOS "([msdMSD]|re|ve|ll)"
#define SWORD "[A-Za-z\\u00AD]*[A-MO-Za-mo-z]\\u00AD*"
#define SREDAUX "n" APOSX "t"
#define NUM "(\\D+|\\D*([.:,\\u00AD\\u066B\\u066C]\\D+)+)"
#define HYPHEN "[\\-_\\u058A\\u2010\\u2011]"
#define ACRO "([A-Za-z](\\.[A-Za-z])*|(Canada|Sino|Korean|EU|Japan|non)-U\\.S|U\\.S\\.-(U\\.K|U\\.S\\.S\\.R))"
#define ACRO2 "([A-Za-z](\\.[A-Za-z])+|(Canada|Sino|Korean|EU|Japan|non)-U\\.S|U\\.S\\.-(U\\.K|U\\.S\\.S\\.R))"
#define SGML_NAME "[A-Za-z][A-Za-z0-9_:.\\-]*"
#define SGML                                                                                    \
  "<([!?][A-Za-z\\-][^>\\r\\n]*|" SGML_NAME "( +(" SGML_NAME "( *= *('[^']*'|\"[^\"]*\"))?))* *" \
  "/?|/" SGML_NAME ") *>"
#define URLCHARS "[^ \\t\\n\\f\\r\"<>|()]"
#define URLEND "[^ \\t\\n\\f\\r\"<>|.!?(){},\\-]"
#define ABBREV_SENTENCE                                                                          \
  "(Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec|Mon|Tue|Tues|Wed|Thu|Thurs|Fri"             \
  "|Ala|Ariz|[A]z|[A]rk|Calif|Colo|Conn|Ct|Dak|[D]el|Fla|Ga|[I]ll|Ind|Kans?|Ky|[L]a|[M]ass|Md|Mich" \
  "|Minn|[M]iss|Mo|Mont|Neb|Nev|Okla|[O]re|[P]a|Penn|Tenn|[T]ex|Va|Vt|[W]ash|Wisc?|Wyo"           \
  "|Inc|Cos?|Corp|Pp?t[ye]s?|Ltd|Plc|Rt|Bancorp|Bhd|Assn|Univ|Intl|Sys|tel|est|ext|sq"            \
  "|Jr|Sr|Bros|(Ed|Ph)\\.D|Esq|Blvd|Rd|etc|al|seq|Bldg)\\."
#define ABBREV_BEFORE_NAME                                                                       \
  "(Mr|Mrs|Ms|[M]iss|Drs?|Profs?|Sens?|Reps?|Attys?|Lt|Col|Gen|Messrs|Govs?|Adm|Rev|Maj|Sgt|Cpl"   \
  "|Pvt|Capt|Ste?|Ave|Pres|Lieut|Hon|Brig|Co?mdr|Pfc|Spc|Supts?|Det|Mt|Ft|Adj|Adv|Asst|Assoc"     \
  "|Ens|Insp|Mlle|Mme|Msgr|Sfc|vs|Alex|Wm|Jos|Cie|a\\.k\\.a|cf|TREAS|Ph|Invt|Elec|Natl|M[ft]g"    \
  "|Dept|" ACRO ")"
#define SENTENCE_STARTERS                                                                     \
  "([A]bout|[A]ccording|[A]dditionally|[A]fter|[A]n|[A]|[A]s|[A]t|[B]ut|[E]arlier|[H]e|[H]er" \
  "|[H]ere|[H]owever|[I]f|[I]n|[I]t|[L]ast|[M]any|[M]ore|[M]r\\.|[M]s\\.|[N]ow|[O]nce|[O]ne"  \
  "|[O]ther|[O]ur|[S]he|[S]ince|[S]o|[S]ome|[S]uch|[T]hat|[T]he|[T]heir|[T]hen|[T]here"      \
  "|[T]hese|[T]hey|[T]his|[W]e|[W]hen|[W]hile|[W]hat|[Y]et|[Y]ou|" SGML ")"
#define QUOTE_CHARS "[`\\u2018\\u2019\\u201A\\u201B\\u201C\\u201D\\u0091-\\u0094\\u201E\\u201F\\u2039\\u203A\\u00AB\\u00BB]"
#define MISC_SYMBOL                                                                                \
  "[+%&~\\^|\\\\\\u00A6\\u00A7\\u00A8\\u00A9\\u00AC\\u00AE\\u00AF\\u00B0-\\u00BA\\u00D7\\u00F7" \
  "\\u2016\\u2017\\u2020-\\u2023\\u2030-\\u2038\\u203B\\u203E-\\u2042\\u2044\\u207A-\\u207F"     \
  "\\u208A-\\u208E\\u2100-\\u214F\\u2190-\\u21FF\\u2200-\\u2BFF\\u3012\\u30FB\\uFF01-\\uFF0F"    \
  "\\uFF1A-\\uFF20\\uFF3B-\\uFF40\\uFF5B-\\uFF65]"
#define ASIAN_SMILEY_EYE "[\\-\\^x=~<>']"

// In priority order (the earlier rule wins a tie).
const Rule kRules[] = {
    {"c\\+\\+|(c|f)#", nullptr, Act::Keep},
    {"cannot|'twas", nullptr, Act::Pushback3},
    {APOS "tis|gonna|gotta|lemme|gimme|wanna", nullptr, Act::Pushback2},
    {SGML, nullptr, Act::Spaced},
    {"&(MD|mdash|ndash);|[\\u0096\\u0097\\u2013\\u2014\\u2015]", nullptr, Act::Dash},
    {"&amp;", nullptr, Act::Amp},
    {"&(HT|TL|UR|LR|QC|QL|QR|odq|cdq|#[0-9]+);", nullptr, Act::Keep},
    {WORD, REDAUX, Act::Word},
    {SWORD, SREDAUX, Act::Word},
    {WORD, nullptr, Act::Word},
    {APOS "n" APOS "?|[lLdDjJ]" APOS "|Dunkin" APOS "|somethin" APOS "|ol" APOS "|" APOS "em"
     "|[A-HJ-XZn]" APOSX "\\L\\L\\L*|" APOS "[2-9]0s|" APOS "till?|\\L\\L*[aeiouyAEIOUY]" APOSX
     "[aeiouA-Z]\\L*|" APOS "cause|cont'd\\.?|nor'easter|c'mon|e'er|s'mores|ev'ry|li'l|nat'l|O" APOSX "o",
     nullptr, Act::Keep},
    {"y" APOS, "\\L", Act::Keep},
    {"https?://[^ \\t\\n\\f\\r\"<>|(){}]+[^ \\t\\n\\f\\r\"<>|.!?(){},\\-]", nullptr, Act::Keep},
    {"((www\\.([^ \\t\\n\\f\\r\"<>|.!?(){},]+\\.)+[a-zA-Z]{2,4})|(([^ \\t\\n\\f\\r\"`'<>|.!?(){},-_$]+\\.)+"
     "(com|net|org|edu)))(/" URLCHARS "+" URLEND ")?",
     nullptr, Act::Keep},
    {"(&lt;|<)?[a-zA-Z0-9][^ \\t\\n\\f\\r\"<>|(){}\\u00A0]*@([^ \\t\\n\\f\\r\"<>|(){}.\\u00A0]+\\.)*"
     "[^ \\t\\n\\f\\r\"<>|(){}.\\u00A0]+(&gt;|>)?",
     nullptr, Act::Keep},
    {"@[a-zA-Z_][a-zA-Z_0-9]*|#" LETTER "+", nullptr, Act::Keep},
    {REDAUX, "[^A-Za-z]", Act::QuoteRight},
    {SREDAUX, nullptr, Act::QuoteRight},
    {"\\D{1,2}[\\-/]\\D{1,2}[\\-/]\\D{2,4}", nullptr, Act::Keep},
    {"[\\-+]?" NUM, nullptr, Act::Word},
    {"[\\u207A\\u207B\\u208A\\u208B]?([\\u2070\\u00B9\\u00B2\\u00B3\\u2074-\\u2079]+|[\\u2080-\\u2089]+)",
     nullptr, Act::Keep},
    {"(\\D{1,4}[\\- \\u00A0])?\\D{1,4}(\\\\?/|\\u2044)\\D{1,4}", nullptr, Act::Spaced},
    {"[\\u00BC\\u00BD\\u00BE\\u2153-\\u215E]", nullptr, Act::Fraction},
    {"-(RRB|LRB|RCB|LCB|RSB|LSB)-|C\\.D\\.s|pro-|anti-|S(&|&amp;)P-500|S(&|&amp;)Ls|Cap" APOS "n|c" APOS "est",
     nullptr, Act::Amp},
    {"[A-Za-z0-9]+(-[A-Za-z]+){0,2}(\\\\?/[A-Za-z0-9]+(-[A-Za-z]+){0,2}){1,2}", nullptr, Act::Keep},
    {"[A-Z]*\\$|#", nullptr, Act::Keep},
    {"[\\u00A2\\u00A3\\u00A4\\u00A5\\u0080\\u20A0\\u20AC\\u060B\\u0E3F\\u20A4\\uFFE0\\uFFE1\\uFFE5\\uFFE6]",
     nullptr, Act::Currency},
    {ACRO "\\.", SPACENL "+" SENTENCE_STARTERS SPACENL, Act::Acronym},
    {"(ca|figs?|prop|nos?|art|bldg|pp|op)\\.", SPACENL "?\\D", Act::Keep},
    {"(pt[eyEY]|co)\\.", SPACE "(ltd|lim)", Act::Keep},
    {ABBREV_SENTENCE, SPACENL "(" SPACENL "|\\U|" SGML ")", Act::AbbrevEnd},
    {ABBREV_SENTENCE, "..", Act::Keep},
    {ABBREV_SENTENCE, nullptr, Act::Keep},
    {ABBREV_BEFORE_NAME "\\.", nullptr, Act::Keep},
    {ABBREV_BEFORE_NAME, SPACE, Act::Keep},
    {ACRO, SPACENL, Act::Keep},
    {APOS "[0-9][0-9]", SPACENL, Act::Keep},
    {ALNUM "+(\\." ALNUM "+)*\\.(bat|bmp|c|class|cgi|cpp|dll|doc|docx|exe|gif|gz|h|htm|html|jar|java|jpeg|jpg"
     "|mov|mp3|pdf|php|pl|png|ppt|ps|py|sql|tar|txt|wav|x|xml|zip)",
     "(" SPACENL "|[.?!,])", Act::Keep},
    {WORD "\\.", "[,;:\\u3001]", Act::Word},
    {"(\\([0-9]{2,3}\\)[ \\u00A0]?|(\\+\\+?)?([0-9]{2,4}[\\- \\u00A0])?[0-9]{2,4}[\\- \\u00A0])[0-9]{3,4}"
     "[\\- \\u00A0]?[0-9]{3,5}|((\\+\\+?)?[0-9]{2,4}\\.)?[0-9]{2,4}\\.[0-9]{3,4}\\.[0-9]{3,5}",
     nullptr, Act::Parens},
    {"\"|&quot;", "[A-Za-z0-9$]", Act::QuoteLeft},
    {"\"|&quot;", nullptr, Act::QuoteRight},
    {"\\u007F", nullptr, Act::Skip},
    {"<|&lt;", nullptr, Act::Less},
    {">|&gt;", nullptr, Act::Greater},
    {"[<>]?[:;=][\\-o\\*']?[()DPdpO\\\\{@|\\[\\]]", "[^A-Za-z0-9]", Act::Parens},
    {ASIAN_SMILEY_EYE "_" ASIAN_SMILEY_EYE "|\\(" ASIAN_SMILEY_EYE "[_.]?" ASIAN_SMILEY_EYE "\\)", nullptr,
     Act::Parens},
    {"\\{", nullptr, Act::OpenBrace},
    {"\\}", nullptr, Act::CloseBrace},
    {"\\[", nullptr, Act::OpenSquare},
    {"\\]", nullptr, Act::CloseSquare},
    {"\\(", nullptr, Act::OpenParen},
    {"\\)", nullptr, Act::CloseParen},
    {"-+", nullptr, Act::Hyphens},
    {"\\.{3,5}|(\\.[ \\u00A0]){2,4}\\.|[\\u0085\\u2026]", nullptr, Act::Ellipsis},
    {"@+|#+|_+", nullptr, Act::Keep},
    {"\\*+|(\\\\\\*){1,3}", nullptr, Act::Keep},
    {"[,;:\\u3001]", nullptr, Act::Keep},
    {"[?!]+", nullptr, Act::Keep},
    {"[.\\u00A1\\u00BF\\u037E\\u0589\\u061F\\u06D4\\u0700-\\u0702\\u07FA\\u3002]", nullptr, Act::Keep},
    {"=", nullptr, Act::Keep},
    {"/", nullptr, Act::Keep},
    {"[A-Za-z0-9][A-Za-z0-9.,\\u00AD]*(-([A-Za-z0-9\\u00AD]+|" ACRO2 "\\.))+\\.", "[,;:\\u3001]", Act::Word},
    {"[A-Za-z0-9][A-Za-z0-9.,\\u00AD]*(-([A-Za-z0-9\\u00AD]+|" ACRO2 "\\.))+", nullptr, Act::Word},
    {"([dDoOlL]" APOSX ALNUM ")?" ALNUM "+(" HYPHEN "([dDoOlL]" APOSX ALNUM ")?" ALNUM "+)*\\.", "[,;:\\u3001]",
     Act::Keep},
    {"([dDoOlL]" APOSX ALNUM ")?" ALNUM "+(" HYPHEN "([dDoOlL]" APOSX ALNUM ")?" ALNUM "+)*", nullptr,
     Act::Keep},
    {"[A-Z]+(([+&]|&amp;)[A-Z]+)+\\.", "[,;:\\u3001]", Act::Amp},
    {"[A-Z]+(([+&]|&amp;)[A-Z]+)+", nullptr, Act::Amp},
    {"'", "[A-Za-z][^ \\t\\n\\r\\u00A0]", Act::QuoteLeft},
    {REDAUX, nullptr, Act::QuoteRight},
    {APOS "|''|" QUOTE_CHARS "{1,2}", nullptr, Act::QuoteRight},
    {"<<|>>", nullptr, Act::Keep},
    {MISC_SYMBOL, nullptr, Act::Keep},
    {"\\0|" SPACE "+|[\\u200B\\u200E\\u200F\\uFEFF]", nullptr, Act::Skip},
    {NEWLINE, nullptr, Act::Newline},
    {"&nbsp;", nullptr, Act::Skip},
    {".", nullptr, Act::Delete},
};

struct CompiledRule {
  Pattern token, context;
  bool has_context;
  Act act;
  std::array<uint64_t, 2> ascii_start{};  // which ASCII characters can begin a match
};

struct Scanner {
  std::vector<CompiledRule> rules;

  Scanner() {
    for (const Rule& r : kRules) {
      CompiledRule c{Pattern(r.token, true), Pattern(r.context ? r.context : "x", true), r.context != nullptr,
                     r.act, {}};
      for (char32_t ch = 0; ch < 128; ++ch)
        if (c.token.can_start_with(ch)) c.ascii_start[ch / 64] |= uint64_t{1} << (ch % 64);
      rules.push_back(std::move(c));
    }
  }
};

const Scanner& scanner() {
  static const Scanner s;
  return s;
}

// Quote characters → PTB quotes, as an opening or closing quote.
std::u32string latex_quotes(std::u32string_view tok, bool left) {
  std::u32string out;
  for (size_t i = 0; i < tok.size(); ++i) {
    const char32_t c = tok[i];
    auto entity = [&](std::u32string_view e) { return tok.substr(i, e.size()) == e; };
    if (c == U'&' && entity(U"&apos;")) {
      out += left ? U"`" : U"'";
      i += 5;
    } else if (c == U'&' && entity(U"&quot;")) {
      out += left ? U"``" : U"''";
      i += 5;
    } else if (c == U'\'') {
      out += left ? U"`" : U"'";
    } else if (c == U'"') {
      out += left ? U"``" : U"''";
    } else if (c == 0x91 || c == 0x2018 || c == 0x201B || c == 0x2039) {
      out += U'`';
    } else if (c == 0x92 || c == 0x2019 || c == 0x203A) {
      out += U'\'';
    } else if (c == 0x93 || c == 0x201C || c == 0xAB) {
      out += U"``";
    } else if (c == 0x94 || c == 0x201D || c == 0xBB) {
      out += U"''";
    } else {
      out += c;
    }
  }
  return out;
}

std::u32string replace_all(std::u32string s, std::u32string_view from, std::u32string_view to) {
  for (size_t i = 0; (i = s.find(from, i)) != std::u32string::npos; i += to.size()) s.replace(i, from.size(), to);
  return s;
}

std::u32string caseless_amp(std::u32string s) {
  for (size_t i = 0; i + 5 <= s.size(); ++i)
    if (s[i] == U'&' && to_lower(s.substr(i, 5)) == U"&amp;") s.replace(i, 5, U"&");
  return s;
}

std::u32string paren_names(std::u32string s) {
  return replace_all(replace_all(std::move(s), U"(", U"-LRB-"), U")", U"-RRB-");
}

std::u32string without(std::u32string s, char32_t c) {
  std::u32string out;
  for (char32_t x : s)
    if (x != c) out += x;
  return out;
}

}  // namespace

std::string ptb_tokenize(std::string_view text) {
  const std::u32string in = utf8_decode(text, "caption text");
  const Scanner& sc = scanner();
  std::string out;
  bool line_start = true;
  std::vector<size_t> ends;
  auto emit = [&](const std::u32string& tok) {
    if (!line_start) out += ' ';
    out += utf8_encode(to_lower(tok));
    line_start = false;
  };
  size_t pos = 0;
  while (pos < in.size()) {
    const char32_t c0 = in[pos];
    // JFlex scans UTF-16 code units: a code point beyond the BMP is two untokenizable units.
    if (c0 > 0xFFFF) {
      ++pos;
      continue;
    }
    size_t best_total = 0, best_end = 0;
    const CompiledRule* best = nullptr;
    for (const CompiledRule& r : sc.rules) {
      if (c0 < 128 && !(r.ascii_start[c0 / 64] >> (c0 % 64) & 1)) continue;
      ends.clear();
      r.token.match_ends(in, pos, ends);
      for (size_t e : ends) {
        if (e == pos) continue;
        size_t total = e;
        if (r.has_context) {
          const size_t t = r.context.longest(in, e);
          if (t == SIZE_MAX) continue;
          total = t;
        }
        if (total > best_total || (best == &r && total == best_total)) {
          best_total = total;
          best_end = e;
          best = &r;
        }
      }
    }
    if (!best) throw InternalError("ptb_tokenize: no rule matched at " + std::to_string(pos));
    const std::u32string tok = in.substr(pos, best_end - pos);
    size_t next = best_end;
    switch (best->act) {
      case Act::Keep: emit(tok); break;
      case Act::Word: emit(without(tok, 0x00AD).empty() ? U"-" : without(tok, 0x00AD)); break;
      case Act::Pushback2: next = best_end - 2, emit(tok.substr(0, tok.size() - 2)); break;
      case Act::Pushback3: next = best_end - 3, emit(tok.substr(0, tok.size() - 3)); break;
      case Act::Dash: emit(U"--"); break;
      case Act::Amp: emit(caseless_amp(tok)); break;
      case Act::QuoteLeft: emit(latex_quotes(tok, true)); break;
      case Act::QuoteRight: emit(latex_quotes(tok, false)); break;
      case Act::Ellipsis: emit(U"..."); break;
      case Act::OpenParen: emit(U"-LRB-"); break;
      case Act::CloseParen: emit(U"-RRB-"); break;
      case Act::OpenBrace: emit(U"-LCB-"); break;
      case Act::CloseBrace: emit(U"-RCB-"); break;
      case Act::OpenSquare: emit(U"-LSB-"); break;
      case Act::CloseSquare: emit(U"-RSB-"); break;
      case Act::Hyphens: emit(tok.size() == 3 || tok.size() == 4 ? U"--" : tok); break;
      case Act::Acronym:
        if (tok.size() == 2) {
          emit(tok.substr(0, 1));
          next = pos + 1;
        } else {
          emit(tok);
          next = best_end - 1;
        }
        break;
      case Act::AbbrevEnd: emit(tok), next = best_end - 1; break;
      case Act::Spaced: emit(replace_all(tok, U" ", U"\u00A0")); break;
      case Act::Fraction: {
        const char32_t f = tok[0];
        emit(f == 0xBC ? U"1/4" : f == 0xBD ? U"1/2" : f == 0xBE ? U"3/4" : f == 0x2153 ? U"1/3"
             : f == 0x2154 ? U"2/3" : tok);
        break;
      }
      case Act::Currency: {
        const char32_t f = tok[0];
        emit(f == 0xA2 ? U"cents" : f == 0xA3 ? U"#" : (f == 0x80 || f == 0xA4 || f == 0x20A0 || f == 0x20AC) ? U"$" : tok);
        break;
      }
      case Act::Parens: emit(paren_names(replace_all(tok, U" ", U"\u00A0"))); break;
      case Act::Less: emit(U"<"); break;
      case Act::Greater: emit(U">"); break;
      case Act::Skip: case Act::Delete: break;
      case Act::Newline: out += '\n', line_start = true; break;
    }
    pos = next;
  }
  return out;
}

bool is_coco_punctuation(std::string_view t) {
  static const char* const kPunct[] = {"''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".",
                                       "?",  "!", ",",  ":", "-",     "--",    "...",   ";"};
  for (const char* p : kPunct)
    if (t == p) return true;
  return false;
}

namespace {

// Python's str.isspace() over the code points that can end a tokenizer line.
bool py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

}  // namespace

std::vector<std::string> coco_tokenize(const std::vector<std::string>& captions) {
  std::string joined;
  for (size_t i = 0; i < captions.size(); ++i) {
    if (i) joined += '\n';
    for (char c : captions[i]) joined += c == '\n' ? ' ' : c;
  }
  const std::string tokens = ptb_tokenize(joined);
  std::vector<std::string> out;
  size_t start = 0;
  while (out.size() < captions.size() && start <= tokens.size()) {
    size_t end = tokens.find('\n', start);
    if (end == std::string::npos) end = tokens.size();
    std::u32string line = utf8_decode(std::string_view(tokens).substr(start, end - start), "tokenized caption");
    while (!line.empty() && py_space(line.back())) line.pop_back();
    const std::string l = utf8_encode(line);
    std::string kept;
    bool first = true;
    for (size_t b = 0; b <= l.size();) {
      size_t e = l.find(' ', b);
      if (e == std::string::npos) e = l.size();
      const std::string_view t = std::string_view(l).substr(b, e - b);
      if (!is_coco_punctuation(t)) {
        if (!first) kept += ' ';
        kept += t;
        first = false;
      }
      b = e + 1;
    }
    out.push_back(kept);
    start = end + 1;
  }
  return out;
}

}  // namespace kvlens
