// Driving kvlens-gui headless in tests: the binary (when built), and a run of a --script under
// Xvfb that skips visibly where the app or Xvfb is missing.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace kvlens::testing {

#ifdef KVLENS_GUI_BINARY
inline const char* const kGui = KVLENS_GUI_BINARY;
#else
inline const char* const kGui = nullptr;
#endif

// Skips (visibly) where the app or Xvfb is missing; else runs `steps` in `dir` on an Xvfb screen
// of `screen` pixels with the app's extra arguments `args` (e.g. " --size 1280x800").
#define RUN_GUI_SIZED_OR_SKIP(dir, steps, out, screen, args)                                                  \
  do {                                                                                                        \
    namespace kt_ = kvlens::testing;                                                                          \
    if (!kt_::kGui) GTEST_SKIP() << "kvlens-gui is not built (KVLENS_GUI=OFF or its packages are missing)";   \
    if (kt_::run("command -v xvfb-run").code != 0)                                                            \
      GTEST_SKIP() << "xvfb-run is not installed (./setup.sh --tests installs xvfb)";                         \
    kt_::write_file(dir + "/steps.json", (steps).dump(1));                                                    \
    out = kt_::run("cd " + dir + " && HOME=" + dir + " XDG_STATE_HOME=" + dir + "/state xvfb-run -a -s '-screen 0 " + \
                   std::string(screen) + "x24' " + kt_::kGui + std::string(args) + " --script steps.json");   \
  } while (0)
#define RUN_GUI_OR_SKIP(dir, steps, out) RUN_GUI_SIZED_OR_SKIP(dir, steps, out, "1920x1200", "")

inline nlohmann::json load(const std::string& path) { return nlohmann::json::parse(kvlens::testing::read_file(path)); }

}  // namespace kvlens::testing
