// `kvlens bench session` on the embedded model and the CPU: edits named by index, label or spec
// and validated by the method's schema, default edits that move each method's first number
// parameter inside its range, and a replay whose edited captions are what a fresh run of the
// edited method gives on the same prompt.
#include <gtest/gtest.h>

#include "app/lab/experiment.h"
#include "app/lab/session_bench.h"
#include "core/compress/method.h"
#include "core/data/image.h"
#include "core/errors.h"
#include "kernels/backends.h"
#include "models/model.h"
#include "tests/test_util.h"

namespace kt = kvlens::testing;
using namespace kvlens;

namespace {

Session two_methods() {
  Session s;
  s.max_new_tokens = 12;
  s.methods = {parse_method_spec("calibquant:bits=2"), parse_method_spec("snapkv:budget=0.3")};
  s.labels = {"", "evict"};
  s.enabled = {true, true};
  return s;
}

}  // namespace

TEST(SessionBench, EditsAreNamedAndValidated) {
  Session s = two_methods();
  const SessionEdit a = parse_session_edit("0:tau1=0.5", s);
  EXPECT_EQ(a.method, 0);
  EXPECT_EQ(a.param, "tau1");
  EXPECT_EQ(a.value, "0.5");
  EXPECT_EQ(parse_session_edit("evict:budget=0.2", s).method, 1);
  // A method named by its spec, whose own ':' and '=' come before the edit's.
  const SessionEdit c = parse_session_edit("calibquant:bits=2:tau2=2", s);
  EXPECT_EQ(c.method, 0);
  EXPECT_EQ(c.param, "tau2");
  for (const auto& [text_, want] : std::vector<std::pair<std::string, std::string>>{
           {"5:tau1=0.5", "method index"},
           {"nobody:tau1=0.5", "no method 'nobody'"},
           {"0:tauX=1", "has no parameter 'tauX'"},
           {"0:tau1=99", "tau1 must be in [0, 8]"},
           {"0:tau1=", "must be"},
           {"tau1=0.5", "expected METHOD:PARAM=VALUE"}}) {
    const std::string text = text_;  // a plain variable: lambdas capture it (a binding they may not)
    const std::string m = kt::error_of([&] { parse_session_edit(text, s); });
    EXPECT_NE(m.find(want), std::string::npos) << text << ": " << m;
    if (!m.empty()) {
      EXPECT_NE(m.find("--edit '" + text + "'"), std::string::npos) << m;
    }
  }
  s.enabled = {true, false};
  EXPECT_NE(kt::error_of([&] { parse_session_edit("1:budget=0.2", s); }).find("disabled"), std::string::npos);
  // Defaults: one edit for each enabled method, a changed value inside the parameter's range.
  s.enabled = {true, true};
  const std::vector<SessionEdit> d = default_session_edits(s);
  ASSERT_EQ(d.size(), 2u);
  for (const SessionEdit& e : d) {
    const Params& p = s.methods[static_cast<size_t>(e.method)];
    EXPECT_NE(p.str(e.param), e.value) << e.text(s);
    std::map<std::string, std::string> v = p.values();
    v[e.param] = e.value;
    EXPECT_NO_THROW(make_params(p.method(), "", v)) << e.text(s);
  }
}

TEST(SessionBench, ReplaysEditsThroughTheWorker) {
  const Session s = two_methods();
  const std::string model = kt::source_dir() + "/assets/models/kvlens-scenes-6m";
  const std::string image = kt::source_dir() + "/assets/images/scene_000.png";
  BackendOptions cpu;
  cpu.kind = "cpu";
  const std::vector<SessionEdit> edits = {parse_session_edit("0:bits=1", s), parse_session_edit("1:budget=0.1", s)};
  const SessionBench b = bench_session(s, model, image, cpu, edits);
  EXPECT_EQ(b.backend, "cpu");
  EXPECT_GT(b.first_ms, 0.0);
  ASSERT_EQ(b.edits.size(), 2u);
  // What a fresh run of each edited method gives on the same prefill.
  const std::unique_ptr<Model> m = load_model(model, {"cpu"});
  ExperimentOptions opt;
  apply_session_run(s, opt);
  const Experiment ex = start_experiment(*m, load_image(image), opt);
  EXPECT_EQ(b.prompt_tokens, static_cast<int>(ex.prefill.ids.size()));
  for (const EditTiming& t : b.edits) {
    EXPECT_GT(t.caption_ms, 0.0) << t.spec;
    EXPECT_LE(t.caption_ms, t.ready_ms) << t.spec;
    // The caption's parts add up to it (other: the rest), the hand-over is part of the decode.
    EXPECT_GE(t.other_ms, 0.0) << t.spec;
    EXPECT_NEAR(t.compress_ms + t.decode_ms + t.diagnostics_ms + t.report_ms + t.other_ms, t.caption_ms, 1e-6) << t.spec;
    EXPECT_GE(t.handover_ms, 0.0) << t.spec;
    EXPECT_LE(t.handover_ms, t.decode_ms) << t.spec;
    EXPECT_NE(t.spec.find(t.edit.param + "=" + t.edit.value), std::string::npos) << t.spec;
    const MethodRun r = run_method(*m, ex, parse_method_spec(t.spec), opt);
    EXPECT_EQ(t.caption, r.result.text) << t.spec;
  }
  // A model that does not load is an InputError, not a hang.
  EXPECT_THROW(bench_session(s, kt::source_dir() + "/assets/no-such-model", image, cpu, edits), InputError);
}
