// core/data/image: decoding against PIL's convert("RGB"), error messages, PNG writing.
// Fixtures and the script that makes them: tests/fixtures/image/.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/data/image.h"
#include "tests/image_fixtures.h"

namespace kvlens {
namespace {

TEST(ImageDecode, LosslessFormatsMatchPil) {
  // (file, PIL's np.array(Image.open(file).convert("RGB")); for 16-bit grey the v >> 8 rule)
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"rgb.png", "rgb.rgb"},           {"rgb.bmp", "rgb_bmp.rgb"},
      {"grey.png", "grey.rgb"},         {"grey_alpha.png", "grey_alpha.rgb"},
      {"rgba.png", "rgba.rgb"},         {"rgb16.png", "rgb16.rgb"},
      {"grey16.png", "grey16.rgb"}};
  for (const auto& [file, want] : cases) {
    SCOPED_TRACE(file);
    const RGBImage img = load_image(kDir + file);
    const Diff d = compare(img, raw_image(want));
    EXPECT_EQ(d.max, 0);
  }
}

#ifdef KVLENS_HAVE_LIBJPEG
TEST(ImageDecode, JpegMatchesPilExactly) {
  // libjpeg-turbo decodes as PIL does: baseline 4:4:4 and 4:2:0, progressive, grey, and Adobe
  // CMYK converted to RGB by PIL's rule.
  for (const std::string name : {"rgb", "rgb420", "progressive", "grey", "cmyk"}) {
    SCOPED_TRACE(name);
    const Diff d = compare(load_image(kDir + name + ".jpg"), raw_image(name + "_jpg.rgb"));
    EXPECT_EQ(d.max, 0);
  }
}

#else
TEST(ImageDecode, JpegMatchesPilExactly) {
  GTEST_SKIP() << "built without libjpeg: JPEG goes through stb_image, which is within a few levels of PIL (JpegCloseToPil)";
}

#endif

TEST(ImageDecode, DecodeFromMemoryMatchesFile) {
  const std::vector<uint8_t> bytes = read_bytes("rgba.png");
  const RGBImage a = decode_image(bytes.data(), bytes.size(), "in-memory rgba");
  EXPECT_EQ(compare(a, load_image(kDir + "rgba.png")).max, 0);
}

// JPEG decoders are allowed to differ: the IDCT accuracy bound (IEEE 1180 / JPEG conformance)
// is 1 level per Y, Cb or Cr sample for each decoder, so two decoders may differ by 2 per
// sample; through the YCbCr → RGB matrix (largest coefficient 1.772 on Cb for blue) and one more
// rounding step per decoder, an RGB value may differ by 2 + 1.772 · 2 + 2 ≈ 7.5 levels at most.
// Chroma subsampling adds the upsampling filter, which the standard leaves to the decoder, so
// for 4:2:0 only the mean difference is bounded: a decoder that upsampled poorly would be
// several levels off on average on this noisy image.
TEST(ImageDecode, JpegCloseToPil) {
  {
    SCOPED_TRACE("4:4:4");
    const Diff d = compare(load_image(kDir + "rgb.jpg"), raw_image("rgb_jpg.rgb"));
    EXPECT_LE(d.max, 7);
    EXPECT_LE(d.mean, 1.0);
    RecordProperty("jpeg444_max_diff", d.max);
  }
  {
    SCOPED_TRACE("4:2:0");
    const Diff d = compare(load_image(kDir + "rgb420.jpg"), raw_image("rgb420_jpg.rgb"));
    EXPECT_LE(d.mean, 2.0);
    RecordProperty("jpeg420_max_diff", d.max);
  }
}

TEST(ImageDecode, ErrorsNameTheFile) {
  const std::string missing = kDir + "no_such_image.png";
  expect_input_error([&] { load_image(missing); }, {missing, "not found"});
  const std::string dir = kDir + "clip224";
  expect_input_error([&] { load_image(dir); }, {dir, "directory"});
  const std::string empty = kDir + "empty.png";
  expect_input_error([&] { load_image(empty); }, {empty, "empty"});
  const std::string text = kDir + "not_image.txt";
  expect_input_error([&] { load_image(text); }, {text, "stb_image:"});
  const std::string truncated = kDir + "truncated.png";
  expect_input_error([&] { load_image(truncated); }, {truncated, "stb_image:"});
  // The headers claim 20000 x 20000: refused from the header, before any pixel is decoded
  // (grey passes stb_image's own header check, RGB does not; both must say why).
  const std::string huge = kDir + "huge_header.png";
  expect_input_error([&] { load_image(huge); }, {huge, "20000x20000"});
  const std::string huge_rgb = kDir + "huge_rgb_header.png";
  expect_input_error([&] { load_image(huge_rgb); }, {huge_rgb, "20000x20000"});
  expect_input_error([] { decode_image(nullptr, 0, "buffer-name"); }, {"buffer-name"});
  // A path through a regular file cannot be opened, whoever runs the test.
  const std::string through = kDir + "rgb.png/inner.png";
  expect_input_error([&] { load_image(through); }, {through});
}

TEST(ImageDecode, UnreadableFileNamed) {
  // A file without read permission (not testable as root, who can read it anyway).
  const std::string path = testing::TempDir() + "kvlens_test_image_unreadable.png";
  std::filesystem::copy_file(kDir + "rgb.png", path,
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::permissions(path, std::filesystem::perms::none);
  const bool readable = std::ifstream(path).good();
  if (!readable) expect_input_error([&] { load_image(path); }, {path, "cannot"});
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  std::filesystem::remove(path);
  if (readable) GTEST_SKIP() << "permissions do not stop this user from reading " << path;
}

TEST(ImageWrite, RoundTripAndErrors) {
  const RGBImage src = raw_image("resize_src.rgb");
  const std::string path = testing::TempDir() + "kvlens_test_image_roundtrip.png";
  write_png(path, src);
  EXPECT_EQ(compare(load_image(path), src).max, 0);
  std::filesystem::remove(path);
  const std::string bad = kDir + "no_such_dir/out.png";
  expect_input_error([&] { write_png(bad, src); }, {bad});
  RGBImage broken = src;
  broken.data.pop_back();
  expect_input_error([&] { write_png(path, broken); }, {path});
}

TEST(ImageDecode, TopDownBmpMatchesPil) {
  // A BMP with a negative height stores its rows top-down; it decodes to the same pixels.
  const RGBImage img = load_image(kDir + "topdown.bmp");
  const Diff d = compare(img, raw_image("topdown.rgb"));
  EXPECT_EQ(d.max, 0);
  EXPECT_EQ(img.source, kDir + "topdown.bmp");
}

}  // namespace
}  // namespace kvlens
