// Caption tokenization as the COCO caption evaluation (pycocoevalcap) does it: Stanford
// CoreNLP 3.4.1's PTBTokenizer run with -preserveLines -lowerCase, then the punctuation tokens
// of pycocoevalcap's list removed. kvlens reproduces that tokenizer's observable behaviour for
// English text: contractions and clitics ("it's" → "it 's", "can't" → "ca n't", "cannot" →
// "can not", "gonna" → "gon na"), quotes (`` '' ` '), brackets (-lrb- -rrb- -lsb- -rsb- -lcb-
// -rcb-, lower-cased, so pycocoevalcap's "-LRB-" entries never remove them), hyphenated words
// kept whole, abbreviations and acronyms ("u.s.", "mr.", a repeated sentence-final period),
// numbers, fractions, currency, ellipses, dashes, URLs, e-mail addresses, SGML tags, smileys and
// the CP1252 characters it maps. tests/fixtures/coco holds strings tokenized by the real
// tokenizer that the tests compare against; characters outside core/eval/unicode_text.h's blocks may
// be classified differently.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace kvlens {

// The tokenizer's output for `text` (UTF-8): tokens lower-cased and joined by single spaces,
// one output line per input line break. Throws InputError on invalid UTF-8.
std::string ptb_tokenize(std::string_view text);

// The tokens pycocoevalcap drops after tokenization: '' ' `` ` -LRB- -RRB- -LCB- -RCB- . ? ! ,
// : - -- ... ;
bool is_coco_punctuation(std::string_view token);

// pycocoevalcap's PTBTokenizer.tokenize over one list of captions: each caption's '\n' becomes
// a space, the captions are joined by '\n' and tokenized as one text, the output lines are
// paired with the captions in order and punctuation tokens are removed. Other line breaks
// inside a caption (\r, U+2028, U+2029, \v, \f) split its output line, so later captions
// receive the lines of earlier ones, exactly as in pycocoevalcap; the result then has more
// lines than captions and the extra ones are dropped. (Every joining '\n' ends a line, so there
// are never fewer lines than captions.)
std::vector<std::string> coco_tokenize(const std::vector<std::string>& captions);

}  // namespace kvlens
