// libFuzzer harness: config.json → LLaVA / LLaVA-NeXT, InternVL, Qwen2-VL / Qwen2.5-VL and
// text-only model configs, and preprocessor_config.json → image preprocessing configs (CLIP's and
// Qwen2-VL's patches). Bad input may only ever throw InputError; an accepted config keeps
// the invariants the models rely on.
#include <cstddef>
#include <cstdint>

#include "core/errors.h"
#include "core/data/image.h"
#include "models/preprocess/clip_image.h"
#include "models/preprocess/qwen_patches.h"
#include "models/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, false);
  if (j.is_discarded()) return 0;
  try {
    const kvlens::LlavaConfig c = kvlens::parse_llava_config(j, "fuzz/config.json");
    const int needed = c.encoder_layers_needed();
    if (needed < 0 || needed > c.vision.num_hidden_layers) __builtin_trap();
    if (c.text.num_attention_heads % c.text.num_key_value_heads != 0) __builtin_trap();
    if (c.n_visual_tokens() <= 0) __builtin_trap();
  } catch (const kvlens::InputError&) {
  }
  try {  // InternVL: the tiles' grid must shuffle 2×2
    const kvlens::InternVLConfig c = kvlens::parse_internvl_config(j, "fuzz/config.json");
    if (c.vision.grid() % 2 || c.tokens_per_tile() <= 0) __builtin_trap();
    if (c.text.num_attention_heads % c.text.num_key_value_heads != 0) __builtin_trap();
  } catch (const kvlens::InputError&) {
  }
  try {
    const kvlens::LlamaConfig c = kvlens::parse_text_only_config(j, "fuzz/config.json");
    if (c.head_dim % 2 || c.rope.inv_freq(c.head_dim).size() != static_cast<size_t>(c.head_dim / 2)) __builtin_trap();
  } catch (const kvlens::InputError&) {
  }
  try {
    kvlens::preprocess_config_from_json(j, 224);
  } catch (const kvlens::InputError&) {
  }
  try {  // Qwen2-VL: M-RoPE sections that split the head, heads the axial rope can halve twice, whole windows
    const kvlens::Qwen2VLConfig c = kvlens::parse_qwen2_vl_config(j, "fuzz/config.json");
    if (c.text.rope.row_of(c.text.head_dim).size() != static_cast<size_t>(c.text.head_dim / 2)) __builtin_trap();
    if (c.vision.head_dim() % 4 || c.text.num_attention_heads % c.text.num_key_value_heads != 0) __builtin_trap();
    if (c.vision.windowed && c.vision.window_size % (c.vision.patch_size * c.vision.spatial_merge_size)) __builtin_trap();
  } catch (const kvlens::InputError&) {
  }
  try {  // Qwen2-VL's processor: a grid of whole merge blocks
    const kvlens::QwenPatchConfig p = kvlens::qwen_patch_config_from_json(j, "fuzz/preprocessor_config.json");
    const auto g = kvlens::qwen_patch_grid(37, 100, p);
    if (g[0] <= 0 || g[1] <= 0 || g[0] % p.merge_size || g[1] % p.merge_size) __builtin_trap();
  } catch (const kvlens::InputError&) {
  }
  return 0;
}
