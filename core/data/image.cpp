// Image decoding (libjpeg-turbo, stb_image) with the checks that refuse bad files before any
// pixel is decoded, and PNG writing (stb_image_write).
#include "core/data/image.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/errors.h"
#include "core/files.h"
#include "core/numbers.h"

// The stb implementations are compiled in core/data/stb_impl.cpp.
#define STBI_NO_STDIO
#include "stb_image.h"
#include "stb_image_write.h"

#ifdef KVLENS_HAVE_LIBJPEG
#include <jpeglib.h>

#include <csetjmp>
#endif

namespace kvlens {

namespace {

std::string stb_reason() {
  const char* r = stbi_failure_reason();
  return r ? r : "unknown failure";
}


// Width and height from a PNG's IHDR, or false when `bytes` does not start like a PNG. Used to
// report an oversized PNG as such: stb_image refuses large ones in its header check with the
// reason of whichever format it tried last.
bool png_header_size(const uint8_t* b, size_t n, int64_t* w, int64_t* h) {
  static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (n < 24 || std::memcmp(b, sig, 8) != 0 || std::memcmp(b + 12, "IHDR", 4) != 0) return false;
  auto be32 = [](const uint8_t* p) {
    return int64_t{p[0]} << 24 | int64_t{p[1]} << 16 | int64_t{p[2]} << 8 | int64_t{p[3]};
  };
  *w = be32(b + 16);
  *h = be32(b + 20);
  return true;
}

std::string too_large(const std::string& name, int64_t w, int64_t h, int64_t max_pixels) {
  return name + ": image is " + std::to_string(w) + "x" + std::to_string(h) +
         " pixels, expected at most " + std::to_string(max_pixels) + " pixels in all";
}

// stb_image trusts a JPEG's Huffman table sizes: a DHT segment whose 16 code counts add up to
// more than 256 symbols makes it write past its tables. Such tables are invalid JPEG, so the
// markers are walked here first, the way the decoder walks them (skipping junk between
// segments), and the file is refused naming it.
void check_jpeg_tables(const uint8_t* b, size_t n, const std::string& name) {
  // The start-of-image marker may follow fill bytes (0xFF 0xFF 0xD8), as before any marker.
  if (n < 4 || b[0] != 0xFF) return;
  size_t i = 1;
  while (i < n && b[i] == 0xFF) ++i;
  if (i >= n || b[i] != 0xD8) return;
  ++i;
  while (i + 4 <= n) {
    if (b[i] != 0xFF) {  // junk between segments: the decoder skips it byte by byte, so do we
      ++i;
      continue;
    }
    while (i < n && b[i] == 0xFF) ++i;  // fill bytes
    if (i >= n) return;
    const uint8_t m = b[i++];
    if (m == 0xD9) return;                                  // end of image
    if (m == 0x01 || (m >= 0xD0 && m <= 0xD8)) continue;   // markers without a length
    if (i + 2 > n) return;
    const size_t len = size_t{b[i]} << 8 | b[i + 1];
    if (len < 2) return;
    if (m == 0xC4) {
      // The decoder reads tables while its length count says so, even past the end of the
      // file's bytes that remain, so each table header present is checked.
      // Counts past the end of the file read as 0 there, so a cut-off header adds up the
      // counts it holds.
      size_t p = i + 2;
      while (p < i + len && p + 1 < n) {
        size_t symbols = 0;
        for (size_t k = 1; k <= 16 && p + k < n; ++k) symbols += b[p + k];
        if (symbols > 256)
          throw InputError(name + ": corrupt JPEG (a Huffman table lists " + std::to_string(symbols) +
                           " codes, at most 256 are possible)");
        p += 17 + symbols;
      }
    }
    if (i + len > n) return;
    i += len;
    if (m == 0xDA) {  // entropy-coded data runs to the next marker that is not stuffing or RST
      while (i + 1 < n && !(b[i] == 0xFF && b[i + 1] != 0x00 && !(b[i + 1] >= 0xD0 && b[i + 1] <= 0xD7))) ++i;
    }
  }
}

// stb_image's 16-bit PNM path reads past its buffer, and its header numbers overflow an int:
// 16-bit PNM (maxval > 255) and header numbers past 2^31 - 1 are refused before decoding. The header is "P5"/"P6", whitespace and comments, width, height, maxval.
void check_pnm_depth(const uint8_t* b, size_t n, const std::string& name) {
  if (n < 2 || b[0] != 'P' || (b[1] != '5' && b[1] != '6')) return;
  size_t i = 2;
  long fields[3] = {0, 0, 0};
  for (long& f : fields) {
    for (;;) {  // whitespace and # comments
      while (i < n && std::isspace(b[i])) ++i;
      if (i < n && b[i] == '#') {
        while (i < n && b[i] != '\n' && b[i] != '\r') ++i;
        continue;
      }
      break;
    }
    if (i >= n || !std::isdigit(b[i])) return;
    // stb_image reads each number into an int without a bound; one that does not fit is refused.
    while (i < n && std::isdigit(b[i])) {
      const int d = b[i++] - '0';
      if (f > (std::numeric_limits<int>::max() - d) / 10)
        throw InputError(name + ": PNM header holds a number larger than " +
                         std::to_string(std::numeric_limits<int>::max()) + "; expected its width, height and maxval");
      f = f * 10 + d;
    }
  }
  if (fields[2] > 255)
    throw InputError(name + ": 16-bit PNM (maxval " + std::to_string(fields[2]) +
                     ") is not supported; expected 8-bit PNM, PNG, JPEG, BMP or GIF");
}

#ifdef KVLENS_HAVE_LIBJPEG
// JPEG through libjpeg-turbo, the decoder PIL uses (default settings: islow IDCT, fancy
// upsampling), so pixels match PIL's. Grey becomes RGB; CMYK becomes RGB as PIL converts it,
// r = (255 − c)(255 − k) / 255 rounded, with Adobe files' inverted CMYK undone first.
struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {0};
};

RGBImage decode_jpeg(const uint8_t* bytes, size_t n, const std::string& name, int64_t max_pixels) {
  jpeg_decompress_struct cinfo;
  JpegError err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = [](j_common_ptr c) {
    auto* e = reinterpret_cast<JpegError*>(c->err);
    e->mgr.format_message(c, e->message);
    std::longjmp(e->jump, 1);
  };
  err.mgr.emit_message = [](j_common_ptr, int) {};  // warnings (corrupt data recovered) stay quiet, as in PIL
  RGBImage img;
  std::vector<uint8_t> row;
  // Nothing with a destructor may be created between setjmp and a longjmp back to it.
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    throw InputError(name + ": cannot decode JPEG (libjpeg: " + std::string(err.message) + ")");
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, bytes, static_cast<unsigned long>(n));
  jpeg_read_header(&cinfo, TRUE);
  const int64_t w = cinfo.image_width, h = cinfo.image_height;
  if (w <= 0 || h <= 0 || w * h > max_pixels) {
    jpeg_destroy_decompress(&cinfo);
    throw InputError(too_large(name, w, h, max_pixels));
  }
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  jpeg_start_decompress(&cinfo);
  const int nc = cinfo.output_components;
  img.width = static_cast<int>(w);
  img.height = static_cast<int>(h);
  img.source = name;
  img.data.resize(static_cast<size_t>(w) * h * 3);
  row.resize(static_cast<size_t>(w) * nc);
  const bool inverted = cmyk && cinfo.saw_Adobe_marker;
  while (cinfo.output_scanline < cinfo.output_height) {
    const size_t y = cinfo.output_scanline;
    JSAMPROW r = row.data();
    jpeg_read_scanlines(&cinfo, &r, 1);
    uint8_t* dst = &img.data[y * static_cast<size_t>(w) * 3];
    if (!cmyk) {
      std::memcpy(dst, row.data(), static_cast<size_t>(w) * 3);
      continue;
    }
    for (int64_t x = 0; x < w; ++x) {
      const uint8_t* px = &row[static_cast<size_t>(x) * 4];
      const int k = inverted ? px[3] : 255 - px[3];
      for (int c = 0; c < 3; ++c) {
        const int v = (inverted ? px[c] : 255 - px[c]) * k + 128;  // (255 − c)(255 − k) / 255
        dst[x * 3 + c] = static_cast<uint8_t>((v + (v >> 8)) >> 8);
      }
    }
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return img;
}
#endif

}  // namespace

// ---------------------------------------------------------------------------------------------
// Decoding and writing

RGBImage decode_image(const uint8_t* bytes, size_t n, const std::string& name, int64_t max_pixels) {
  if (bytes == nullptr || n == 0)
    throw InputError(name + ": empty input (0 bytes), expected an image");
  if (n > static_cast<size_t>(std::numeric_limits<int>::max()))
    throw InputError(name + ": " + std::to_string(n) + " bytes is too large for an image file");
  const int len = static_cast<int>(n);
#ifdef KVLENS_HAVE_LIBJPEG
  if (n >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF) return decode_jpeg(bytes, n, name, max_pixels);
  // Of the formats read here only JPEG starts with 0xFF. Bytes that do without its FF D8 FF
  // signature (fill bytes before the start marker, say) are refused, as libjpeg and PIL refuse
  // them, rather than handed to stb_image's JPEG decoder.
  if (bytes[0] == 0xFF)
    throw InputError(name + ": not a readable image (it starts like a JPEG without the JPEG signature FF D8 FF); "
                     "expected PNG, JPEG, BMP, GIF or PNM");
#endif
  check_jpeg_tables(bytes, n, name);
  check_pnm_depth(bytes, n, name);
  int w = 0, h = 0, comp = 0;
  const bool known = stbi_info_from_memory(bytes, len, &w, &h, &comp);
  // A top-down BMP stores a negative height; stb_image's info call passes it on as is (the
  // decoder itself flips such images correctly).
  if (known && h < 0 && h != std::numeric_limits<int>::min()) h = -h;
  if (!known) {
    const std::string reason = stb_reason();
    int64_t pw = 0, ph = 0;
    // Each side is at most 2^32 - 1, so the product is taken in unsigned 64 bits.
    if (png_header_size(bytes, n, &pw, &ph) && static_cast<uint64_t>(pw) * static_cast<uint64_t>(ph) > static_cast<uint64_t>(max_pixels))
      throw InputError(too_large(name, pw, ph, max_pixels));
    throw InputError(name + ": not a readable image (stb_image: " + reason +
                     "); expected PNG, JPEG, BMP, GIF or PNM");
  }
  const int64_t pixels = static_cast<int64_t>(w) * h;
  if (w <= 0 || h <= 0 || pixels > max_pixels) throw InputError(too_large(name, w, h, max_pixels));
  int dw = 0, dh = 0, dc = 0;
  // 16-bit images come back as 8 bits by keeping the high byte of each sample (v >> 8). PIL
  // does the same for 16-bit RGB / RGBA PNGs; for 16-bit grey PIL clips v to 255 instead.
  stbi_uc* px = stbi_load_from_memory(bytes, len, &dw, &dh, &dc, 3);
  if (px == nullptr)
    throw InputError(name + ": cannot decode image (stb_image: " + stb_reason() + ")");
  if (dw != w || dh != h) {
    stbi_image_free(px);
    throw InputError(name + ": image header says " + std::to_string(w) + "x" +
                     std::to_string(h) + " but the decoded image is " + std::to_string(dw) +
                     "x" + std::to_string(dh));
  }
  RGBImage img;
  img.width = w;
  img.height = h;
  img.source = name;
  img.data.assign(px, px + static_cast<size_t>(pixels) * 3);
  stbi_image_free(px);
  return img;
}

void check_image(const RGBImage& img, const char* what) {
  if (img.width <= 0 || img.height <= 0 ||
      img.data.size() != static_cast<size_t>(img.width) * img.height * 3)
    throw InputError(std::string(what) + ": expected a non-empty RGB image with width*height*3 "
                     "bytes, got " + std::to_string(img.width) + "x" +
                     std::to_string(img.height) + " with " + std::to_string(img.data.size()) +
                     " bytes");
}

RGBImage load_image(const std::string& path) {
  const std::string bytes = read_input_file(path, "image file", std::numeric_limits<int>::max());
  if (bytes.empty()) throw InputError(path + ": image file is empty (0 bytes)");
  return decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
}

std::string encode_png(const RGBImage& img) {
  check_image(img, "encode_png");
  std::string out;
  auto sink = [](void* ctx, void* data, int size) {
    static_cast<std::string*>(ctx)->append(static_cast<const char*>(data), static_cast<size_t>(size));
  };
  if (!stbi_write_png_to_func(sink, &out, img.width, img.height, 3, img.data.data(), img.width * 3))
    throw InternalError("stb_image_write could not encode a " + std::to_string(img.width) + "x" +
                        std::to_string(img.height) + " PNG");
  return out;
}

std::string encode_png_rgba(int w, int h, const uint8_t* rgba) {
  if (w <= 0 || h <= 0 || !rgba || static_cast<int64_t>(w) * h > kMaxImagePixels)
    throw InternalError("encode_png_rgba: " + std::to_string(w) + "x" + std::to_string(h) + " pixels");
  std::string out;
  auto sink = [](void* ctx, void* data, int size) {
    static_cast<std::string*>(ctx)->append(static_cast<const char*>(data), static_cast<size_t>(size));
  };
  if (!stbi_write_png_to_func(sink, &out, w, h, 4, rgba, w * 4))
    throw InternalError("stb_image_write could not encode a " + std::to_string(w) + "x" + std::to_string(h) + " RGBA PNG");
  return out;
}

void write_png(const std::string& path, const RGBImage& img) {
  check_image(img, ("write_png " + path).c_str());
  write_file_atomic(path, encode_png(img), "PNG image");
}

}  // namespace kvlens
