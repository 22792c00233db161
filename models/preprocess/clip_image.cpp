// CLIP / LLaVA preprocessing (HF CLIPImageProcessor, LLaVA's pad to square) and the keys of
// preprocessor_config.json.
//
// The resampler reproduces PIL's Image.resize(..., BICUBIC) for 8-bit images: a separable
// convolution with the cubic kernel (a = -0.5), support 2 · max(scale, 1) so that shrinking
// antialiases, pixel centres at (i + 0.5) · scale, windows clipped to the image, weights
// normalized to sum 1 and turned into fixed point with 22 fractional bits, each pass rounded and
// clipped to uint8, passes in the order Pillow 13 picks (see resize_bicubic).
#include "models/preprocess/clip_image.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/errors.h"
#include "core/numbers.h"

namespace kvlens {

// ---------------------------------------------------------------------------------------------
// PIL-compatible bicubic resampling

namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;  // fixed-point fraction bits PIL uses for 8-bit data

double cubic(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}

// Per output pixel: the first input index, how many inputs it reads and their fixed-point
// weights (ksize slots each).
struct Coeffs {
  int ksize = 0;
  std::vector<int> first, count;
  std::vector<int32_t> k;
};

// Coefficients of output pixels [from, from + n) of a resize from in_size to out_size.
Coeffs precompute_coeffs(int in_size, int out_size, int from, int n_out) {
  const double scale = static_cast<double>(in_size) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = 2.0 * filterscale;
  Coeffs c;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(n_out);
  c.count.resize(n_out);
  c.k.assign(static_cast<size_t>(n_out) * c.ksize, 0);
  std::vector<double> w(c.ksize);
  for (int i = 0; i < n_out; ++i) {
    const int xx = from + i;
    const double center = (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    // Truncation toward zero, then clipping to the image, as PIL rounds the window ends.
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    const int n = std::min(xmax - xmin, c.ksize);
    double sum = 0.0;
    for (int x = 0; x < n; ++x) {
      w[x] = cubic((x + xmin - center + 0.5) * ss);
      sum += w[x];
    }
    int32_t* k = &c.k[static_cast<size_t>(i) * c.ksize];
    for (int x = 0; x < n; ++x) {
      const double v = sum != 0.0 ? w[x] / sum : w[x];
      const double f = v * (1 << kPrecisionBits);
      k[x] = static_cast<int32_t>(v < 0 ? f - 0.5 : f + 0.5);
    }
    c.first[i] = xmin;
    c.count[i] = std::max(n, 0);
  }
  return c;
}

inline uint8_t clip8(int64_t acc) {
  const int64_t v = acc >> kPrecisionBits;  // floor: the 0.5 bias was added up front
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// Columns [x0, x0 + cw) of the horizontal pass to width full_w.
RGBImage resample_horizontal(const RGBImage& in, int full_w, int x0, int cw) {
  const Coeffs c = precompute_coeffs(in.width, full_w, x0, cw);
  const int out_w = cw;
  RGBImage out;
  out.width = out_w;
  out.height = in.height;
  out.data.resize(static_cast<size_t>(out_w) * in.height * 3);
  for (int y = 0; y < in.height; ++y) {
    const uint8_t* row = &in.data[static_cast<size_t>(y) * in.width * 3];
    uint8_t* dst = &out.data[static_cast<size_t>(y) * out_w * 3];
    for (int xx = 0; xx < out_w; ++xx) {
      const int32_t* k = &c.k[static_cast<size_t>(xx) * c.ksize];
      const uint8_t* src = row + static_cast<size_t>(c.first[xx]) * 3;
      for (int ch = 0; ch < 3; ++ch) {
        int64_t acc = int64_t{1} << (kPrecisionBits - 1);
        for (int x = 0; x < c.count[xx]; ++x) acc += int64_t{src[x * 3 + ch]} * k[x];
        dst[xx * 3 + ch] = clip8(acc);
      }
    }
  }
  return out;
}

// Rows [y0, y0 + ch) of the vertical pass to height full_h.
RGBImage resample_vertical(const RGBImage& in, int full_h, int y0, int ch) {
  const Coeffs c = precompute_coeffs(in.height, full_h, y0, ch);
  const int out_h = ch;
  RGBImage out;
  out.width = in.width;
  out.height = out_h;
  const size_t stride = static_cast<size_t>(in.width) * 3;
  out.data.resize(stride * out_h);
  for (int yy = 0; yy < out_h; ++yy) {
    const int32_t* k = &c.k[static_cast<size_t>(yy) * c.ksize];
    const uint8_t* src = &in.data[static_cast<size_t>(c.first[yy]) * stride];
    uint8_t* dst = &out.data[static_cast<size_t>(yy) * stride];
    for (size_t i = 0; i < stride; ++i) {
      int64_t acc = int64_t{1} << (kPrecisionBits - 1);
      for (int y = 0; y < c.count[yy]; ++y) acc += int64_t{src[y * stride + i]} * k[y];
      dst[i] = clip8(acc);
    }
  }
  return out;
}

}  // namespace

RGBImage resize_bicubic(const RGBImage& img, int w, int h) {
  return resize_bicubic_window(img, w, h, 0, 0, w, h);
}

RGBImage resize_bicubic_window(const RGBImage& img, int w, int h, int x0, int y0, int cw, int ch) {
  check_image(img, "resize_bicubic");
  if (w <= 0 || h <= 0 || cw <= 0 || ch <= 0 || x0 < 0 || y0 < 0 || x0 > w - cw || y0 > h - ch ||
      static_cast<int64_t>(cw) * ch > kMaxImagePixels)
    throw InputError("resize_bicubic: the window " + std::to_string(cw) + "x" + std::to_string(ch) + "+" +
                     std::to_string(x0) + "+" + std::to_string(y0) + " of a " + std::to_string(w) + "x" +
                     std::to_string(h) + " resize must lie inside it and hold at most " +
                     std::to_string(kMaxImagePixels) + " pixels");
  // Each pass computes only the window along its own axis: the second pass reads nothing the
  // first one skipped, so the window equals the same pixels of the full resize, bit for bit.
  auto crop_rows = [&](const RGBImage& in) {  // rows [y0, y0 + ch) of an image of height h
    if (y0 == 0 && ch == in.height) return in;
    RGBImage out;
    out.width = in.width;
    out.height = ch;
    const size_t stride = static_cast<size_t>(in.width) * 3;
    out.data.assign(in.data.begin() + y0 * stride, in.data.begin() + (y0 + ch) * stride);
    return out;
  };
  auto crop_cols = [&](const RGBImage& in) {  // columns [x0, x0 + cw)
    if (x0 == 0 && cw == in.width) return in;
    RGBImage out;
    out.width = cw;
    out.height = in.height;
    out.data.resize(static_cast<size_t>(cw) * in.height * 3);
    for (int y = 0; y < in.height; ++y)
      std::memcpy(&out.data[static_cast<size_t>(y) * cw * 3],
                  &in.data[(static_cast<size_t>(y) * in.width + x0) * 3], static_cast<size_t>(cw) * 3);
    return out;
  };
  if (w == img.width && h == img.height) return crop_cols(crop_rows(img));
  if (h == img.height) return crop_rows(resample_horizontal(img, w, x0, cw));
  if (w == img.width) return crop_cols(resample_vertical(img, h, y0, ch));
  // Pillow 13 runs the vertical pass first when the height shrinks by more than twice what the
  // width shrinks (always when the width grows while the height shrinks); Pillow 12 and older
  // always ran the horizontal pass first. The order changes the intermediate rounding, so it
  // is followed to stay bit-exact with the Pillow that the reference processor uses.
  const bool vertical_first = h < img.height && (img.height - h) > 2 * (img.width - w);
  if (vertical_first) return resample_horizontal(resample_vertical(img, h, y0, ch), w, x0, cw);
  return resample_vertical(resample_horizontal(img, w, x0, cw), h, y0, ch);
}

// ---------------------------------------------------------------------------------------------
// Geometry

RGBImage pad_to_square(const RGBImage& img, std::array<uint8_t, 3> colour) {
  check_image(img, "pad_to_square");
  if (img.width == img.height) return img;
  const int side = std::max(img.width, img.height);
  if (static_cast<int64_t>(side) * side > kMaxImagePixels)
    throw InputError((img.source.empty() ? std::string("image") : img.source) + ": padding the " +
                     std::to_string(img.width) + "x" + std::to_string(img.height) + " image to a square gives " +
                     std::to_string(side) + "x" + std::to_string(side) + " pixels, more than the " +
                     std::to_string(kMaxImagePixels) + " kvlens accepts; turn padding off or crop the image");
  RGBImage out;
  out.width = out.height = side;
  out.data.resize(static_cast<size_t>(side) * side * 3);
  for (size_t i = 0; i < out.data.size(); i += 3)
    std::memcpy(&out.data[i], colour.data(), 3);
  // LLaVA-1.5 expand2square: paste at ((side - w) / 2, (side - h) / 2).
  const int ox = (side - img.width) / 2, oy = (side - img.height) / 2;
  const size_t row = static_cast<size_t>(img.width) * 3;
  for (int y = 0; y < img.height; ++y)
    std::memcpy(&out.data[(static_cast<size_t>(y + oy) * side + ox) * 3],
                &img.data[static_cast<size_t>(y) * row], row);
  return out;
}

RGBImage center_crop(const RGBImage& img, int w, int h) {
  check_image(img, "center_crop");
  if (w <= 0 || h <= 0 || static_cast<int64_t>(w) * h > kMaxImagePixels)
    throw InputError("center_crop: crop size must be positive and at most " +
                     std::to_string(kMaxImagePixels) + " pixels, got " + std::to_string(w) +
                     "x" + std::to_string(h));
  // As transformers' numpy center_crop (the PIL-based CLIPImageProcessor): along an axis where
  // the crop fits, start at (size - crop) / 2 (floor); where it does not, keep the whole image
  // and place it at ceil((crop - size) / 2) on a zero canvas.
  auto axis = [](int size, int crop, int* src, int* dst, int* len) {
    if (crop <= size) {
      *src = (size - crop) / 2, *dst = 0, *len = crop;
    } else {
      *src = 0, *dst = (crop - size + 1) / 2, *len = size;
    }
  };
  int sx, dx, nx, sy, dy, ny;
  axis(img.width, w, &sx, &dx, &nx);
  axis(img.height, h, &sy, &dy, &ny);
  RGBImage out;
  out.width = w;
  out.height = h;
  out.data.assign(static_cast<size_t>(w) * h * 3, 0);
  for (int y = 0; y < ny; ++y)
    std::memcpy(&out.data[(static_cast<size_t>(y + dy) * w + dx) * 3],
                &img.data[(static_cast<size_t>(y + sy) * img.width + sx) * 3],
                static_cast<size_t>(nx) * 3);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Pipeline

Tensor preprocess(const RGBImage& img, const PreprocessConfig& cfg) {
  check_image(img, "preprocess");
  RGBImage cur;
  if (cfg.pad_to_square) {
    // LLaVA: tuple(int(x * 255) for x in image_processor.image_mean)
    std::array<uint8_t, 3> colour{};
    for (int c = 0; c < 3; ++c) {
      const double v = std::floor(static_cast<double>(cfg.mean[c]) * 255.0);
      colour[c] = static_cast<uint8_t>(std::clamp(v, 0.0, 255.0));
    }
    cur = pad_to_square(img, colour);
  }
  const RGBImage& base = cfg.pad_to_square ? cur : img;

  RGBImage resized;
  if (cfg.do_resize) {
    int tw, th;
    if (cfg.resize_height > 0 && cfg.resize_width > 0) {
      tw = cfg.resize_width, th = cfg.resize_height;
    } else {
      if (cfg.shortest_edge <= 0)
        throw InputError("preprocess: shortest_edge must be positive, got " +
                         std::to_string(cfg.shortest_edge));
      // transformers get_resize_output_image_size(default_to_square=False):
      // long side = int(shortest_edge * long / short)
      const int64_t s = cfg.shortest_edge;
      const int shrt = std::min(base.width, base.height), lng = std::max(base.width, base.height);
      const int64_t new_long = static_cast<int64_t>(static_cast<double>(s * lng) / shrt);
      if (new_long > std::numeric_limits<int>::max())
        throw InputError((img.source.empty() ? std::string("image") : img.source) + ": " +
                         std::to_string(base.width) + "x" + std::to_string(base.height) +
                         " pixels is too elongated to resize its shortest edge to " + std::to_string(s));
      if (base.width <= base.height)
        tw = static_cast<int>(s), th = static_cast<int>(new_long);
      else
        tw = static_cast<int>(new_long), th = static_cast<int>(s);
    }
    if (cfg.do_center_crop) {
      // Only the part the centre crop keeps is resized (the same pixels, bit for bit), so
      // extreme aspect ratios (1×2000 → 224×448000) cost no more than square images.
      auto window = [](int size, int crop, int* start, int* len) {
        if (crop <= size) *start = (size - crop) / 2, *len = crop;
        else *start = 0, *len = size;
      };
      int x0, cw, y0, ch;
      window(tw, cfg.crop_width, &x0, &cw);
      window(th, cfg.crop_height, &y0, &ch);
      resized = resize_bicubic_window(base, tw, th, x0, y0, cw, ch);
    } else {
      resized = resize_bicubic(base, tw, th);
    }
  }
  const RGBImage& sized = cfg.do_resize ? resized : base;

  RGBImage cropped;
  if (cfg.do_center_crop) cropped = center_crop(sized, cfg.crop_width, cfg.crop_height);
  const RGBImage& fin = cfg.do_center_crop ? cropped : sized;

  if (cfg.do_normalize)
    for (int c = 0; c < 3; ++c)
      if (!(cfg.std[c] != 0.0f) || !std::isfinite(cfg.std[c]))
        throw InputError("preprocess: image_std must be finite and non-zero, got " +
                         std::to_string(cfg.std[c]));

  const int H = fin.height, W = fin.width;
  Tensor t("pixel_values", {3, H, W});
  // As transformers' numpy path: rescale in float64 then store float32, normalize in float32.
  const double scale = cfg.rescale_factor;
  for (int c = 0; c < 3; ++c) {
    float* dst = t.ptr() + static_cast<size_t>(c) * H * W;
    for (int i = 0; i < H * W; ++i) {
      const uint8_t u = fin.data[static_cast<size_t>(i) * 3 + c];
      float v = cfg.do_rescale ? static_cast<float>(u * scale) : static_cast<float>(u);
      if (cfg.do_normalize) v = (v - cfg.mean[c]) / cfg.std[c];
      dst[i] = v;
    }
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// preprocessor_config.json

namespace {

constexpr int kMaxEdge = 16384;

int positive_int(const nlohmann::json& v, const std::string& key) {
  return json_int(v, "preprocessor config: '" + key + "'", 1, kMaxEdge);
}

bool boolean(const nlohmann::json& v, const std::string& key) {
  if (!v.is_boolean())
    throw InputError("preprocessor config: '" + key + "' must be true or false, got " + v.dump());
  return v.get<bool>();
}

std::array<float, 3> three(const nlohmann::json& v, const std::string& key, bool positive) {
  // Finite floats (positive ones for the std); 1e300 would become inf as a float.
  auto ok = [&](const nlohmann::json& x) {
    if (!x.is_number()) return false;
    const double d = x.get<double>();
    return std::isfinite(d) && std::fabs(d) <= 1e30 && (!positive || d > 0.0);
  };
  std::array<float, 3> r{};
  if (ok(v)) {
    r.fill(static_cast<float>(v.get<double>()));
    return r;
  }
  if (v.is_array() && v.size() == 3 && ok(v[0]) && ok(v[1]) && ok(v[2])) {
    for (int c = 0; c < 3; ++c) r[c] = static_cast<float>(v[c].get<double>());
    return r;
  }
  throw InputError("preprocessor config: '" + key + "' must be 3 " +
                   (positive ? "positive " : "") + "numbers (or one), got " + v.dump());
}

// {"height": h, "width": w} → (h, w)
void height_width(const nlohmann::json& v, const std::string& key, int* h, int* w) {
  if (!v.contains("height") || !v.contains("width"))
    throw InputError("preprocessor config: '" + key +
                     "' must be an integer or have 'height' and 'width', got " + v.dump());
  *h = positive_int(v["height"], key + ".height");
  *w = positive_int(v["width"], key + ".width");
}

}  // namespace

PreprocessConfig preprocess_config_from_json(const nlohmann::json& j, int image_size) {
  if (image_size <= 0 || image_size > kMaxEdge)
    throw InputError("preprocessor config: image_size must be in [1, " +
                     std::to_string(kMaxEdge) + "], got " + std::to_string(image_size));
  if (!j.is_object())
    throw InputError("preprocessor config: expected a JSON object, got " +
                     std::string(j.type_name()));
  PreprocessConfig cfg;
  cfg.shortest_edge = image_size;
  cfg.crop_height = cfg.crop_width = image_size;

  if (j.contains("size")) {
    const auto& s = j["size"];
    if (s.is_number()) {
      cfg.shortest_edge = positive_int(s, "size");  // CLIP: an int means the shortest edge
    } else if (s.is_object() && s.contains("shortest_edge")) {
      if (s.contains("longest_edge"))
        throw InputError("preprocessor config: 'size.longest_edge' is not supported");
      cfg.shortest_edge = positive_int(s["shortest_edge"], "size.shortest_edge");
    } else if (s.is_object()) {
      height_width(s, "size", &cfg.resize_height, &cfg.resize_width);
    } else {
      throw InputError("preprocessor config: 'size' must be an integer or an object, got " +
                       s.dump());
    }
  }
  if (j.contains("crop_size")) {
    const auto& s = j["crop_size"];
    if (s.is_number()) {
      cfg.crop_height = cfg.crop_width = positive_int(s, "crop_size");
    } else if (s.is_object()) {
      height_width(s, "crop_size", &cfg.crop_height, &cfg.crop_width);
    } else {
      throw InputError("preprocessor config: 'crop_size' must be an integer or an object, got " +
                       s.dump());
    }
  }
  if (j.contains("do_resize")) cfg.do_resize = boolean(j["do_resize"], "do_resize");
  if (j.contains("do_center_crop"))
    cfg.do_center_crop = boolean(j["do_center_crop"], "do_center_crop");
  if (j.contains("do_rescale")) cfg.do_rescale = boolean(j["do_rescale"], "do_rescale");
  if (j.contains("do_normalize")) cfg.do_normalize = boolean(j["do_normalize"], "do_normalize");
  if (j.contains("rescale_factor")) {
    const double r = json_real(j["rescale_factor"], "preprocessor config: 'rescale_factor'", 0, 1e6);
    if (!(r > 0)) throw InputError("preprocessor config: 'rescale_factor' must be a positive number, got 0");
    cfg.rescale_factor = static_cast<float>(r);
  }
  if (j.contains("image_mean")) cfg.mean = three(j["image_mean"], "image_mean", false);
  if (j.contains("image_std")) cfg.std = three(j["image_std"], "image_std", true);
  if (j.contains("resample")) {
    const auto& v = j["resample"];
    if (!v.is_number_integer() || v != 3)
      throw InputError("preprocessor config: 'resample' must be 3 (bicubic, the only filter "
                       "kvlens implements), got " + v.dump());
  }
  if (j.contains("do_pad")) cfg.pad_to_square = boolean(j["do_pad"], "do_pad");
  if (j.contains("pad_to_square"))
    cfg.pad_to_square = boolean(j["pad_to_square"], "pad_to_square");
  if (j.contains("image_aspect_ratio")) {
    const auto& v = j["image_aspect_ratio"];
    if (!v.is_string())
      throw InputError("preprocessor config: 'image_aspect_ratio' must be a string, got " +
                       v.dump());
    cfg.pad_to_square = v.get<std::string>() == "pad";
  }
  return cfg;
}

}  // namespace kvlens
