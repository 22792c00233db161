// Caption metrics computed the way the COCO caption evaluation (pycocoevalcap 1.2) computes
// them, on captions already tokenized by coco_tokenize (core/eval/ptb_tokenizer.h):
//   BLEU-1..4  corpus level: clipped n-gram counts summed over images, the reference length
//              closest to each candidate (the shorter on a tie), brevity penalty
//              exp(1 − r/c) when c < r, and pycocoevalcap's smoothing of every ratio as
//              (correct + 1e-15) / (guessed + 1e-9);
//   ROUGE-L    per image F-score of the longest common subsequence with β = 1.2, precision and
//              recall each the best over the references, averaged over images;
//   CIDEr-D    n = 1..4, tf-idf vectors with document frequencies over the evaluated images'
//              references, the candidate's weights clipped at the reference's, a Gaussian
//              penalty exp(−δ²/(2σ²)) on the difference δ of bigram counts, σ = 6, averaged
//              over n and references, × 10, averaged over images.
// Like pycocoevalcap, BLEU and CIDEr-D split on any white space and ROUGE-L on single spaces.
#pragma once
#include <array>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvlens {

// One candidate and its references per image, tokenized.
struct TokenizedCorpus {
  std::vector<std::vector<std::string>> refs;
  std::vector<std::string> cands;
};

// Throws InputError when the sizes differ or an image has no reference.
std::array<double, 4> bleu_scores(const TokenizedCorpus& c);
double rouge_l_score(const TokenizedCorpus& c);
double cider_d_score(const TokenizedCorpus& c);

// CIDEr-D's document frequencies: for each n-gram, the number of images whose references hold
// it, over `refs` (one list of tokenized references per image), and log of the image count.
struct CiderDocuments {
  std::unordered_map<std::string, double> df;
  double log_images = 0;
};
CiderDocuments cider_documents(const std::vector<std::vector<std::string>>& refs);
// One tokenized candidate's CIDEr-D against its tokenized references with the frequencies `d`
// (what cider_d_per_image gives that image when `d` comes from the same corpus). Throws
// InputError without references.
double cider_d_one(const CiderDocuments& d, const std::vector<std::string>& refs, const std::string& cand);

// Per-image values (pycocoevalcap's imgToEval).
std::vector<double> rouge_l_per_image(const TokenizedCorpus& c);
std::vector<double> cider_d_per_image(const TokenizedCorpus& c);

// Python's str.split() (any Unicode white space, runs collapsed) and str.split(" ").
std::vector<std::string> split_whitespace(const std::string& s);
std::vector<std::string> split_spaces(const std::string& s);

}  // namespace kvlens
