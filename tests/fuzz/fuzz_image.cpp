// libFuzzer harness: image bytes → decoded RGB → CLIP preprocessing (and LLaVA's pad to
// square). Bad input may only ever throw InputError.
#include <cstddef>
#include <algorithm>
#include <cstdint>

#include "core/errors.h"
#include "core/data/image.h"
#include "models/preprocess/clip_image.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const kvlens::RGBImage img = kvlens::decode_image(data, size, "fuzz.img", 1 << 20);
    if (img.data.size() != static_cast<size_t>(img.width) * img.height * 3) __builtin_trap();
    kvlens::PreprocessConfig cfg;
    cfg.shortest_edge = cfg.crop_width = cfg.crop_height = 32;
    const kvlens::Tensor t = kvlens::preprocess(img, cfg);
    if (t.numel() != 3 * 32 * 32) __builtin_trap();
    // Padding materialises a max(w, h)² canvas; past 4 M pixels that is only slow, not new.
    const int64_t side = std::max(img.width, img.height);
    if (side * side > (int64_t{1} << 22)) return 0;
    cfg.pad_to_square = true;
    kvlens::preprocess(img, cfg);
  } catch (const kvlens::InputError&) {
  }
  return 0;
}
