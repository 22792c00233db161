// What the CLI writes, read back: `caption --dump-logits` against HF's logits, and the reports
// `run --report` and `run --session` write against the same run done in-process, against HF's
// greedy ids and against the report's own definitions (means of its per-layer numbers, ratios
// of its byte counts, histogram totals, hit-rate shapes).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <numeric>
#include <set>

#include <nlohmann/json.hpp>

#include "app/lab/session.h"
#include "app/lab/experiment.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;

namespace {

const std::string kFix = kt::source_dir() + "/tests/fixtures/hf/mha_fp32_hub";

using kt::read_json;

// max |a − b| / max |b|
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    d = std::max(d, std::fabs(static_cast<double>(a[i]) - b[i]));
    m = std::max(m, std::fabs(static_cast<double>(b[i])));
  }
  return d / m;
}

// The checks every run report must pass against itself and against an in-process run of the
// same methods with the same options (both on the CPU backend: a GPU's report holds the GPU's
// numbers, compared with the CPU's in test_cuda_model).
void check_report(const nlohmann::json& j, const std::vector<Params>& specs, const ExperimentOptions& opt) {
  const std::unique_ptr<Model> model_owned = load_model(kFix);
  const Model& model = *model_owned;
  const auto hf = read_json(kFix + "/expected.json");
  const Experiment ex = start_experiment(model, load_image(kFix + "/image.png"), opt);
  // Options and the full-cache reference.
  EXPECT_EQ(j["options"]["max_new_tokens"], opt.max_new_tokens);
  EXPECT_EQ(j["options"]["diag_steps"], opt.diag_steps);
  EXPECT_DOUBLE_EQ(j["options"]["sparsity_p"].get<double>(), opt.sparsity_p);
  EXPECT_DOUBLE_EQ(j["options"]["hit_budget"].get<double>(), opt.hit_budget);
  EXPECT_EQ(j["prompt_ids"], hf["prompt_ids"]);
  const auto full_ids = j["full"]["generated_ids"].get<std::vector<int>>();
  const auto greedy = hf["greedy_ids"].get<std::vector<int>>();
  ASSERT_EQ(full_ids.size(), static_cast<size_t>(opt.max_new_tokens));
  EXPECT_TRUE(std::equal(full_ids.begin(), full_ids.end(), greedy.begin())) << j["full"]["generated_ids"].dump();
  EXPECT_NE(j["definitions"]["softmax_kl"].get<std::string>().find("KL(full || method)"), std::string::npos);
  // CacheHitRate: k = floor(budget · T) (at least 1, as the report defines it), rates[strategy][step][layer]
  // in [0, 1] in steps of 1/k.
  const auto& hr = j["cache_hit_rate"];
  const int T = static_cast<int>(j["prompt_ids"].size()), L = model.info().n_layers;
  EXPECT_EQ(hr["k"], std::max(1, static_cast<int>(std::floor(opt.hit_budget * T + 1e-6))));
  ASSERT_EQ(hr["rates"].size(), 5u);
  for (const auto& [name, per_step] : hr["rates"].items()) {
    ASSERT_EQ(per_step.size(), hr["steps"].size()) << name;
    for (const auto& per_layer : per_step) {
      ASSERT_EQ(per_layer.size(), static_cast<size_t>(L));
      for (const auto& r : per_layer) {
        const double x = r.get<double>() * hr["k"].get<int>();
        EXPECT_NEAR(x, std::round(x), 1e-9) << name;
        EXPECT_GE(r.get<double>(), 0.0);
        EXPECT_LE(r.get<double>(), 1.0);
      }
    }
  }
  EXPECT_EQ(hr["rates"]["recency"], nlohmann::json(ex.hit_rates.rates[4]));
  // Each method: the same numbers as in-process, and consistent with themselves.
  ASSERT_EQ(j["methods"].size(), specs.size());
  const int64_t fp16 = j["full"]["bytes_fp16"]["total"].get<int64_t>();
  EXPECT_EQ(fp16, ex.full_fp16_bytes.total());
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& m = j["methods"][i];
    SCOPED_TRACE(specs[i].spec());
    EXPECT_EQ(m["spec"], specs[i].spec());
    const MethodRun r = run_method(model, ex, specs[i], opt);
    EXPECT_EQ(m["generated_ids"].get<std::vector<int>>(), r.result.generated_ids);
    EXPECT_EQ(m["same_as_full"].get<bool>(), r.result.generated_ids == full_ids);
    const auto& b = m["bytes_after_prefill"];
    EXPECT_EQ(b["total"].get<int64_t>(), r.result.bytes_after_prefill.total());
    EXPECT_EQ(b["total"].get<int64_t>(), b["codes"].get<int64_t>() + b["scales"].get<int64_t>() + b["zeros"].get<int64_t>() +
                                             b["indices"].get<int64_t>() + b["meta"].get<int64_t>());
    EXPECT_NEAR(m["compression_vs_fp16"].get<double>(), static_cast<double>(fp16) / b["total"].get<int64_t>(), 1e-12);
    EXPECT_NEAR(m["mean_softmax_mse"].get<double>(), r.mean_softmax_mse, 1e-12 + 1e-9 * r.mean_softmax_mse);
    ASSERT_EQ(m["layers"].size(), static_cast<size_t>(L));
    double mse = 0, kl = 0, err = 0;
    for (const auto& l : m["layers"]) {
      mse += l["softmax_mse"].get<double>() / L, kl += l["softmax_kl"].get<double>() / L;
      err += l["attn_output_rel_error"].get<double>() / L;
      const auto& h = l["visual_score_histogram"];
      const auto sum = [](const nlohmann::json& c) { return std::accumulate(c.begin(), c.end(), int64_t{0}, [](int64_t a, const nlohmann::json& x) { return a + x.get<int64_t>(); }); };
      // The same keys in all three: every query head's visual keys that the method kept.
      EXPECT_LE(sum(h["exact"]), static_cast<int64_t>(j["n_visual_tokens"].get<int>()) * model.info().n_heads);
      EXPECT_EQ(sum(h["exact"]), sum(h["quantized"]));
      EXPECT_EQ(sum(h["quantized"]), sum(h["calibrated"]));
      EXPECT_EQ(h["exact"].size(), h["quantized"].size()) << "shared bins, also where nothing was kept";
      EXPECT_LE(h["lo"].get<double>(), h["hi"].get<double>());
      EXPECT_EQ(l["token_fate"]["kept"].size(), static_cast<size_t>(j["n_visual_tokens"].get<int>()));
    }
    EXPECT_NEAR(m["mean_softmax_mse"].get<double>(), mse, 1e-12 + 1e-9 * mse);
    EXPECT_NEAR(m["mean_softmax_kl"].get<double>(), kl, 1e-12 + 1e-9 * kl);
    EXPECT_NEAR(m["mean_attn_output_rel_error"].get<double>(), err, 1e-12 + 1e-9 * err);
    // The first divergence names the first differing position of the two id lists.
    const auto ids = m["generated_ids"].get<std::vector<int>>();
    int first = -1;
    for (size_t p = 0; p < std::max(ids.size(), full_ids.size()) && first < 0; ++p)
      if (p >= ids.size() || p >= full_ids.size() || ids[p] != full_ids[p]) first = static_cast<int>(p);
    EXPECT_EQ(m["first_divergence"]["position"], first);
  }
}

}  // namespace

// The logits file holds the first step's logits (little-endian float32), equal to HF's within
// the parity criterion and to the in-process prefill's.
TEST(CliOutputs, DumpLogitsHoldsTheFirstStepLogits) {
  const std::string tmp = kt::make_temp_dir("dump");
  const auto r = kt::run(kt::cli() + " caption --backend cpu --model " + kFix + " --image " + kFix + "/image.png --max-new-tokens 2 --dump-logits " +
                         tmp + "/l.f32");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto got = kt::read_f32(tmp + "/l.f32");
  const auto hf = kt::read_f32(kFix + "/logits.f32");
  ASSERT_EQ(got.size(), hf.size());
  EXPECT_LE(rel_diff(got, hf), 1e-4);
  const auto exp = read_json(kFix + "/expected.json");
  const std::unique_ptr<Model> model_owned = load_model(kFix);
  const Model& model = *model_owned;
  const PrefillState st = model.prefill(load_image(kFix + "/image.png"), exp["prompt"].get<std::string>(), kDefaultTemplate, false);
  EXPECT_LE(rel_diff(got, st.logits), 1e-6);
  // The argmax is HF's first greedy token.
  EXPECT_EQ(std::max_element(got.begin(), got.end()) - got.begin(), exp["greedy_ids"][0].get<int>());
}

TEST(CliOutputs, RunReportReadsBack) {
  const std::string tmp = kt::make_temp_dir("report");
  const std::vector<std::string> specs = {"calibquant:bits=1", "streamingllm:budget=0.3", "stack:evict=h2o,quant=kivi,budget=0.5,residual=4,group=8"};
  std::string cmd = kt::cli() + " run --backend cpu --model " + kFix + " --image " + kFix +
                    "/image.png --max-new-tokens 5 --diag-steps 2 --sparsity-p 0.05 --hit-budget 0.25 --report " + tmp + "/r.json";
  for (const auto& s : specs) cmd += " --method '" + s + "'";
  const auto r = kt::run(cmd);
  ASSERT_EQ(r.code, 0) << r.output;
  ExperimentOptions opt;
  opt.max_new_tokens = 5, opt.diag_steps = 2, opt.sparsity_p = 0.05, opt.hit_budget = 0.25;
  std::vector<Params> ps;
  for (const auto& s : specs) ps.push_back(parse_method_spec(s));
  check_report(read_json(tmp + "/r.json"), ps, opt);
}

// A session sets the options and methods; the report and the saved session carry them.
TEST(CliOutputs, SessionRunReportAndSavedSessionReadBack) {
  const std::string tmp = kt::make_temp_dir("sessrep");
  kt::write_file(tmp + "/s.json", R"({"name": "t", "max_new_tokens": 4, "diag_steps": 3, "sparsity_p": 0.02,
    "hit_budget": 0.2, "methods": ["zipcache:saliency_ratio=0.3", {"method": "lookm", "params": {"merge": "average"}}]})");
  const auto r = kt::run(kt::cli() + " run --backend cpu --model " + kFix + " --image " + kFix + "/image.png --session " + tmp +
                         "/s.json --save-session " + tmp + "/saved.json --report " + tmp + "/r.json");
  ASSERT_EQ(r.code, 0) << r.output;
  const Session in = load_session(tmp + "/s.json");
  ExperimentOptions opt;
  opt.max_new_tokens = 4, opt.diag_steps = 3, opt.sparsity_p = 0.02, opt.hit_budget = 0.2;
  check_report(read_json(tmp + "/r.json"), in.methods, opt);
  const Session saved = load_session(tmp + "/saved.json");
  ASSERT_EQ(saved.methods.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(saved.methods[i].spec(), in.methods[i].spec());
  EXPECT_EQ(saved.max_new_tokens, 4);
  EXPECT_EQ(saved.diag_steps, 3);
  EXPECT_DOUBLE_EQ(saved.sparsity_p, 0.02);
  EXPECT_DOUBLE_EQ(saved.hit_budget, 0.2);
  EXPECT_EQ(saved.model, kFix);
}

// `cmd --trace DIR/t.json`: the run succeeds and prints the trace's totals; its trace (null when
// the run failed). Then the same with a trace in a missing folder: refused with exit code 2.
nlohmann::json traced(const std::string& cmd, const std::string& dir) {
  const auto r = kt::run(cmd + " --trace " + dir + "/t.json");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("trace " + dir + "/t.json:"), std::string::npos) << r.output;
  return r.code == 0 ? read_json(dir + "/t.json") : nlohmann::json();
}
kt::RunResult refused_trace(const std::string& cmd, const std::string& dir) {
  const auto bad = kt::run(cmd + " --trace " + dir + "/no/such/dir/t.json");
  EXPECT_EQ(bad.code, 2) << bad.output;
  return bad;
}

// `run --trace` writes the host's timeline: the prefill, each method's compression inside its
// decode, every decode step by number; a trace that cannot be written is refused before any work.
TEST(CliOutputs, RunTraceHoldsThePrefillTheCompressionAndEveryStep) {
  const std::string tmp = kt::make_temp_dir("trace");
  const std::string base = kt::cli() + " run --backend cpu --model " + kFix + " --image " + kFix +
                           "/image.png --max-new-tokens 4 --method kivi:group=8,residual=4";
  const nlohmann::json j = traced(base, tmp);
  ASSERT_FALSE(j.is_null());
  const nlohmann::json* decode = nullptr;
  const nlohmann::json* compress = nullptr;
  std::set<int> method_steps;
  int prefills = 0;
  for (const nlohmann::json& e : j.at("traceEvents")) {
    EXPECT_EQ(e.at("ph"), "X");
    EXPECT_GE(e.at("ts").get<double>(), 0.0);
    EXPECT_GE(e.at("dur").get<double>(), 0.0);
    const std::string n = e.at("name");
    if (n == "experiment.prefill") ++prefills;
    if (n == "experiment.method_decode") decode = &e;
    if (n == "method.compress") compress = &e;
  }
  ASSERT_TRUE(decode && compress);
  EXPECT_EQ(prefills, 1);
  const double d0 = (*decode)["ts"], d1 = d0 + (*decode)["dur"].get<double>();
  EXPECT_GE((*compress)["ts"].get<double>(), d0);
  EXPECT_LE((*compress)["ts"].get<double>() + (*compress)["dur"].get<double>(), d1);
  for (const nlohmann::json& e : j.at("traceEvents"))
    if (e.at("name") == "decode.step" && e["ts"].get<double>() >= d0 && e["ts"].get<double>() <= d1)
      method_steps.insert(e.at("args").at("n").get<int>());
  // The first token comes from the prefill: the decode's steps are 0 .. 2 for 4 new tokens.
  EXPECT_EQ(method_steps, (std::set<int>{0, 1, 2}));
  const auto bad = refused_trace(base, tmp);
  EXPECT_NE(bad.output.find("trace"), std::string::npos) << bad.output;
}

// `bench --trace` writes the host's timeline of every caption run, the warm-up included: each
// run's decode steps by number; a trace that cannot be written is refused before any work, and
// one given before a subcommand is refused too.
TEST(CliOutputs, BenchTraceHoldsEveryRunsSteps) {
  const std::string tmp = kt::make_temp_dir("bench_trace");
  const std::string base = kt::cli() + " bench --backend cpu --model " + kFix + " --image " + kFix +
                           "/image.png --repeat 2 --max-new-tokens 4";
  const nlohmann::json j = traced(base, tmp);
  ASSERT_FALSE(j.is_null());
  std::map<int, int> steps;  // step number → spans
  for (const nlohmann::json& e : j.at("traceEvents"))
    if (e.at("name") == "decode.step") ++steps[e.at("args").at("n").get<int>()];
  // Three runs (one warm-up), each with decode steps 0 .. 2 for 4 new tokens.
  EXPECT_EQ(steps, (std::map<int, int>{{0, 3}, {1, 3}, {2, 3}}));
  const auto bad = refused_trace(base, tmp);
  EXPECT_NE(bad.output.find("cannot write trace"), std::string::npos) << bad.output;
  EXPECT_EQ(bad.output.find("decode"), std::string::npos) << bad.output;  // (refused before the runs)
  // Given before a subcommand it would be ignored: refused, naming it (before the subcommand's
  // own checks, such as attention's need of a CUDA device).
  const auto misplaced = kt::run(kt::cli() + " bench --trace " + tmp + "/t2.json attention");
  EXPECT_EQ(misplaced.code, 2) << misplaced.output;
  EXPECT_NE(misplaced.output.find("--trace is an option of 'kvlens bench' itself"), std::string::npos)
      << misplaced.output;
}
