// Added and special tokens by their text, split out of a text before the rest is encoded, as HF
// tokenizers do: at each position the longest one that starts there. The byte-level BPE and the
// SentencePiece tokenizer (models/tokenizer.h) both split this way.
#pragma once
#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace kvlens {

struct AddedToken {
  std::string content;  // never empty
  int id = -1;
  bool special = false;
};

// Orders tokens longest first, the order split_added_tokens takes them in.
inline void sort_longest_first(std::vector<AddedToken>& added) {
  std::stable_sort(added.begin(), added.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
}

// Calls on_text(stretch, offset) for each stretch of `text` between tokens (none for an empty
// one) and on_token(token) for each token, in text order; `added` longest first.
template <class OnText, class OnToken>
void split_added_tokens(const std::string& text, const std::vector<AddedToken>& added, OnText&& on_text,
                        OnToken&& on_token) {
  size_t start = 0, i = 0;
  while (i < text.size()) {
    const AddedToken* hit = nullptr;
    for (const AddedToken& a : added)
      if (text.compare(i, a.content.size(), a.content) == 0) {
        hit = &a;
        break;
      }
    if (!hit) {
      ++i;
      continue;
    }
    if (i > start) on_text(text.substr(start, i - start), start);
    on_token(*hit);
    i += hit->content.size();
    start = i;
  }
  if (start < text.size()) on_text(text.substr(start), start);
}

}  // namespace kvlens
