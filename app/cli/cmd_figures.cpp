// kvlens figures, and the --figures option of run and demo: every figure of a run report as
// PNG / SVG / PDF with its plotted data as CSV (rendered with Cairo; a build without Cairo
// refuses the option with a message saying so).
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

#include "app/cli/commands.h"
#include "app/cli/options.h"
#include "core/errors.h"
#include "app/figures/figures_report.h"
#include "core/json_file.h"
#ifdef KVLENS_HAVE_CAIRO
#include "app/figures/figure_cairo.h"
#endif

namespace kvlens::app {

void add_figure_options(CLI::App* c, FigureArgs& a) {
  c->add_option("--figures", a.dir, "Write every figure of the report into this folder (created if missing)");
  c->add_option("--figure-formats", a.formats, "Comma-separated figure formats: png, svg, pdf")->capture_default_str();
  c->add_flag("--attention-maps", a.attention_maps,
              "Keep query x key attention maps in the report (implied by --figures)");
  add_int(c, "--attention-bins", a.attention_bins, 1, 1 << 16,
          "Most blocks per axis of an attention map: longer prompts are pooled into blocks, each its mean");
}

void check_figure_args(const FigureArgs& a) {
  if (a.dir.empty()) return;
#ifdef KVLENS_HAVE_CAIRO
  parse_figure_formats(a.formats, "--figure-formats");
  struct stat st {};
  std::string parent = a.dir;
  if (::stat(a.dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) throw InputError(a.dir + ": not a folder, expected the folder to write figures into");
  } else {
    while (parent.size() > 1 && parent.back() == '/') parent.pop_back();
    const size_t slash = parent.rfind('/');
    parent = slash == std::string::npos ? "." : slash == 0 ? "/" : parent.substr(0, slash);
    if (::stat(parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      throw InputError(a.dir + ": cannot create the figures folder, " + parent + " is not a folder");
  }
  if (::access(parent.c_str(), W_OK) != 0) throw InputError(a.dir + ": the figures folder is not writable");
#else
  throw InputError("--figures: this kvlens was built without Cairo (libcairo2-dev), which renders figures; "
                   "./setup.sh installs it");
#endif
}

void write_report_figures(const nlohmann::json& report, const FigureArgs& a, const RGBImage* image) {
  if (a.dir.empty()) return;
#ifdef KVLENS_HAVE_CAIRO
  const std::vector<fig::Figure> figs = fig::report_figures(report, image);
  const auto written = export_figures(figs, a.dir, parse_figure_formats(a.formats, "--figure-formats"), true);
  std::printf("%zu figures (%zu files) written to %s\n", figs.size(), written.size(), a.dir.c_str());
#else
  check_figure_args(a);
#endif
}

void add_figures_command(CLI::App& root) {
  auto report = std::make_shared<std::string>();
  auto fa = std::make_shared<FigureArgs>();
  CLI::App* c = root.add_subcommand("figures", "Render every figure of a kvlens run report (PNG, SVG, PDF and CSV)");
  c->add_option("--report", *report, "Report JSON written by kvlens run --report")->required();
  c->add_option("--out", fa->dir, "Folder to write the figures into (created if missing)")->required();
  c->add_option("--figure-formats", fa->formats, "Comma-separated figure formats: png, svg, pdf")->capture_default_str();
  c->callback([report, fa] {
    check_figure_args(*fa);
    write_report_figures(read_json_file(*report, "report"), *fa);
  });
}

}  // namespace kvlens::app
