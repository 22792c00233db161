// kvlens-gui on the other model families, driven headless (--script) under Xvfb: a text-only
// model's prompt span, a LLaVA-NeXT model's tiles grid, a Qwen2.5-VL model's merged patches; and
// the caption words' hover.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "tests/app/gui/gui_driver.h"
#include "tests/test_util.h"

namespace kt = kvlens::testing;
using kt::load;
using nlohmann::json;

// A text-only checkpoint (Mistral) in the app: a session names it and a template that marks a
// span of the prompt; the app runs the full cache and every method with no image and no error,
// CalibQuant quantizes the span (its softmax MSE is no longer the float rounding of an
// untouched cache), and the Image panel says why it shows no image.
TEST(Gui, ATextOnlyModelRunsWithItsPromptSpan) {
  const std::string dir = kt::make_temp_dir("gui_text");
  const std::string model = kt::source_dir() + "/tests/fixtures/hf/mistral_gqa_bf16_shard";
  kt::write_file(dir + "/s.json", json({{"kvlens_session", 1}, {"name", "text"}, {"model", model},
                                        {"prompt", "the light is warm and the shadows are long"},
                                        {"template", "Read this: <span>{prompt}</span> Now, the light is"},
                                        {"max_new_tokens", 6}, {"methods", {"calibquant:bits=1", "snapkv:budget=0.5"}}})
                                      .dump());
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "dump_state"}, {"path", "text.json"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_SIZED_OR_SKIP(dir, steps, r, "1920x1200", " --session " + dir + "/s.json");
  ASSERT_EQ(r.code, 0) << r.output;
  const json st = load(dir + "/text.json");
  for (const json& m : st["messages"]) EXPECT_FALSE(m["error"].get<bool>()) << m.dump();
  ASSERT_EQ(st["results"].size(), 2u) << st["results"].dump();
  for (const json& m : st["results"]) EXPECT_FALSE(m["caption"].get<std::string>().empty()) << m.dump();
  EXPECT_GT(st["results"][0]["mean_softmax_mse"].get<double>(), 1e-8) << "CalibQuant left the span untouched";
  EXPECT_EQ(st["overlay"]["patches"].get<int>(), 0);
  EXPECT_FALSE(st["drawn"].contains("image_colorbar"));
}

// A LLaVA-NeXT model: its overlays lie on the tiles' grid (unpadded, newline tokens skipped) drawn
// over the image at the image's own aspect; the Model panel names the family, the tiles and the
// image's token count.
TEST(Gui, AnAnyresModelDrawsItsOverlaysOnTheTilesGrid) {
  const std::string dir = kt::make_temp_dir("gui_next");
  const std::string model = kt::source_dir() + "/tests/fixtures/hf/next_llama_fp32_save";
  kt::write_file(dir + "/s.json", json({{"kvlens_session", 1}, {"name", "next"}, {"model", model},
                                        {"image", model + "/image.png"}, {"max_new_tokens", 6},
                                        {"methods", {"snapkv:budget=0.3"}}})
                                      .dump());
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "select"}, {"overlay", "fate_kept"}, {"overlay_source", 0}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "dump_state"}, {"path", "next.json"}},
                        {{"do", "screenshot"}, {"path", dir + "/next.png"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_SIZED_OR_SKIP(dir, steps, r, "1280x800", " --session " + dir + "/s.json");
  ASSERT_EQ(r.code, 0) << r.output;
  const json st = load(dir + "/next.json");
  for (const json& m : st["messages"]) EXPECT_FALSE(m["error"].get<bool>()) << m.dump();
  ASSERT_EQ(st["results"].size(), 1u) << st["results"].dump();
  const json& g = st["overlay"]["grid"];
  EXPECT_EQ(g["name"], "tiles");
  EXPECT_EQ(g["rows"], 6);
  EXPECT_EQ(g["cols"], 24);
  EXPECT_EQ(g["first"], 64);
  EXPECT_EQ(g["row_stride"], 25);
  EXPECT_EQ(st["overlay"]["patches"].get<int>(), 214) << "a value per visual token";
  const json& img = st["drawn"]["image"];
  EXPECT_NEAR(img[2].get<double>() / img[3].get<double>(), 80.0 / 20.0, 0.05) << img.dump();
  ASSERT_TRUE(st["drawn"].contains("image_colorbar"));
}

// A Qwen2.5-VL model: its image at its own resolution, 2×2 patches merged into one token; the
// overlays lie on that 3×8 grid over the whole 100×37 image, a value per image token.
TEST(Gui, AQwenModelDrawsItsOverlaysOnTheMergedPatches) {
  const std::string dir = kt::make_temp_dir("gui_qwen");
  const std::string model = kt::source_dir() + "/tests/fixtures/hf/qwen25vl_fp32";
  kt::write_file(dir + "/s.json", json({{"kvlens_session", 1}, {"name", "qwen"}, {"model", model},
                                        {"image", model + "/image.png"}, {"max_new_tokens", 6},
                                        {"methods", {"vlcache:budget=0.3", "calibquant:bits=1"}}})
                                      .dump());
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "select"}, {"overlay", "fate_kept"}, {"overlay_source", 0}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "dump_state"}, {"path", "qwen.json"}},
                        {{"do", "screenshot"}, {"path", dir + "/qwen.png"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_SIZED_OR_SKIP(dir, steps, r, "1920x1200", " --session " + dir + "/s.json");
  ASSERT_EQ(r.code, 0) << r.output;
  const json st = load(dir + "/qwen.json");
  for (const json& m : st["messages"]) EXPECT_FALSE(m["error"].get<bool>()) << m.dump();
  ASSERT_EQ(st["results"].size(), 2u) << st["results"].dump();
  const json& g = st["overlay"]["grid"];
  EXPECT_EQ(g["name"], "patches");
  EXPECT_EQ(g["rows"], 3);
  EXPECT_EQ(g["cols"], 8);
  EXPECT_EQ(g["first"], 0);
  EXPECT_EQ(st["overlay"]["patches"].get<int>(), 24) << "a value per image token";
  const json& img = st["drawn"]["image"];
  EXPECT_NEAR(img[2].get<double>() / img[3].get<double>(), 100.0 / 37.0, 0.05) << img.dump();
}

// Hovering a caption's first differing word reads what the full cache said there (the words it
// replaced or dropped); hovering the underlined word (the first differing token's) reads the
// divergence: both tokens and their probabilities.
TEST(Gui, HoveringACaptionWordSaysWhatTheFullCacheSaid) {
  const std::string dir = kt::make_temp_dir("gui_words");
  kt::write_file(dir + "/s.json", json({{"kvlens_session", 1}, {"name", "words"}, {"max_new_tokens", 12},
                                        {"methods", {"snapkv:budget=0.05"}}})
                                      .dump());
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "dump_state"}, {"path", "before.json"}},
                        {{"do", "hover"}, {"over", "caption_diff.1"}, {"x", 0.5}, {"y", 0.5}},
                        {{"do", "dump_state"}, {"path", "diff.json"}},
                        {{"do", "hover"}, {"over", "caption_diverge.1"}, {"x", 0.5}, {"y", 0.5}},
                        {{"do", "dump_state"}, {"path", "diverge.json"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_SIZED_OR_SKIP(dir, steps, r, "1920x1200", " --session " + dir + "/s.json");
  ASSERT_EQ(r.code, 0) << r.output;
  const json before = load(dir + "/before.json");
  ASSERT_TRUE(before["drawn"].contains("caption_diff.1")) << "the method's caption differs from the full cache's";
  const json diff = load(dir + "/diff.json");
  ASSERT_FALSE(diff["hover_readout"].empty());
  // What the full cache had at (or just before) the word, quoted.
  bool says = false;
  for (const json& l : diff["hover_readout"]) {
    const std::string t = l.get<std::string>();
    const bool kind = t.rfind("the full cache says here: \"", 0) == 0 || t.rfind("dropped before this word: \"", 0) == 0;
    says = says || (kind && t.size() > t.find('"') + 2);
  }
  EXPECT_TRUE(says) << diff["hover_readout"].dump();
  const json dv = load(dir + "/diverge.json");
  ASSERT_FALSE(dv["hover_readout"].empty());
  const std::string first = dv["hover_readout"][0].get<std::string>();
  EXPECT_EQ(first.rfind("first divergence at generated token ", 0), 0u) << first;
  EXPECT_NE(first.find("full cache '"), std::string::npos) << first;
  EXPECT_NE(first.find("this method '"), std::string::npos) << first;
}
