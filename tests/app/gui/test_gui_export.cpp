// kvlens-gui's figure export driven headless (--script) under Xvfb: it runs on a thread of its
// own while the window keeps drawing, with a progress bar, and Cancel stops it between figures
// with a message saying how far it got.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/app/gui/gui_driver.h"
#include "tests/test_util.h"

namespace kt = kvlens::testing;
using kt::load;
using nlohmann::json;

TEST(Gui, ExportShowsItsProgressAndCancelStopsIt) {
  const std::string dir = kt::make_temp_dir("gui_export");
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "export_figures"}, {"dir", "figs"}, {"formats", "png,svg,pdf"}, {"wait", false}},
                        {{"do", "frames"}, {"n", 2}},
                        {{"do", "dump_state"}, {"path", "running.json"}},
                        {{"do", "cancel_export"}},
                        {{"do", "expect_message"}, {"contains", "export cancelled:"}},
                        {{"do", "frames"}, {"n", 2}},
                        {{"do", "dump_state"}, {"path", "ended.json"}},
                        {{"do", "export_figures"}, {"dir", "x"}, {"wait", "no"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_OR_SKIP(dir, steps, r);
  // The last step is refused: 'wait' must be a boolean, and the script fails there.
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("export_figures: 'wait' must be true or false"), std::string::npos) << r.output;
  const json running = load(dir + "/running.json");
  const json& e = running["export"];
  ASSERT_TRUE(e["running"].get<bool>()) << "the export ended within two frames: " << e.dump();
  EXPECT_GT(e["total"].get<int>(), 20) << e.dump();
  EXPECT_LT(e["done"].get<int>(), e["total"].get<int>());
  ASSERT_TRUE(running["drawn"].contains("export_progress")) << "no progress bar drawn while exporting";
  EXPECT_GT(running["drawn"]["export_progress"][2].get<double>(), 50.0);
  const json ended = load(dir + "/ended.json");
  EXPECT_FALSE(ended["export"]["running"].get<bool>());
  // Cancelled between figures: fewer files than three formats of every figure.
  int files = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir + "/figs")) files += f.is_regular_file() ? 1 : 0;
  EXPECT_LT(files, 3 * e["total"].get<int>());
}
