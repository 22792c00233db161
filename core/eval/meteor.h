// METEOR 1.5 as pycocoevalcap computes it: the meteor-1.5.jar shipped in the pycocoevalcap
// package, run as `java -jar -Xmx2G meteor-1.5.jar - - -stdio -l en -norm` in the jar's folder.
// For each image one "SCORE ||| ref ||| ... ||| hypothesis" line (the hypothesis with "|||"
// removed and double spaces made single) returns the image's statistics; one "EVAL ||| stats
// ||| ..." line then returns each image's score and the corpus score, which is the value
// reported. kvlens never approximates METEOR: without Java or the jar it is reported missing.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/eval/caption_metrics.h"

namespace kvlens {

class Subprocess;

struct MeteorSetup {
  std::string java, jar;
  std::string status;  // why METEOR is unavailable; "" when java and jar were found
  bool available() const { return status.empty(); }
};

// Finds Java ($JAVA_HOME/bin/java, else java on PATH) and the jar: `jar` when given (it must
// exist), else pycocoevalcap/meteor/meteor-1.5.jar of the first of `pythons` that imports
// pycocoevalcap.
MeteorSetup find_meteor(const std::string& jar, const std::vector<std::string>& pythons);

class MeteorScorer {
 public:
  // Starts the scorer; throws InputError naming the jar when it cannot run.
  explicit MeteorScorer(const MeteorSetup& setup);
  ~MeteorScorer();
  // The corpus METEOR score of tokenized captions (one hypothesis per image).
  double score(const TokenizedCorpus& c);

 private:
  std::string what_;
  std::unique_ptr<Subprocess> proc_;
  bool started_ = false;
};

}  // namespace kvlens
