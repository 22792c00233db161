// A method's caption against the full cache's, word by word (the Captions panel): which words
// differ, and what the full cache said in their place.
#pragma once
#include <string>
#include <vector>

namespace kvlens::gui {

// The caption's words split on white space.
std::vector<std::string> caption_words(const std::string& s);

// Word i of the method's caption against a longest common subsequence with the full cache's:
// `differs` when it is not in it; on the first word of each run of differing words,
// `replaced` holds the full cache's words in the same gap ("" when it had none there: words
// added); on a word that follows a gap where the full cache had words and the method none
// (words dropped), `dropped` holds them; words dropped after the method's last word are
// `dropped_after` of that word.
struct WordDiff {
  bool differs = false;
  std::string replaced, dropped, dropped_after;
};
std::vector<WordDiff> caption_word_diff(const std::vector<std::string>& full, const std::vector<std::string>& method);

}  // namespace kvlens::gui
