// The method registry and parameter schemas: defaults parse, presets apply, every invalid value
// gets one line naming the method, the parameter and what is valid, specs round-trip.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/compress/method.h"
#include "core/compress/policy.h"
#include "core/compress/registry.h"
#include "tests/test_util.h"

using namespace kvlens;

namespace {

using kvlens::testing::error_of;

// How messages and specs print numbers: integers as integers, others as the shortest decimal
// text that reads back as x.
std::string num_text(double x) {
  char buf[64];
  if (x == static_cast<double>(static_cast<long long>(x))) {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(x));
    return buf;
  }
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  return buf;
}

}  // namespace

TEST(Registry, UniqueNamesHelpTextAndOrder) {
  const std::vector<MethodSpec>& all = methods();
  std::set<std::string> names;
  for (const MethodSpec& m : all) {
    EXPECT_TRUE(names.insert(m.name).second) << "duplicate " << m.name;
    EXPECT_FALSE(m.summary.empty()) << m.name;
    EXPECT_FALSE(m.family.empty()) << m.name;
    EXPECT_TRUE(static_cast<bool>(m.make)) << m.name;
    std::set<std::string> params;
    for (const ParamSpec& p : m.params) {
      EXPECT_TRUE(params.insert(p.name).second) << m.name << ": duplicate " << p.name;
      EXPECT_FALSE(p.help.empty()) << m.name << "." << p.name;
      EXPECT_EQ(p.help.find('\n'), std::string::npos) << m.name << "." << p.name;
      if (p.type == ParamSpec::Type::Choice) {
        EXPECT_FALSE(p.choices.empty()) << m.name << "." << p.name;
      }
      if (p.type == ParamSpec::Type::Int || p.type == ParamSpec::Type::Float) {
        EXPECT_LE(p.min, p.max) << m.name << "." << p.name;
      }
    }
  }
  const std::vector<std::string> quant = {"full", "uniform", "kivi", "calibquant", "zipcache", "turboquant",
                                          "hadamard_int4"};
  ASSERT_GE(all.size(), quant.size());
  for (size_t i = 0; i < quant.size(); ++i) EXPECT_EQ(all[i].name, quant[i]);
  EXPECT_EQ(all.size(), quantization_methods().size() + eviction_methods().size());
}

TEST(Registry, SeedMethodOptionsNameTheirSource) {
  // Every option of the four papers' methods says which equation, algorithm, section or
  // authors' code path it follows (`kvlens methods` prints these lines).
  const std::regex source(R"((Eq\. ?[0-9]|Algorithm|Alg\. ?[0-9]|Sec\. ?[0-9]|Table|code))");
  for (const char* name : {"calibquant", "zipcache", "vlcache", "lookm"}) {
    const MethodSpec& m = find_method(name);
    for (const ParamSpec& p : m.params)
      EXPECT_TRUE(std::regex_search(p.help, source)) << name << "." << p.name << ": " << p.help;
    // Each has a paper preset and an official (authors' code) preset or says the code agrees.
    if (std::string(name) != "vlcache") {
      EXPECT_TRUE(m.presets.count("paper")) << name;
      EXPECT_TRUE(m.presets.count("official")) << name;
    }
  }
}

TEST(Registry, DefaultsParseAndBuildAPolicy) {
  for (const MethodSpec& m : methods()) {
    SCOPED_TRACE(m.name);
    const Params p = parse_method_spec(m.name);
    EXPECT_EQ(p.method(), m.name);
    EXPECT_EQ(p.values().size(), m.params.size());
    for (const ParamSpec& s : m.params) {
      ASSERT_TRUE(p.has(s.name)) << s.name;
      EXPECT_EQ(p.str(s.name), validate_param(m.name, s, s.def));
    }
    // The canonical spec reads back as the same values.
    EXPECT_EQ(parse_method_spec(p.spec()).values(), p.values());
    EXPECT_EQ(p.to_json()["method"], m.name);
    EXPECT_NE(make_policy(p), nullptr);
  }
}

TEST(Registry, PresetsApplyBeforeExplicitValues) {
  for (const MethodSpec& m : methods())
    for (const auto& pr : m.presets) {
      const Params p = parse_method_spec(m.name + ":preset=" + pr.first);
      for (const auto& kv : pr.second) {
        double a, b;
        const std::string got = p.str(kv.first);
        if (sscanf(got.c_str(), "%lf", &a) == 1 && sscanf(kv.second.c_str(), "%lf", &b) == 1)
          EXPECT_DOUBLE_EQ(a, b) << m.name << " " << pr.first << " " << kv.first;
        else
          EXPECT_EQ(got, kv.second) << m.name << " " << pr.first << " " << kv.first;
      }
    }
  const Params off = parse_method_spec("calibquant:preset=official");
  EXPECT_DOUBLE_EQ(off.num("k_shrink"), 0.5);
  EXPECT_DOUBLE_EQ(off.num("v_shrink"), 0.3);
  EXPECT_EQ(off.integer("bits"), 1);
  const Params paper = parse_method_spec("calibquant:preset=paper");
  EXPECT_DOUBLE_EQ(paper.num("k_shrink"), 1.0);
  EXPECT_DOUBLE_EQ(paper.num("tau2"), 3.0);
  // An explicit value wins over the preset wherever it stands in the spec.
  EXPECT_DOUBLE_EQ(parse_method_spec("calibquant:k_shrink=0.7,preset=official").num("k_shrink"), 0.7);
  EXPECT_DOUBLE_EQ(parse_method_spec("calibquant: preset = official , tau2 = 2").num("tau2"), 2.0);
  const std::string e = error_of([] { parse_method_spec("calibquant:preset=nope"); });
  EXPECT_NE(e.find("calibquant"), std::string::npos) << e;
  EXPECT_NE(e.find("official"), std::string::npos) << e;
  EXPECT_NE(e.find("paper"), std::string::npos) << e;
}

TEST(Registry, EveryValidationErrorNamesMethodParameterAndRange) {
  EXPECT_EQ(error_of([] { parse_method_spec("calibquant:tau2=-1"); }), "calibquant: tau2 must be in [0, 8], got -1");
  for (const MethodSpec& m : methods())
    for (const ParamSpec& p : m.params) {
      SCOPED_TRACE(m.name + "." + p.name);
      std::vector<std::string> bad;
      std::vector<std::string> must;  // what the message must mention besides method and name
      switch (p.type) {
        case ParamSpec::Type::Int:
        case ParamSpec::Type::Float:
          bad = {num_text(p.max + 1), num_text(p.min - 1), "abc", ""};
          must = {num_text(p.min), num_text(p.max)};
          if (p.type == ParamSpec::Type::Int) {
            bad.push_back(num_text(p.min + 0.5));
            must = {std::to_string(static_cast<long long>(p.min)), std::to_string(static_cast<long long>(p.max))};
          }
          break;
        case ParamSpec::Type::Choice:
          bad = {"no-such-choice", ""};
          must = p.choices;
          break;
        case ParamSpec::Type::Bool:
          bad = {"maybe"};
          must = {"on", "off"};
          break;
        case ParamSpec::Type::String:
          bad = {""};
          break;
      }
      for (const std::string& v : bad) {
        const std::string e = error_of([&] { parse_method_spec(m.name + ":" + p.name + "=" + v); });
        ASSERT_FALSE(e.empty()) << "accepted '" << v << "'";
        EXPECT_EQ(e.find('\n'), std::string::npos) << e;
        EXPECT_EQ(e.rfind(m.name + ": " + p.name + " ", 0), 0u) << e;
        for (const std::string& w : must) EXPECT_NE(e.find(w), std::string::npos) << e << " lacks " << w;
      }
    }
}

TEST(Registry, SpecSyntaxErrors) {
  std::string e = error_of([] { parse_method_spec("nosuch:bits=1"); });
  EXPECT_NE(e.find("nosuch"), std::string::npos) << e;
  for (const MethodSpec& m : methods()) EXPECT_NE(e.find(m.name), std::string::npos) << e;
  e = error_of([] { parse_method_spec("kivi:bitz=2"); });
  EXPECT_NE(e.find("kivi: unknown parameter 'bitz'"), std::string::npos) << e;
  for (const char* p : {"bits", "group", "residual"}) EXPECT_NE(e.find(p), std::string::npos) << e;
  e = error_of([] { parse_method_spec("kivi:bits"); });
  EXPECT_NE(e.find("kivi: expected name=value"), std::string::npos) << e;
  e = error_of([] { parse_method_spec("kivi:bits=2,bits=4"); });
  EXPECT_NE(e.find("kivi: parameter bits given twice"), std::string::npos) << e;
  EXPECT_FALSE(error_of([] { parse_method_spec(""); }).empty());
  e = error_of([] { find_method("nope"); });
  EXPECT_NE(e.find("calibquant"), std::string::npos) << e;
  // A colon promises parameters; empty items are typos, not defaults.
  EXPECT_EQ(error_of([] { parse_method_spec("calibquant:"); }),
            "calibquant: ':' must be followed by name=value pairs, e.g. 'calibquant:preset=paper'");
  EXPECT_EQ(error_of([] { parse_method_spec("calibquant: "); }),
            "calibquant: ':' must be followed by name=value pairs, e.g. 'calibquant:preset=paper'");
  EXPECT_EQ(error_of([] { parse_method_spec("calibquant:bits=1,,tau2=3"); }),
            "calibquant: empty item in 'bits=1,,tau2=3' (a stray comma?)");
  EXPECT_EQ(error_of([] { parse_method_spec("calibquant:preset="); }), "calibquant: preset must name a preset");
  // Brackets group a nested value; one left unmatched would swallow every later item.
  EXPECT_EQ(error_of([] { parse_method_spec("stack:evict_preset=a]b,sinks=4"); }),
            "stack: ']' closes no bracket in 'evict_preset=a]b,sinks=4'");
  EXPECT_EQ(error_of([] { parse_method_spec("stack:evict_preset=(a,sinks=4"); }),
            "stack: a bracket opened in 'evict_preset=(a,sinks=4' is never closed");
  // The input that once broke the round trip: an unmatched ']' in a preset name.
  EXPECT_FALSE(error_of([] {
                 parse_method_spec("stack:evict=none,evict_preset=n\x04nstack:evig]=none,sinks=+");
               }).empty());
  // Numbers are whole, finite and in range: no trailing text, no NaN, no hex, no rounding.
  EXPECT_EQ(error_of([] { parse_method_spec("calibquant:tau2=nan"); }),
            "calibquant: tau2 must be a finite number in [0, 8], got 'nan'");
  EXPECT_EQ(error_of([] { parse_method_spec("calibquant:tau2=inf"); }),
            "calibquant: tau2 must be a finite number in [0, 8], got 'inf'");
  EXPECT_EQ(error_of([] { parse_method_spec("calibquant:tau2=0x2"); }),
            "calibquant: tau2 must be a finite number in [0, 8], got '0x2'");
  EXPECT_EQ(error_of([] { parse_method_spec("kivi:group=32.0"); }),
            "kivi: group must be an integer in [1, 4096], got '32.0'");
  EXPECT_EQ(error_of([] { parse_method_spec("kivi:group=4294967328"); }),
            "kivi: group must be an integer in [1, 4096], got 4294967328");
}

TEST(Registry, BudgetsKeepAtLeastOneRowAndZeroIsRefused) {
  for (const char* m : {"vlcache", "h2o", "snapkv", "pyramidkv", "streamingllm"}) {
    SCOPED_TRACE(m);
    const std::string name = m;
    EXPECT_EQ(error_of([&] { parse_method_spec(name + ":budget=0"); }),
              name + ": budget must be in [0.001, 1], got 0");
    EXPECT_EQ(error_of([&] { parse_method_spec(name + ":budget=1e-300"); }),
              name + ": budget must be in [0.001, 1], got 1e-300");
    EXPECT_EQ(parse_method_spec(name + ":budget=0.001").num("budget"), 0.001);
  }
  // The stack hands the budget to its eviction method, which refuses it the same way.
  EXPECT_EQ(error_of([] { parse_method_spec("stack:evict=vlcache,budget=0"); }),
            "vlcache: budget must be in [0.001, 1], got 0");
}

TEST(Registry, StackValuesAreValidatedWhenParsedAndCannotInjectParameters) {
  // Inner values are handed over as values: "1,tau2=0" is one (bad) value of tau1.
  EXPECT_EQ(error_of([] { parse_method_spec("stack:evict=vlcache,quant=calibquant,tau1=(1,tau2=0)"); }),
            "calibquant: tau1 must be a finite number in [0, 8], got '(1,tau2=0)'");
  std::map<std::string, std::string> given{{"quant", "calibquant"}, {"tau1", "1,tau2=0"}};
  EXPECT_EQ(error_of([&] { make_params("stack", "", given); }),
            "calibquant: tau1 must be a finite number in [0, 8], got '1,tau2=0'");
  given["tau1"] = "1";
  const Params ok = make_params("stack", "", given);
  EXPECT_EQ(ok.str("tau1"), "1");
  EXPECT_EQ(ok.str("tau2"), "default");
  EXPECT_NE(make_policy(ok), nullptr);
}

TEST(Registry, ParamsAccessorsSpecAndJson) {
  const Params p = parse_method_spec("  turboquant : bits = 2 , qjl = true ,seed=7 ");
  EXPECT_EQ(p.integer("bits"), 2);
  EXPECT_TRUE(p.flag("qjl"));
  EXPECT_EQ(p.str("qjl"), "on");  // booleans read as on/off
  EXPECT_EQ(p.spec(), "turboquant:bits=2,qjl=on,seed=7,scope=all");  // schema order
  const nlohmann::json j = p.to_json();
  EXPECT_EQ(j["params"]["bits"], 2);
  EXPECT_EQ(j["params"]["qjl"], true);
  EXPECT_EQ(j["params"]["scope"], "all");
  EXPECT_EQ(j["spec"], p.spec());
  const Params c = parse_method_spec("calibquant:tau1=0.10,tau2=3.0");
  EXPECT_EQ(c.str("tau1"), "0.1");  // numbers in their shortest form
  EXPECT_DOUBLE_EQ(c.num("tau2"), 3.0);
  EXPECT_THROW(c.str("nope"), InternalError);
  EXPECT_EQ(make_policy("calibquant:bits=2")->name(), "calibquant");
}

TEST(Registry, ShortSpecKeepsOnlyValuesThatDifferFromDefaults) {
  EXPECT_EQ(parse_method_spec("vlcache").short_spec(), "vlcache");
  EXPECT_EQ(parse_method_spec("vlcache:budget=0.2").short_spec(), "vlcache:budget=0.2");
  EXPECT_EQ(parse_method_spec("calibquant:bits=1,tau2=3").short_spec(), "calibquant");
  EXPECT_EQ(parse_method_spec("calibquant:tau2=2").short_spec(), "calibquant:tau2=2");
  for (const MethodSpec& m : methods()) {
    // The short form names the same method and parses back to the same values.
    const Params p = parse_method_spec(m.name);
    EXPECT_EQ(parse_method_spec(p.short_spec()).spec(), p.spec()) << m.name;
  }
}

// The methods that change the store while decoding keep the host rows then: KIVI (new keys
// quantized group by group), ZipCache (streaming requantization), and uniform, TurboQuant and
// Hadamard-INT4 over every segment (each new token quantized as it arrives; uniform only with
// per-token ranges). Full, CalibQuant (visual rows at prefill) and every eviction / merge
// method (prefill only) decode on a device alone; a stack needs the rows when either side does.
TEST(Registry, OnlyMethodsThatEditTheStoreWhileDecodingNeedHostRows) {
  const std::map<std::string, bool> want = {
      {"full", false},     {"uniform", true},       {"kivi", true},    {"calibquant", false},
      {"zipcache", true},  {"turboquant", true},    {"hadamard_int4", true},
      {"vlcache", false},  {"lookm", false},        {"h2o", false},    {"snapkv", false},
      {"streamingllm", false}, {"pyramidkv", false}, {"stack", false}};
  for (const MethodSpec& m : methods()) {
    SCOPED_TRACE(m.name);
    ASSERT_TRUE(want.count(m.name)) << "a method this test does not know";
    const auto p = make_policy(m.name);
    EXPECT_EQ(decode_needs_host_rows(p.get()), want.at(m.name));
    EXPECT_EQ(p->acts_on_decode(), want.at(m.name));
  }
  for (const char* spec : {"uniform:scope=visual", "uniform:k_granularity=per-channel", "turboquant:scope=visual",
                           "hadamard_int4:scope=visual", "calibquant:bits=2,calibrate=force", "stack:evict=snapkv,quant=none",
                           "stack:evict=none,quant=calibquant"})
    EXPECT_FALSE(decode_needs_host_rows(make_policy(spec).get())) << spec;
  for (const char* spec : {"stack:evict=snapkv,quant=kivi", "stack:evict=none,quant=zipcache", "kivi:bits=4"})
    EXPECT_TRUE(decode_needs_host_rows(make_policy(spec).get())) << spec;
  EXPECT_FALSE(decode_needs_host_rows(nullptr));
}
