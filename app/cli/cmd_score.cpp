// kvlens score: a COCO-format results file against COCO caption annotations, with the metrics
// pycocoevalcap reports (BLEU-1..4, METEOR, ROUGE-L, CIDEr-D).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "app/cli/commands.h"
#include "app/cli/defaults.h"
#include "core/eval/coco.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/eval/meteor.h"

namespace kvlens::app {

std::unique_ptr<MeteorScorer> start_meteor(const MeteorOptions& o, std::string& status) {
  if (o.off) {
    status = "METEOR not computed (--no-meteor)";
    return nullptr;
  }
  const char* env = std::getenv("KVLENS_METEOR_JAR");
  const MeteorSetup setup = find_meteor(!o.jar.empty() ? o.jar : env ? env : "", meteor_pythons());
  status = setup.status;
  return setup.available() ? std::make_unique<MeteorScorer>(setup) : nullptr;
}

void add_meteor_options(CLI::App* c, MeteorOptions& o) {
  c->add_option("--meteor-jar", o.jar,
                "METEOR 1.5 jar (default: $KVLENS_METEOR_JAR, else pycocoevalcap's meteor-1.5.jar found through python3)");
  c->add_flag("--no-meteor", o.off, "Skip METEOR (it starts a Java process that loads for several seconds)");
}

void print_scores(const CaptionScores& s) {
  for (const std::string& m : caption_metric_names()) {
    const double v = metric_value(s, m);
    if (std::isnan(v))
      std::printf("%-8s unavailable: %s\n", m.c_str(), s.meteor_status.c_str());
    else
      std::printf("%-8s %.6f\n", m.c_str(), v);
  }
  for (const std::string& w : s.warnings) std::fprintf(stderr, "kvlens: warning: %s\n", w.c_str());
}

namespace {

struct ScoreArgs {
  std::string annotations, results, json_out;
  MeteorOptions meteor;
};

void run_score(const ScoreArgs& a) {
  if (!a.json_out.empty()) check_writable(a.json_out, "scores JSON");
  const CocoAnnotations ann = load_coco_annotations(a.annotations);
  const std::vector<CocoResult> res = load_coco_results(a.results);
  std::string status;
  const std::unique_ptr<MeteorScorer> meteor = start_meteor(a.meteor, status);
  const CaptionScores s = score_captions(ann, res, meteor.get(), status);
  std::printf("%zu images\n", s.images);
  print_scores(s);
  if (!a.json_out.empty()) {
    nlohmann::json j = s.to_json();
    j["images"] = s.images;
    if (!s.meteor) j["METEOR_status"] = s.meteor_status;
    if (!s.warnings.empty()) j["warnings"] = s.warnings;
    j["annotations"] = a.annotations;
    j["results"] = a.results;
    write_file_atomic(a.json_out, j.dump(1) + "\n", "scores JSON");
  }
}

}  // namespace

void add_score_command(CLI::App& root) {
  auto a = std::make_shared<ScoreArgs>();
  CLI::App* c = root.add_subcommand(
      "score", "Score a COCO results file against COCO caption annotations (BLEU-1..4, METEOR, ROUGE-L, CIDEr-D)");
  c->add_option("--annotations", a->annotations, "COCO caption annotations (captions_val2014.json layout)")->required();
  c->add_option("--results", a->results, "COCO results: [{\"image_id\", \"caption\"}], one per image")->required();
  c->add_option("--json", a->json_out, "Write the scores as JSON (keys BLEU-1 ... CIDEr-D)");
  add_meteor_options(c, a->meteor);
  c->footer(
      "Computed as pycocoevalcap 1.2 does: the images of the results file, in the annotations' order; captions "
      "tokenized as its Stanford PTBTokenizer does, punctuation removed; BLEU corpus-level with the closest "
      "reference length; ROUGE-L with beta 1.2; CIDEr-D with sigma 6 and document frequencies from these "
      "references. METEOR runs pycocoevalcap's meteor-1.5.jar in Java when both are installed, and is reported "
      "unavailable otherwise.");
  c->callback([a] { run_score(*a); });
}

}  // namespace kvlens::app
