#!/usr/bin/env python3
"""Build tiny Qwen2-VL and Qwen2.5-VL reference checkpoints (HF Qwen2VLForConditionalGeneration,
Qwen2_5_VLForConditionalGeneration) and record HF transformers outputs, as
tests/make_hf_internvl_fixtures.py does for InternVL.

Each folder under --out (default tests/fixtures/hf) is a complete HF model directory (config,
safetensors, a byte-level BPE tokenizer.json with <|vision_start|>, <|vision_end|> and
<|image_pad|>, a Qwen2VLImageProcessor config, a chat template) with random weights, a
non-square image, and:

  expected.json        prompt, template, prompt ids (Qwen2VLProcessor's), greedy ids, margins,
                       the token count, the M-RoPE positions and rope_deltas, metadata
  pixel_values.f32     the PIL-backend Qwen2VLImageProcessor's output [patches, 3·2·P·P]
  image_features.f32   the merger's output [tokens, hidden]
  logits.f32, attn0.f32, step_logits.f32   as the other fixtures
  processor_cases.json images of other sizes, with the processor's pixel values and token count

Folders:

  qwen2vl_fp32          transformers 5 save_pretrained's names (the hub's: visual.*, model.*, lm_head)
                        and config (text_config, rope_parameters); a 100x37 image.
  qwen2vl_bf16_inmem    bf16, the in-memory module names (model.visual.*, model.language_model.*) in
                        shards, and the hub's flat config (rope_scaling {type: mrope}); a 45x80 image.
  qwen25vl_fp32         Qwen2.5-VL: RMSNorm, gated MLP, windows of 2x2 merged blocks (partial ones at
                        the grid's edges) with full attention in blocks 1 and 3; a 100x37 image.

Usage: python3 tests/make_hf_qwen2vl_fixtures.py [--out tests/fixtures/hf]
"""

import argparse
import json
import os
import sys

import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer
from transformers import (AutoProcessor, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import CLIP_MEAN, CLIP_STD, greedy_decode, random_init  # noqa: E402
from make_hf_next_fixtures import build_first_clear, clear_greedy, fresh_folder, image_expected, make_wide_image, save_weights, write_processor_cases, write_references  # noqa: E402
from hf_layouts import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = "Describe the image."
CHAT = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
        "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEMPLATE = "<|im_start|>user\n<|vision_start|><image><|vision_end|>{prompt}<|im_end|>\n<|im_start|>assistant\n"
SPECS = [
    dict(name="qwen2vl_fp32", dtype=torch.float32, seed=61, image_wh=(100, 37), patch=6, min_pixels=12 * 12 * 4,
         max_pixels=12 * 12 * 40,
         text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024,
                   rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0}),
         vision=dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_act="quick_gelu")),
    dict(name="qwen2vl_bf16_inmem", dtype=torch.bfloat16, seed=71, image_wh=(45, 80), patch=4, min_pixels=8 * 8 * 4,
         max_pixels=8 * 8 * 30, layout="qwen_inmem", shards="150KB",
         text=dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                   num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 1000000.0}),
         vision=dict(depth=3, embed_dim=48, num_heads=3, mlp_ratio=2, hidden_act="quick_gelu")),
    dict(name="qwen25vl_fp32", family="qwen2_5_vl", dtype=torch.float32, seed=81, image_wh=(100, 37), patch=6,
         min_pixels=12 * 12 * 4, max_pixels=12 * 12 * 40,
         text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024,
                   rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0}),
         vision=dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, hidden_act="silu", window_size=24,
                     fullatt_block_indexes=[1, 3])),
]
SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def write_tokenizer(folder):
    src = os.path.join(HERE, "fixtures", "tokenizers", "qwen2_style")
    tok = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(os.path.join(folder, "tokenizer.json"))
    cfg = json.load(open(os.path.join(src, "tokenizer_config.json")))
    cfg["processor_class"] = "Qwen2VLProcessor"
    write_json(os.path.join(folder, "tokenizer_config.json"), cfg)
    return tok


def preprocessor_config(spec):
    return {"min_pixels": spec["min_pixels"], "max_pixels": spec["max_pixels"], "patch_size": spec["patch"],
            "temporal_patch_size": 2, "merge_size": 2, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
            "do_resize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "resample": 3,
            "rescale_factor": 0.00392156862745098, "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor"}


def hub_config(folder):
    """The hub's flat Qwen2-VL config: the decoder's keys at the top level, M-RoPE as rope_scaling."""
    c = json.load(open(os.path.join(folder, "config.json")))
    t = c.pop("text_config")
    rp = t.pop("rope_parameters")
    t.pop("model_type", None)
    c.update(t)
    c["rope_theta"] = rp["rope_theta"]
    c["rope_scaling"] = {"type": "mrope", "mrope_section": rp["mrope_section"]}
    c["vision_config"].pop("rope_parameters", None)
    c["vision_config"]["in_chans"] = c["vision_config"].pop("in_channels")
    write_json(os.path.join(folder, "config.json"), c)


@torch.no_grad()
def build_seed(spec, out_root, seed):
    folder = fresh_folder(out_root, spec["name"])
    tok = write_tokenizer(folder)
    vocab = (tok.get_vocab_size() + 7) // 8 * 8
    pad_id = tok.token_to_id("<|image_pad|>")
    eos = tok.token_to_id("<|im_end|>")
    text = dict(spec["text"], vocab_size=vocab, eos_token_id=eos, bos_token_id=None)
    v25 = spec.get("family") == "qwen2_5_vl"
    out_key = "out_hidden_size" if v25 else "hidden_size"  # (Qwen2.5-VL's hidden_size is the tower's width)
    vision = dict(spec["vision"], patch_size=spec["patch"], spatial_merge_size=2, temporal_patch_size=2,
                  **{out_key: text["hidden_size"]})
    config_cls, model_cls = (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration) if v25 else \
        (Qwen2VLConfig, Qwen2VLForConditionalGeneration)
    cfg = config_cls(text_config=text, vision_config=vision, image_token_id=pad_id,
                        vision_start_token_id=tok.token_to_id("<|vision_start|>"),
                        vision_end_token_id=tok.token_to_id("<|vision_end|>"),
                        video_token_id=tok.token_to_id("<|video_pad|>"),
                        tie_word_embeddings=text.get("tie_word_embeddings", False))
    torch.manual_seed(seed)
    model = model_cls(cfg)
    random_init(model, seed, 0.15)
    save_weights(model, spec, folder)
    del model
    write_json(os.path.join(folder, "preprocessor_config.json"), preprocessor_config(spec))
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(CHAT)
    w, h = spec["image_wh"]
    make_wide_image(w, h, seed).save(os.path.join(folder, "image.png"))
    image = Image.open(os.path.join(folder, "image.png")).convert("RGB")

    improc = Qwen2VLImageProcessorPil(**{k: v for k, v in preprocessor_config(spec).items()
                                        if k not in ("image_processor_type", "processor_class")})
    pv_out = improc(images=image, return_tensors="pt")
    pixel_values, grid_thw = pv_out["pixel_values"].float(), pv_out["image_grid_thw"]
    proc = AutoProcessor.from_pretrained(folder)
    prompt_text = TEMPLATE.replace("<image>", "<|image_pad|>").replace("{prompt}", PROMPT)
    enc = proc(images=image, text=prompt_text, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    n_visual = ids.count(pad_id)
    assert n_visual == pixel_values.shape[0] // 4, (n_visual, pixel_values.shape)
    hf_pv_diff = float((enc["pixel_values"].float() - pixel_values).abs().max())
    rendered = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
                                        add_generation_prompt=True, tokenize=False)
    if spec.get("layout"):
        hub_config(folder)  # (after the processor read the folder: HF loads this layout too)
    ref = model_cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    x = torch.tensor([ids])
    feats = ref.model.get_image_features(pixel_values=pixel_values, image_grid_thw=grid_thw, return_dict=True).pooler_output
    feats = torch.cat(list(feats), 0) if isinstance(feats, (list, tuple)) else feats.reshape(-1, feats.shape[-1])
    positions, deltas = ref.model.get_rope_index(x, enc["mm_token_type_ids"], grid_thw)
    out = ref(input_ids=x, pixel_values=pixel_values, image_grid_thw=grid_thw, mm_token_type_ids=enc["mm_token_type_ids"],
              output_attentions=True, use_cache=True)
    greedy, margins, steps = greedy_decode(ref, out)
    if not clear_greedy(spec["name"], seed, greedy, margins, lambda t: t < tok.get_vocab_size()):
        return False
    write_references(folder, pixel_values, feats, out, steps)
    def process(image, w, h):
        po = improc(images=image, return_tensors="pt")
        pv = po["pixel_values"].float()
        return pv, {"n_visual_tokens": int(pv.shape[0]) // 4, "grid_thw": po["image_grid_thw"][0].tolist()}

    write_processor_cases(folder, process)
    write_json(os.path.join(folder, "expected.json"), image_expected(
        spec, seed, model_cls.__name__, TEMPLATE, ids, greedy, margins, n_visual, pad_id, (w, h),
        {"grid_thw": grid_thw[0].tolist(), "mrope_positions": positions[:, 0, :].tolist(),
         "rope_deltas": int(deltas[0, 0])},
        improc, pixel_values, hf_pv_diff, feats, out, vocab, rendered))
    print("%-18s seed %d, %dx%d image, grid %s, %d visual tokens, %d prompt ids, rope_deltas %d, greedy %s, margin %.3g, "
          "HF processor pixel diff %s" % (spec["name"], seed, w, h, grid_thw[0].tolist(), n_visual, len(ids),
                                          int(deltas[0, 0]), greedy, min(margins), hf_pv_diff))
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "fixtures", "hf"))
    ap.add_argument("--only", help="build this folder alone")
    args = ap.parse_args()
    for spec in SPECS:
        if not args.only or args.only == spec["name"]:
            build_first_clear(spec, build_seed, args.out)


if __name__ == "__main__":
    main()
