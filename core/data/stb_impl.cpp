// The stb_image and stb_image_write implementations (Debian's libstb-dev headers), compiled in
// this file alone so that their build flags stay apart from kvlens's own code: the sanitizer
// build exempts this file from one UBSan check (nonnull-attribute: stb calls memcpy with a null
// destination and a length of 0 on empty PNG chunks, which copies nothing).
//
// Formats that PIL also opens; TGA (weak signature), PSD, HDR and PIC are left out so that
// arbitrary bytes are not mistaken for an image.
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_ONLY_BMP
#define STBI_ONLY_GIF
#define STBI_ONLY_PNM
#define STBI_NO_STDIO  // files are read by kvlens, so that each failure gets its own message
#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_WRITE_IMPLEMENTATION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#include "stb_image.h"
#include "stb_image_write.h"
#pragma GCC diagnostic pop
