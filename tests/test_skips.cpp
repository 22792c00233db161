// Every skip in the suite says why: each GTEST_SKIP in tests/ streams a reason. (The count and
// the reasons of the skips of a run are printed by tests/skipped.sh, which CI runs after ctest.)
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tests/test_util.h"

namespace kt = kvlens::testing;

TEST(SuiteHygiene, EverySkipGivesAReason) {
  const std::filesystem::path dir = kt::source_dir() + "/tests";
  const std::string macro = std::string("GTEST_") + "SKIP()";
  int files = 0, skips = 0;
  // Every suite and helper under tests/, in the folders that mirror the sources too.
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    const std::string ext = e.path().extension().string();
    if (!e.is_regular_file() || (ext != ".cpp" && ext != ".h")) continue;
    const std::string name = std::filesystem::relative(e.path(), dir).string();
    const std::string src = kt::read_file(e.path().string());
    ++files;
    for (size_t at = src.find(macro); at != std::string::npos; at = src.find(macro, at + 1)) {
      ++skips;
      size_t i = at + macro.size();
      while (i < src.size() && isspace(static_cast<unsigned char>(src[i]))) ++i;
      EXPECT_EQ(src.compare(i, 2, "<<"), 0) << name << ": a skip at offset " << at << " gives no reason";
      // The reason is more than an empty string.
      size_t j = i + 2;
      while (j < src.size() && isspace(static_cast<unsigned char>(src[j]))) ++j;
      EXPECT_NE(src.compare(j, 3, "\"\";"), 0) << name << ": empty skip reason";
    }
  }
  EXPECT_GT(files, 40);  // the suites of every folder were read
  EXPECT_GE(skips, 1);  // tests/core/data/test_image.cpp skips where file permissions do not bind
}
