// Figures rendered with Cairo: the PNG decodes and shows the laid-out data where the layout put
// it, the SVG parses as XML, the PDF renders with pdftoppm; `kvlens run --figures` and
// `kvlens figures` write every figure, and bad output paths are refused before any work.
#include <gtest/gtest.h>

#include <set>

#include "app/figures/figures_report.h"
#include "core/files.h"
#include "core/data/image.h"
#include "tests/test_util.h"

#ifdef KVLENS_HAVE_CAIRO
#include "app/figures/figure_cairo.h"
#endif
#ifdef KVLENS_HAVE_EXPAT
#include <expat.h>
#endif

namespace kt = kvlens::testing;
using namespace kvlens;

#ifndef KVLENS_HAVE_CAIRO
TEST(FigureExport, NeedsCairo) { GTEST_SKIP() << "built without Cairo (libcairo2-dev): figure export is not built"; }
#else

namespace {

const std::string kFix = kt::source_dir() + "/tests/fixtures/hf/mha_fp32_hub";
const std::string kRunArgs = " --model " + kFix + " --image " + kFix + "/image.png --max-new-tokens 5 --diag-steps 2 ";

fig::Figure line_figure() {
  fig::Figure f;
  f.id = "probe";
  f.title = "τ1, τ2 and γ(l)";
  f.x.label = "layer";
  f.y.label = "value";
  f.x.min = 0;
  f.x.max = 4;
  f.y.min = 0;
  f.y.max = 1;
  fig::Series s;
  s.label = "red line";
  s.color = fig::Color{0.9f, 0.1f, 0.1f, 1};
  s.line_width = 4;
  s.x = {0, 4};
  s.y = {0.5, 0.5};
  f.series.push_back(s);
  return f;
}

int count_non_white(const RGBImage& img) {
  int n = 0;
  for (size_t i = 0; i + 2 < img.data.size(); i += 3) n += (img.data[i] < 250 || img.data[i + 1] < 250 || img.data[i + 2] < 250);
  return n;
}

}  // namespace

TEST(FigureExport, PngShowsTheLayout) {
  const fig::Figure f = line_figure();
  const std::string png = app::render_figure(f, app::FigureFormat::Png, 400, 300, 2);
  const RGBImage img = decode_image(reinterpret_cast<const uint8_t*>(png.data()), png.size(), "probe.png");
  ASSERT_EQ(img.width, 800);
  ASSERT_EQ(img.height, 600);
  // The line's middle, where the same layout puts it, is red.
  const fig::Frame fr = fig::draw(f, 400, 300, app::cairo_text_width);
  const int x = static_cast<int>(fr.px(2) * 2), y = static_cast<int>(fr.py(0.5) * 2);
  const uint8_t* p = &img.data[(static_cast<size_t>(y) * img.width + x) * 3];
  EXPECT_GT(p[0], 200);
  EXPECT_LT(p[1], 60);
  EXPECT_LT(p[2], 60);
  // Above the line inside the plot: background.
  const uint8_t* q = &img.data[(static_cast<size_t>(fr.py(0.8) * 2) * img.width + x) * 3];
  EXPECT_GT(q[1], 200);
  // Text was drawn (title, labels, ticks): many dark pixels outside the plot area.
  int dark_above = 0;
  for (int yy = 0; yy < static_cast<int>(fr.plot.y0 * 2); ++yy)
    for (int xx = 0; xx < img.width; ++xx) dark_above += img.data[(static_cast<size_t>(yy) * img.width + xx) * 3] < 100;
  EXPECT_GT(dark_above, 200);
  EXPECT_GT(app::cairo_text_width("τ1 γ δ", 13), 20);
}

#ifdef KVLENS_HAVE_EXPAT
TEST(FigureExport, SvgParsesAsXml) {
  const std::string svg = app::render_figure(line_figure(), app::FigureFormat::Svg, 400, 300);
  XML_Parser p = XML_ParserCreate(nullptr);
  struct State {
    std::string root;
    int elements = 0;
  } st;
  struct Text {
    std::string font, content;
    bool in_text = false;
  };
  struct Parse {
    State* st;
    std::vector<Text> texts;
  } parse{&st, {}};
  XML_SetUserData(p, &parse);
  XML_SetStartElementHandler(p, [](void* u, const XML_Char* name, const XML_Char** attrs) {
    auto* s = static_cast<Parse*>(u);
    if (s->st->elements++ == 0) s->st->root = name;
    if (std::string(name) == "text") {
      Text t;
      t.in_text = true;
      for (int i = 0; attrs[i]; i += 2)
        if (std::string(attrs[i]) == "font-family") t.font = attrs[i + 1];
      s->texts.push_back(t);
    }
  });
  XML_SetEndElementHandler(p, [](void* u, const XML_Char* name) {
    auto* s = static_cast<Parse*>(u);
    if (std::string(name) == "text") s->texts.back().in_text = false;
  });
  XML_SetCharacterDataHandler(p, [](void* u, const XML_Char* c, int len) {
    auto* s = static_cast<Parse*>(u);
    if (!s->texts.empty() && s->texts.back().in_text) s->texts.back().content.append(c, static_cast<size_t>(len));
  });
  const bool ok = XML_Parse(p, svg.data(), static_cast<int>(svg.size()), 1) == XML_STATUS_OK;
  EXPECT_TRUE(ok) << XML_ErrorString(XML_GetErrorCode(p)) << " at line " << XML_GetCurrentLineNumber(p);
  XML_ParserFree(p);
  EXPECT_EQ(st.root, "svg");
  EXPECT_GT(st.elements, 20);
  EXPECT_NE(svg.find("width=\"400pt\""), std::string::npos);
  // Text is text, in the named font: the title, axis labels and legend entry are searchable.
  std::set<std::string> words;
  for (const Text& t : parse.texts) {
    EXPECT_EQ(t.font, "DejaVu Sans") << t.content;
    words.insert(t.content);
  }
  for (const char* w : {"τ1, τ2 and γ(l)", "layer", "value", "red line"}) EXPECT_EQ(words.count(w), 1u) << w;
  EXPECT_EQ(svg.find("glyph"), std::string::npos) << "text drawn as glyph outlines";
  // A truncated SVG is not XML: the check can fail.
  XML_Parser bad = XML_ParserCreate(nullptr);
  EXPECT_NE(XML_Parse(bad, svg.data(), static_cast<int>(svg.size() / 2), 1), XML_STATUS_OK);
  XML_ParserFree(bad);
}
#endif

TEST(FigureExport, PdfRendersWithPdftoppm) {
  if (kt::run("command -v pdftoppm").code != 0) GTEST_SKIP() << "pdftoppm (poppler-utils) is not installed";
  const std::string dir = kt::make_temp_dir("pdf");
  kt::write_file(dir + "/f.pdf", app::render_figure(line_figure(), app::FigureFormat::Pdf, 400, 300));
  const auto r = kt::run("pdftoppm -png -r 72 -singlefile " + dir + "/f.pdf " + dir + "/page");
  ASSERT_EQ(r.code, 0) << r.output;
  const RGBImage img = load_image(dir + "/page.png");
  EXPECT_EQ(img.width, 400);
  EXPECT_EQ(img.height, 300);
  EXPECT_GT(count_non_white(img), 1000);
}

TEST(FigureExport, RunWritesEveryFigureAndFiguresReRendersTheReport) {
  const std::string dir = kt::make_temp_dir("figs");
  const auto r = kt::run(kt::cli() + " run" + kRunArgs + "--method calibquant --method 'vlcache:budget=0.3' --report " + dir +
                         "/r.json --figures " + dir + "/a --figure-formats png,svg");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json report = nlohmann::json::parse(kt::read_file(dir + "/r.json"));
  ASSERT_TRUE(fig::has_attention(report));  // --figures keeps the attention maps
  const std::vector<fig::Figure> figs = fig::report_figures(report);
  ASSERT_GT(figs.size(), 20u);
  for (const fig::Figure& f : figs) {
    for (const char* ext : {".png", ".svg", ".csv"})
      EXPECT_TRUE(file_exists(dir + "/a/" + f.id + ext)) << f.id << ext;
    EXPECT_FALSE(file_exists(dir + "/a/" + f.id + ".pdf")) << f.id;
  }
  // The same report rendered again by `kvlens figures` gives the same pictures.
  const auto again = kt::run(kt::cli() + " figures --report " + dir + "/r.json --out " + dir + "/b --figure-formats png");
  ASSERT_EQ(again.code, 0) << again.output;
  for (const char* id : {"softmax_mse_by_layer", "attention_l1", "bytes_vs_agreement"})
    EXPECT_EQ(kt::read_file(dir + "/a/" + id + ".png"), kt::read_file(dir + "/b/" + id + ".png")) << id;
  const RGBImage img = load_image(dir + "/a/attention_l0.png");
  EXPECT_GT(count_non_white(img), img.width * img.height / 4);
}

TEST(FigureExport, BadFigureOutputIsRefusedBeforeAnyWork) {
  const std::string dir = kt::make_temp_dir("figbad");
  kt::write_file(dir + "/old.json", "{\"kept\": true}");
  kt::write_file(dir + "/plainfile", "x");
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"--figures " + dir + "/plainfile", "not a folder"},
           {"--figures " + dir + "/no/such/dir", "is not a folder"},
           {"--figures " + dir + "/f --figure-formats png,gif", "--figure-formats"}}) {
    const auto r = kt::run(kt::cli() + " run" + kRunArgs + "--method kivi --report " + dir + "/old.json " + args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << r.output;
    EXPECT_EQ(kt::read_file(dir + "/old.json"), "{\"kept\": true}") << "the report was replaced before the error";
  }
  const auto missing = kt::run(kt::cli() + " figures --report " + dir + "/nothere.json --out " + dir + "/o");
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.output.find("nothere.json"), std::string::npos) << missing.output;
  kt::write_file(dir + "/broken.json", "{\"methods\": []}");
  const auto broken = kt::run(kt::cli() + " figures --report " + dir + "/broken.json --out " + dir + "/o");
  EXPECT_EQ(broken.code, 2);
  EXPECT_NE(broken.output.find("report lacks"), std::string::npos) << broken.output;
}

#endif  // KVLENS_HAVE_CAIRO
