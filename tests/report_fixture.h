// The run report the figure tests read: the HF-layout fixture model with calibquant (calibrating),
// streamingllm (evicting) and LOOK-M (merging), built once; and the small helpers they share.
#pragma once
#include <memory>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "app/figures/figures.h"
#include "app/lab/experiment.h"
#include "core/data/image.h"
#include "tests/test_util.h"

namespace kvlens::testing {

// One report of the fixture model: calibquant (calibrating), streamingllm (evicting), LOOK-M
// (merging evicted visual rows into kept ones).
inline const nlohmann::json& report() {
  static const nlohmann::json r = [] {
    const std::string dir = source_dir() + "/tests/fixtures/hf/mha_fp32_hub";
    const std::unique_ptr<Model> model_owned = load_model(dir);
    const Model& model = *model_owned;
    ExperimentOptions opt;
    opt.max_new_tokens = 6;
    opt.diag_steps = 3;
    opt.hit_steps = {0, 2};
    opt.attention_maps = true;
    Experiment ex = start_experiment(model, load_image(dir + "/image.png"), opt);
    for (const char* spec : {"calibquant:bits=1,tau1=0.5,tau2=2", "streamingllm:budget=0.3", "lookm:alpha2=0.5,text_prior=false,merge=average"})
      ex.runs.push_back(run_method(model, ex, parse_method_spec(spec), opt));
    return experiment_json(model, ex, opt);
  }();
  return r;
}

inline double measure(const std::string& s, double size) { return 0.55 * size * static_cast<double>(s.size()); }

inline const fig::Series& by_label(const fig::Figure& f, const std::string& label) {
  for (const fig::Series& s : f.series)
    if (s.label == label) return s;
  throw std::runtime_error("no series " + label + " in " + f.id);
}

}  // namespace kvlens::testing
