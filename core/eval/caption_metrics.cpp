#include "core/eval/caption_metrics.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <unordered_map>

#include "core/errors.h"
#include "core/eval/unicode_text.h"

namespace kvlens {

namespace {

constexpr int kMaxN = 4;

void check(const TokenizedCorpus& c) {
  if (c.refs.size() != c.cands.size())
    throw InputError("caption metrics: " + std::to_string(c.cands.size()) + " candidates for " +
                     std::to_string(c.refs.size()) + " images");
  for (size_t i = 0; i < c.refs.size(); ++i)
    if (c.refs[i].empty()) throw InputError("caption metrics: image #" + std::to_string(i) + " has no reference");
}

bool py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// n-gram (n = 1..4) counts of a token list; an n-gram is its words joined by '\x1f'.
using Counts = std::unordered_map<std::string, int>;

Counts ngram_counts(const std::vector<std::string>& w) {
  Counts c;
  for (int n = 1; n <= kMaxN; ++n)
    for (size_t i = 0; i + n <= w.size(); ++i) {
      std::string g = w[i];
      for (int k = 1; k < n; ++k) g += '\x1f' + w[i + k];
      ++c[g];
    }
  return c;
}

int order(const std::string& gram) { return 1 + static_cast<int>(std::count(gram.begin(), gram.end(), '\x1f')); }

}  // namespace

std::vector<std::string> split_whitespace(const std::string& s) {
  const std::u32string u = utf8_decode(s, "caption");
  std::vector<std::string> out;
  std::u32string cur;
  for (char32_t c : u) {
    if (py_space(c)) {
      if (!cur.empty()) out.push_back(utf8_encode(cur)), cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(utf8_encode(cur));
  return out;
}

std::vector<std::string> split_spaces(const std::string& s) {
  std::vector<std::string> out;
  size_t b = 0;
  for (;;) {
    const size_t e = s.find(' ', b);
    if (e == std::string::npos) {
      out.push_back(s.substr(b));
      return out;
    }
    out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
}

std::array<double, 4> bleu_scores(const TokenizedCorpus& c) {
  check(c);
  constexpr double kSmall = 1e-9, kTiny = 1e-15;
  double testlen = 0, reflen = 0;
  std::array<double, kMaxN> guess{}, correct{};
  for (size_t i = 0; i < c.cands.size(); ++i) {
    // Reference side: each n-gram's largest count over the references, and their lengths.
    Counts maxref;
    std::vector<size_t> lens;
    for (const std::string& r : c.refs[i]) {
      const std::vector<std::string> w = split_whitespace(r);
      lens.push_back(w.size());
      for (const auto& [g, n] : ngram_counts(w)) maxref[g] = std::max(maxref[g], n);
    }
    const std::vector<std::string> w = split_whitespace(c.cands[i]);
    const long tl = static_cast<long>(w.size());
    // The closest reference length; on a tie the shorter one.
    long best = -1;
    for (size_t l : lens) {
      const long d = std::labs(static_cast<long>(l) - tl);
      if (best < 0 || d < std::labs(best - tl) || (d == std::labs(best - tl) && static_cast<long>(l) < best))
        best = static_cast<long>(l);
    }
    testlen += tl;
    reflen += best;
    for (int k = 0; k < kMaxN; ++k) guess[k] += std::max(0L, tl - k);
    for (const auto& [g, n] : ngram_counts(w)) {
      const auto it = maxref.find(g);
      correct[order(g) - 1] += std::min(n, it == maxref.end() ? 0 : it->second);
    }
  }
  std::array<double, 4> out{};
  double prod = 1;
  for (int k = 0; k < kMaxN; ++k) {
    prod *= (correct[k] + kTiny) / (guess[k] + kSmall);
    out[k] = std::pow(prod, 1.0 / (k + 1));
  }
  const double ratio = (testlen + kTiny) / (reflen + kSmall);
  if (ratio < 1)
    for (double& b : out) b *= std::exp(1 - 1 / ratio);
  return out;
}

std::vector<double> rouge_l_per_image(const TokenizedCorpus& c) {
  check(c);
  constexpr double kBeta = 1.2;
  std::vector<double> scores;
  for (size_t i = 0; i < c.cands.size(); ++i) {
    const std::vector<std::string> cand = split_spaces(c.cands[i]);
    double pmax = 0, rmax = 0;
    for (const std::string& r : c.refs[i]) {
      const std::vector<std::string> ref = split_spaces(r);
      // Longest common subsequence length, one row at a time.
      std::vector<int> prev(cand.size() + 1, 0), cur(cand.size() + 1, 0);
      for (size_t a = 1; a <= ref.size(); ++a) {
        for (size_t b = 1; b <= cand.size(); ++b)
          cur[b] = ref[a - 1] == cand[b - 1] ? prev[b - 1] + 1 : std::max(prev[b], cur[b - 1]);
        std::swap(prev, cur);
      }
      const double lcs = prev[cand.size()];
      pmax = std::max(pmax, lcs / cand.size());
      rmax = std::max(rmax, lcs / ref.size());
    }
    scores.push_back(pmax != 0 && rmax != 0 ? (1 + kBeta * kBeta) * pmax * rmax / (rmax + kBeta * kBeta * pmax) : 0.0);
  }
  return scores;
}

double rouge_l_score(const TokenizedCorpus& c) {
  const std::vector<double> s = rouge_l_per_image(c);
  double sum = 0;
  for (double x : s) sum += x;
  return s.empty() ? 0.0 : sum / s.size();
}

namespace {

constexpr double kSigma = 6.0;

struct CiderVec {
  std::array<std::unordered_map<std::string, double>, kMaxN> w;
  std::array<double, kMaxN> norm{};
  double bigrams = 0;
};

CiderVec cider_vec(const CiderDocuments& d, const Counts& counts) {
  CiderVec v;
  for (const auto& [g, tf] : counts) {
    const auto it = d.df.find(g);
    const double idf = d.log_images - std::log(std::max(1.0, it == d.df.end() ? 0.0 : it->second));
    const int n = order(g) - 1;
    const double x = tf * idf;
    v.w[n][g] = x;
    v.norm[n] += x * x;
    if (n == 1) v.bigrams += tf;
  }
  for (double& x : v.norm) x = std::sqrt(x);
  return v;
}

double cider_d_counts(const CiderDocuments& d, const std::vector<Counts>& refs, const Counts& cand) {
  const CiderVec h = cider_vec(d, cand);
  std::array<double, kMaxN> sum{};
  for (const Counts& rc : refs) {
    const CiderVec r = cider_vec(d, rc);
    const double delta = h.bigrams - r.bigrams;
    for (int n = 0; n < kMaxN; ++n) {
      double val = 0;
      for (const auto& [g, x] : h.w[n]) {
        const auto it = r.w[n].find(g);
        const double y = it == r.w[n].end() ? 0.0 : it->second;
        val += std::min(x, y) * y;
      }
      if (h.norm[n] != 0 && r.norm[n] != 0) val /= h.norm[n] * r.norm[n];
      sum[n] += val * std::exp(-(delta * delta) / (2 * kSigma * kSigma));
    }
  }
  double mean = 0;
  for (double x : sum) mean += x / kMaxN;
  return mean / refs.size() * 10.0;
}

std::vector<Counts> ref_counts(const std::vector<std::string>& refs) {
  std::vector<Counts> out;
  for (const std::string& r : refs) out.push_back(ngram_counts(split_whitespace(r)));
  return out;
}

// The document frequencies of images whose references are counted already.
CiderDocuments documents_of(const std::vector<std::vector<Counts>>& refs) {
  CiderDocuments d;
  for (const std::vector<Counts>& image : refs) {
    std::set<std::string> seen;
    for (const Counts& c : image)
      for (const auto& kv : c) seen.insert(kv.first);
    for (const std::string& g : seen) d.df[g] += 1;
  }
  d.log_images = std::log(static_cast<double>(refs.size()));
  return d;
}

}  // namespace

CiderDocuments cider_documents(const std::vector<std::vector<std::string>>& refs) {
  std::vector<std::vector<Counts>> counts;
  for (const std::vector<std::string>& image : refs) counts.push_back(ref_counts(image));
  return documents_of(counts);
}

double cider_d_one(const CiderDocuments& d, const std::vector<std::string>& refs, const std::string& cand) {
  if (refs.empty()) throw InputError("CIDEr-D: a candidate without references");
  return cider_d_counts(d, ref_counts(refs), ngram_counts(split_whitespace(cand)));
}

std::vector<double> cider_d_per_image(const TokenizedCorpus& c) {
  check(c);
  std::vector<std::vector<Counts>> refs;  // (counted once: for the frequencies and the scores)
  for (const std::vector<std::string>& image : c.refs) refs.push_back(ref_counts(image));
  const CiderDocuments d = documents_of(refs);
  std::vector<double> scores;
  for (size_t i = 0; i < c.cands.size(); ++i)
    scores.push_back(cider_d_counts(d, refs[i], ngram_counts(split_whitespace(c.cands[i]))));
  return scores;
}

double cider_d_score(const TokenizedCorpus& c) {
  const std::vector<double> s = cider_d_per_image(c);
  double sum = 0;
  for (double x : s) sum += x;
  return s.empty() ? 0.0 : sum / s.size();
}

}  // namespace kvlens
