// Chat templates (models/chat_template.cpp) rendered as HF transformers renders them: the
// families' templates and a walk through the Jinja2 subset, against HF's renderings recorded by
// tests/make_chat_template_fixtures.py; what cannot be rendered is refused naming the line.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "models/chat_template.h"
#include "models/tokenizer.h"
#include "tests/test_expect.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;
using ojson = nlohmann::ordered_json;
using kt::error_of;

namespace {

ojson fixture() {
  std::ifstream f(kt::source_dir() + "/tests/fixtures/chat_templates/cases.json");
  return ojson::parse(f);
}

}  // namespace

TEST(ChatTemplate, RendersAsTransformersDoes) {
  const ojson fx = fixture();
  ASSERT_GE(fx["cases"].size(), 10u);
  for (const auto& c : fx["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    EXPECT_EQ(render_chat_template(c["template"].get<std::string>(), c["context"], "t"), c["rendered"].get<std::string>());
  }
}

TEST(ChatTemplate, ErrorsNameTheLineAndWhat) {
  const ojson fx = fixture();  // (kept alive for the loop)
  for (const auto& c : fx["errors"]) {
    const std::string e = error_of([&] { render_chat_template(c["template"].get<std::string>(), c["context"], "t.json"); });
    EXPECT_NE(e.find("t.json: chat template, line 1: the chat template raised: " + c["message"].get<std::string>()),
              std::string::npos) << e;
  }
  EXPECT_EQ(error_of([] { render_chat_template("a\n{{ x | frobnicate }}", ojson::object(), "t.json"); }),
            "t.json: chat template, line 2: the filter 'frobnicate' is not supported");
  EXPECT_EQ(error_of([] { render_chat_template("{% for x in y %}", ojson::object(), "t.json"); }),
            "t.json: chat template, line 1: the template ends before 'endfor'");
  EXPECT_EQ(error_of([] { render_chat_template("{% macro f() %}{% endmacro %}", ojson::object(), "t.json"); }),
            "t.json: chat template, line 1: the statement 'macro' is not supported");
  EXPECT_EQ(error_of([] { render_chat_template("{{ 'open }}", ojson::object(), "t.json"); }),
            "t.json: chat template, line 1: a tag opened here is never closed");
  EXPECT_EQ(error_of([] { render_chat_template("{{ messages[] }}", ojson::object(), "t.json"); }),
            "t.json: chat template, line 1: an empty subscript []");
  // Integers as Python's within 64 bits (floor division, the remainder of the divisor's sign);
  // beyond them an error, not a wrapped value.
  EXPECT_EQ(render_chat_template("{{ -7 // 2 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 9 // -1 }}", ojson::object(), "t"),
            "-4 -2 1024 -9");
  for (const char* t : {"{{ 9223372036854775807 + 1 }}", "{{ 3 ** 40 }}", "{{ (-9223372036854775807 - 1) // -1 }}"})
    EXPECT_EQ(error_of([&] { render_chat_template(t, ojson::object(), "t"); }),
              "t: chat template, line 1: an integer beyond 64 bits")
        << t;
  // A checkpoint's template is input: it may not run or grow without bound.
  EXPECT_NE(error_of([] {
              render_chat_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                                   ojson::object(), "t.json");
            }).find("runs more than"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              render_chat_template("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                                   "{% endfor %}{{ ns.s | length }}",
                                   ojson::object(), "t.json");
            }).find("grows past"),
            std::string::npos);
  EXPECT_EQ(error_of([] { render_chat_template(std::string(300, '(') + "1" + std::string(300, ')'), ojson::object(), "t"); }),
            "") << "brackets outside {{ }} are plain text";
  EXPECT_NE(error_of([] { render_chat_template("{{ " + std::string(300, '(') + "1" + std::string(300, ')') + " }}",
                                               ojson::object(), "t"); })
                .find("nested more than"),
            std::string::npos);
}

// Where a checkpoint keeps its template, as transformers looks: chat_template.jinja first, then
// chat_template.json, then tokenizer_config.json (a string, or named templates); rendered for one
// user turn it holds {prompt}; a template that drops the user's text is refused.
TEST(ChatTemplate, TheTokenizerFindsTheCheckpointsTemplate) {
  const std::string src = kt::source_dir() + "/tests/fixtures/tokenizers/qwen2_style";
  const std::string dir = kt::make_temp_dir("chat");
  kt::write_file(dir + "/tokenizer.json", kt::read_file(src + "/tokenizer.json"));
  nlohmann::json cfg = kt::read_json(src + "/tokenizer_config.json");
  auto load = [&] { return Tokenizer::load(dir, -1, false); };
  EXPECT_EQ(load().chat_prompt(false), "") << "no template, no chat prompt";
  cfg["chat_template"] = nlohmann::json::array({{{"name", "tool_use"}, {"template", "T"}},
                                                {{"name", "default"}, {"template", "<|im_start|>user\n{{ messages[0]['content'] }}"}}});
  kt::write_file(dir + "/tokenizer_config.json", cfg.dump());
  EXPECT_EQ(load().chat_prompt(false), "<|im_start|>user\n{prompt}");
  kt::write_file(dir + "/chat_template.json", nlohmann::json({{"chat_template", "[{{ messages[0]['content'] }}]"}}).dump());
  EXPECT_EQ(load().chat_prompt(false), "[{prompt}]");
  kt::write_file(dir + "/chat_template.jinja", "<{{ messages[0]['content'] }}>{% if add_generation_prompt %}!{% endif %}\n");
  EXPECT_EQ(load().chat_prompt(false), "<{prompt}>!");
  EXPECT_EQ(load().chat_template_file(), dir + "/chat_template.jinja");
  kt::write_file(dir + "/chat_template.jinja", "{{ 'no user text' }}");
  EXPECT_NE(error_of([&] { load().chat_prompt(false); }).find("the chat template dropped the user's text"), std::string::npos);
  kt::write_file(dir + "/chat_template.jinja", "{{ messages[0]['content'][1]['text'] }}");
  EXPECT_NE(error_of([&] { load().chat_prompt(true); }).find("writes no <image> for the user's image"), std::string::npos);
}

// A SentencePiece tokenizer puts its "▁" before the prompt's text sections as HF transformers
// builds it from tokenizer_config.json: before every section ("legacy": true), before the first
// only ("legacy": false, null or absent), before none ("add_prefix_space": false), and never
// before a section that starts with a space or "▁"; a model with SentencePiece self-test samples
// loads (its copy without the prefix drops them), and one that removes extra whitespace keeps a
// section's leading space as its "▁"; <s>, </s> and <unk> written in a template are those tokens
// and end a section (a template that writes <s> gets a second BOS, as HF's processors give it).
// The ids are HF's
// (tests/make_sp_prefix_fixtures.py); the templates put <image> first, inside, twice, last and
// nowhere.
// A "legacy" that is not a boolean is refused naming the file.
TEST(ChatTemplate, SentencePiecePrefixAsTransformersPlacesIt) {
  const std::string root = kt::source_dir() + "/tests/fixtures/tokenizers/sp_prefix";
  const nlohmann::json cases = kt::read_json(root + "/cases.json");
  const int image = cases["image_token_index"].get<int>(), n_visual = cases["n_visual"].get<int>();
  ASSERT_EQ(cases["variants"].size(), 7u);
  for (const auto& [name, rows] : cases["variants"].items()) {
    const Tokenizer tok = Tokenizer::load(root + "/" + name, image);
    for (const auto& r : rows) {
      SCOPED_TRACE(name + ": " + r["template"].get<std::string>());
      EXPECT_EQ(tok.encode_prompt(r["template"].get<std::string>(), cases["prompt"].get<std::string>(), n_visual),
                r["ids"].get<std::vector<int>>());
    }
  }
  const std::string dir = kt::make_temp_dir("sp_prefix");
  for (const char* f : {"tokenizer.model", "special_tokens_map.json", "added_tokens.json"})
    kt::write_file(dir + "/" + f, kt::read_file(root + "/legacy_false/" + f));
  nlohmann::json cfg = kt::read_json(root + "/legacy_false/tokenizer_config.json");
  cfg["legacy"] = "no";
  kt::write_file(dir + "/tokenizer_config.json", cfg.dump());
  const std::string err = error_of([&] { Tokenizer::load(dir, image); });
  EXPECT_NE(err.find(dir + "/tokenizer_config.json: 'legacy' must be true, false or null"), std::string::npos) << err;
}
