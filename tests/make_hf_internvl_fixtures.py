#!/usr/bin/env python3
"""Build tiny InternVL reference checkpoints (HF InternVLForConditionalGeneration, the "-hf"
layout) and record HF transformers outputs, as tests/make_hf_fixtures.py does for LLaVA-1.5.

Each folder under --out (default tests/fixtures/hf) is a complete HF model directory (config,
safetensors, a byte-level BPE tokenizer.json with InternVL's <img>, </img> and <IMG_CONTEXT>, a
GotOcr2ImageProcessor config with crop_to_patches, a chat template) with random weights, an image
whose size needs several tiles and a thumbnail, and:

  expected.json        prompt, template, prompt ids (InternVLProcessor's), greedy ids, margins,
                       the token count, metadata
  pixel_values.f32     the PIL-backend GotOcr2ImageProcessor's output [tiles + 1, 3, S, S]
  image_features.f32   the projected features of every tile [N, hidden]
  logits.f32, attn0.f32, step_logits.f32   as the other fixtures
  processor_cases.json images of other sizes, with the processor's pixel values and token count

Folders:

  internvl_qwen2_fp32     Qwen2 decoder; InternViT with q/k biases, q/k RMSNorm and a final
                          LayerNorm; a 100x37 image: 3x1 tiles and a thumbnail.
  internvl_llama3_bf16    Llama-3-style decoder (llama3 rope, BPE); InternViT with RMSNorm layers,
                          no biases, mean pooling (no final norm), feature layer -2; bf16, the
                          "-hf" hub's tensor names (model.*, lm_head) in shards; a 30x90 image:
                          1x3 tiles and a thumbnail.

Usage: python3 tests/make_hf_internvl_fixtures.py [--out tests/fixtures/hf]
"""

import argparse
import json
import os
import sys

import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer
from transformers import (AutoProcessor, InternVLConfig, InternVLForConditionalGeneration, LlamaConfig, Qwen2Config)
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import greedy_decode, random_init  # noqa: E402
from make_hf_next_fixtures import build_first_clear, clear_greedy, fresh_folder, image_expected, make_wide_image, save_weights, write_processor_cases, write_references  # noqa: E402
from hf_layouts import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = "Describe the image."
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
CHAT = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
        "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEMPLATE = "<|im_start|>user\n<image>\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
SPECS = [
    dict(name="internvl_qwen2_fp32", dtype=torch.float32, seed=41, tokenizer="qwen2_style", image_wh=(100, 37),
         max_patches=6, text_cls=Qwen2Config,
         text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024, rope_parameters={"rope_type": "default",
                                                                                          "rope_theta": 1000000.0}),
         vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                     patch_size=7, attention_bias=True, use_qk_norm=True, use_mean_pooling=False,
                     norm_type="layer_norm", layer_scale_init_value=0.5),
         internvl=dict(vision_feature_layer=-1)),
    dict(name="internvl_llama3_bf16", dtype=torch.bfloat16, seed=51, tokenizer="llama3_style", image_wh=(30, 90),
         layout="model_prefix", shards="200KB",
         max_patches=4, text_cls=LlamaConfig,
         text=dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
         vision=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=3, image_size=42,
                     patch_size=7, attention_bias=False, use_qk_norm=False, use_mean_pooling=True,
                     norm_type="rms_norm", layer_scale_init_value=0.3),
         internvl=dict(vision_feature_layer=-2, tie_word_embeddings=False)),
]
SPECIALS = ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]


def write_tokenizer(folder, family):
    src = os.path.join(HERE, "fixtures", "tokenizers", family)
    tok = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(os.path.join(folder, "tokenizer.json"))
    cfg = json.load(open(os.path.join(src, "tokenizer_config.json")))
    cfg["extra_special_tokens"] = {"start_image_token": "<img>", "end_image_token": "</img>",
                                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    cfg["processor_class"] = "InternVLProcessor"
    write_json(os.path.join(folder, "tokenizer_config.json"), cfg)
    return tok


def preprocessor_config(spec):
    s = spec["vision"]["image_size"]
    return {"crop_to_patches": True, "min_patches": 1, "max_patches": spec["max_patches"], "do_convert_rgb": True,
            "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": IMAGENET_MEAN,
            "image_std": IMAGENET_STD, "image_processor_type": "GotOcr2ImageProcessor",
            "processor_class": "InternVLProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
            "size": {"height": s, "width": s}}


@torch.no_grad()
def build_seed(spec, out_root, seed):
    folder = fresh_folder(out_root, spec["name"])
    tok = write_tokenizer(folder, spec["tokenizer"])
    vocab = (tok.get_vocab_size() + 7) // 8 * 8
    ctx_id = tok.token_to_id("<IMG_CONTEXT>")
    eos = tok.token_to_id("<|im_end|>") or tok.token_to_id("<|eot_id|>")
    tc = spec["text_cls"](vocab_size=vocab, eos_token_id=eos, **spec["text"])
    v = spec["vision"]
    per = (v["image_size"] // v["patch_size"] // 2) ** 2
    cfg = InternVLConfig(vision_config=InternVLVisionConfig(**v), text_config=tc, image_token_id=ctx_id,
                         image_seq_length=per, **spec["internvl"])
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(cfg)
    random_init(model, seed, 0.15)
    with torch.no_grad():  # layer scale away from 1 so that folding it is tested
        for name, p in model.named_parameters():
            if name.endswith("lambda_1") or name.endswith("lambda_2"):
                p.copy_(v["layer_scale_init_value"] * (1 + 0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))))
    save_weights(model, spec, folder)
    del model
    write_json(os.path.join(folder, "preprocessor_config.json"), preprocessor_config(spec))
    write_json(os.path.join(folder, "processor_config.json"), {"image_seq_length": per, "processor_class": "InternVLProcessor"})
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(CHAT)
    w, h = spec["image_wh"]
    make_wide_image(w, h, seed).save(os.path.join(folder, "image.png"))
    image = Image.open(os.path.join(folder, "image.png")).convert("RGB")

    improc = GotOcr2ImageProcessorPil(**{k: v for k, v in preprocessor_config(spec).items()
                                         if k not in ("image_processor_type", "processor_class")})
    pixel_values = improc(images=image, return_tensors="pt")["pixel_values"].float()
    proc = AutoProcessor.from_pretrained(folder)
    text = TEMPLATE.replace("<image>", "<IMG_CONTEXT>").replace("{prompt}", PROMPT)
    enc = proc(images=image, text=text, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    n_visual = ids.count(ctx_id)
    assert n_visual == pixel_values.shape[0] * per, (n_visual, pixel_values.shape)
    hf_pv_diff = float((enc["pixel_values"].float() - pixel_values).abs().max())
    rendered = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
                                        add_generation_prompt=True, tokenize=False)
    ref = InternVLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    x = torch.tensor([ids])
    feats = ref.model.get_image_features(pixel_values=pixel_values, return_dict=True).pooler_output
    feats = feats.reshape(-1, feats.shape[-1])
    out = ref(input_ids=x, pixel_values=pixel_values, output_attentions=True, use_cache=True)
    greedy, margins, steps = greedy_decode(ref, out)
    if not clear_greedy(spec["name"], seed, greedy, margins, lambda t: t < tok.get_vocab_size()):
        return False
    write_references(folder, pixel_values, feats, out, steps)
    def process(image, w, h):
        pv = improc(images=image, return_tensors="pt")["pixel_values"].float()
        return pv, {"n_visual_tokens": int(pv.shape[0]) * per}

    write_processor_cases(folder, process)
    write_json(os.path.join(folder, "expected.json"), image_expected(
        spec, seed, "InternVLForConditionalGeneration", TEMPLATE, ids, greedy, margins, n_visual, ctx_id, (w, h),
        {"tokens_per_tile": per}, improc, pixel_values, hf_pv_diff, feats, out, vocab, rendered))
    print("%-22s seed %d, %dx%d image, %d tiles + thumbnail, %d visual tokens, %d prompt ids, greedy %s, margin %.3g, "
          "HF processor pixel diff %s" % (spec["name"], seed, w, h, pixel_values.shape[0] - 1, n_visual, len(ids), greedy,
                                          min(margins), hf_pv_diff))
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "fixtures", "hf"))
    args = ap.parse_args()
    for spec in SPECS:
        build_first_clear(spec, build_seed, args.out)


if __name__ == "__main__":
    main()
