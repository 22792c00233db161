#!/usr/bin/env python3
"""Make a 7B/8B-class checkpoint of another family with random fp16 weights, and time HF
transformers on it, as tests/make_llava7b.py does for LLaVA-1.5-7B.

Families (the shapes of the published checkpoints):

  llava_next_mistral  LLaVA-v1.6-Mistral-7B: CLIP ViT-L/14-336, anyres pinpoints up to 672x672,
                      Mistral-7B (32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 14336)
  internvl3_8b        InternVL3-8B: InternViT-300M (24 layers, hidden 1024, 448-px tiles, 1-12 tiles
                      and a thumbnail), Qwen2.5-7B (28 layers, hidden 3584, 28 heads, 4 KV heads,
                      MLP 18944, q/k/v biases)
  qwen2vl_7b          Qwen2-VL-7B: its vision tower (32 blocks, width 1280, 14-px patches merged 2x2),
                      Qwen2-7B with M-RoPE (28 layers, hidden 3584, 28 heads, 4 KV heads, MLP 18944)
  qwen25vl_7b         Qwen2.5-VL-7B: its windowed tower (32 blocks, width 1280, MLP 3420, 112-px windows,
                      full attention in blocks 7, 15, 23, 31), the same decoder shape as Qwen2-VL-7B
  llama3_8b           Llama-3.1-8B text: 32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 14336,
                      llama3 rope scaling, vocabulary 128256

The tokenizer is a small fixture tokenizer (ids past its vocabulary are never decoded: only
speed is measured); the image families ship the chat template that makes kvlens's default
template the one HF is timed with. An image family gets bench_image.png (--image-size, default 672x672: LLaVA-NeXT
2x2 tiles + base = 2,928 visual tokens; InternVL 2x2 tiles + thumbnail = 1,280; Qwen2-VL 48x48 patches
merged = 576). The prompt has
--text-tokens text tokens with the checkpoint's default template. HF transformers (SDPA, fp16)
is timed on the same image and prompt: prefill, generate() and a plain cached loop.

Usage (GPU host):  python3 tests/make_family7b.py llava_next_mistral --out /tmp/next7b --json OUT/next7b.json
Dry run (CPU, tiny shapes, no timing claims):  python3 tests/make_family7b.py internvl3_8b --tiny --device cpu --out /tmp/x
"""

import argparse
import json
import os
import shutil
import sys
import time

import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer
from transformers import (AutoProcessor, CLIPVisionConfig, InternVLConfig, InternVLForConditionalGeneration,
                          LlamaConfig, LlamaForCausalLM, LlavaNextConfig, LlavaNextForConditionalGeneration,
                          MistralConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Config,
                          Qwen2VLConfig, Qwen2VLForConditionalGeneration)
from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_hf_fixtures import llava_prompt_ids, make_image  # noqa: E402
from make_chat_template_fixtures import LLAVA_NEXT_MISTRAL  # noqa: E402
from make_hf_internvl_fixtures import CHAT as INTERNVL_CHAT, IMAGENET_MEAN, IMAGENET_STD, SPECIALS  # noqa: E402
from make_hf_next_fixtures import preprocessor_config as next_preprocessor_config  # noqa: E402
from make_hf_qwen2vl_fixtures import CHAT as QWEN_CHAT, CLIP_MEAN, CLIP_STD, SPECIALS as QWEN_SPECIALS  # noqa: E402
from hf_layouts import write_json  # noqa: E402

EMBEDDED = os.path.join(HERE, "..", "assets", "models", "kvlens-scenes-6m")
WORDS = ("Describe the image in detail, naming every object, its colour, its size and where it is placed "
         "relative to the others, then say what the scene as a whole shows").split()


def shapes(family, tiny):
    """The family's config (tiny: the same structure at toy sizes, for a CPU dry run)."""
    if family == "llava_next_mistral":
        v = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                 image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu")
        t = dict(vocab_size=32064, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, sliding_window=None,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        if tiny:
            v.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
            t.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        return LlavaNextConfig(vision_config=CLIPVisionConfig(**v), text_config=MistralConfig(**t), image_token_index=32000,
                               image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
                               vision_feature_layer=-2, vision_feature_select_strategy="default")
    if family == "internvl3_8b":
        v = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=448,
                 patch_size=14, attention_bias=True, use_qk_norm=False, use_mean_pooling=True, norm_type="layer_norm")
        t = dict(vocab_size=151674, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False)
        if tiny:
            v.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
            t.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        return InternVLConfig(vision_config=InternVLVisionConfig(**v), text_config=Qwen2Config(**t), image_token_id=151667,
                              image_seq_length=256, tie_word_embeddings=False)
    if family in ("qwen2vl_7b", "qwen25vl_7b"):
        v = dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=3584, patch_size=14,
                 spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")
        if family == "qwen25vl_7b":
            v = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu", window_size=112,
                     fullatt_block_indexes=[7, 15, 23, 31])
        t = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                 rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0})
        if tiny:
            v.update(depth=2, num_heads=2, **({"hidden_size": 32, "intermediate_size": 48, "out_hidden_size": 64,
                                               "fullatt_block_indexes": [1]} if family == "qwen25vl_7b"
                                              else {"embed_dim": 32, "hidden_size": 64}))
            t.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0})
        cls = Qwen2_5_VLConfig if family == "qwen25vl_7b" else Qwen2VLConfig
        return cls(vision_config=v, text_config=t, tie_word_embeddings=False)
    t = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=False,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    if tiny:
        t.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return LlamaConfig(**t)


def write_side_files(family, cfg, out, image_size):
    """Tokenizer, processor config and the bench image; returns the prompt template."""
    if family == "llava_next_mistral":
        for f in ("tokenizer.model", "special_tokens_map.json"):
            shutil.copy(os.path.join(EMBEDDED, f), os.path.join(out, f))
        tc = json.load(open(os.path.join(EMBEDDED, "tokenizer_config.json")))
        tc["added_tokens_decoder"] = {k: v for k, v in tc["added_tokens_decoder"].items() if v["content"] != "<image>"}
        tc["added_tokens_decoder"]["32000"] = {"content": "<image>", "lstrip": False, "normalized": False,
                                               "rstrip": False, "single_word": False, "special": True}
        tc["model_max_length"] = 32768
        write_json(os.path.join(out, "tokenizer_config.json"), tc)
        write_json(os.path.join(out, "added_tokens.json"), {"<image>": 32000})
        spec = {"vision": {"image_size": cfg.vision_config.image_size}, "next": {"image_grid_pinpoints": cfg.image_grid_pinpoints}}
        write_json(os.path.join(out, "preprocessor_config.json"), next_preprocessor_config(spec))
        write_json(os.path.join(out, "processor_config.json"), {
            "image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": cfg.vision_config.patch_size,
            "processor_class": "LlavaNextProcessor", "vision_feature_select_strategy": "default"})
        templ = "[INST] <image>\n{prompt} [/INST]"
        write_json(os.path.join(out, "chat_template.json"), {"chat_template": LLAVA_NEXT_MISTRAL})
    elif family in ("qwen2vl_7b", "qwen25vl_7b"):
        src = os.path.join(HERE, "fixtures", "tokenizers", "qwen2_style")
        tok = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
        tok.add_special_tokens([AddedToken(x, special=True, normalized=False) for x in QWEN_SPECIALS])
        tok.save(os.path.join(out, "tokenizer.json"))
        tc = json.load(open(os.path.join(src, "tokenizer_config.json")))
        tc["processor_class"] = "Qwen2_5_VLProcessor" if family == "qwen25vl_7b" else "Qwen2VLProcessor"
        write_json(os.path.join(out, "tokenizer_config.json"), tc)
        # The special tokens at the tokenizer's ids (a small vocabulary).
        for key, piece in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                           ("vision_end_token_id", "<|vision_end|>"), ("video_token_id", "<|video_pad|>")):
            setattr(cfg, key, tok.token_to_id(piece))
        write_json(os.path.join(out, "preprocessor_config.json"), {
            "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
            "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor", "resample": 3,
            "rescale_factor": 1 / 255})
        with open(os.path.join(out, "chat_template.jinja"), "w") as f:
            f.write(QWEN_CHAT)
        templ = "<|im_start|>user\n<|vision_start|><image><|vision_end|>{prompt}<|im_end|>\n<|im_start|>assistant\n"
    else:
        src = os.path.join(HERE, "fixtures", "tokenizers", "qwen2_style" if family == "internvl3_8b" else "llama3_style")
        tok = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
        tc = json.load(open(os.path.join(src, "tokenizer_config.json")))
        if family == "internvl3_8b":
            tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
            # The context token at the config's id: the tokenizer's own id differs (a small vocabulary).
            tc["extra_special_tokens"] = {"start_image_token": "<img>", "end_image_token": "</img>",
                                          "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
            s = cfg.vision_config.image_size
            s = s[0] if isinstance(s, (list, tuple)) else s  # (InternVLVisionConfig keeps [h, w])
            write_json(os.path.join(out, "preprocessor_config.json"), {
                "crop_to_patches": True, "min_patches": 1, "max_patches": 12, "do_normalize": True, "do_rescale": True,
                "do_resize": True, "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
                "image_processor_type": "GotOcr2ImageProcessor", "resample": 3, "rescale_factor": 1 / 255,
                "size": {"height": s, "width": s}})
            cfg.image_token_id = tok.token_to_id("<IMG_CONTEXT>")
        tok.save(os.path.join(out, "tokenizer.json"))
        write_json(os.path.join(out, "tokenizer_config.json"), tc)
        templ = "<|im_start|>user\n<image>\n{prompt}<|im_end|>\n<|im_start|>assistant\n" if family == "internvl3_8b" \
            else "{prompt}"
        if family == "internvl3_8b":
            with open(os.path.join(out, "chat_template.jinja"), "w") as f:
                f.write(INTERNVL_CHAT)
    if family != "llama3_8b":
        make_image(image_size, 7).save(os.path.join(out, "bench_image.png"))
    return templ


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return r, (time.perf_counter() - t0) * 1e3


@torch.no_grad()
def hf_bench(model, inputs, new_tokens, repeat, device):
    """Prefill, generate() and a plain cached loop on `inputs` (ids and image tensors)."""
    gen = dict(do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, **gen)  # warm-up
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    prefill, g1, gn, loop = [], [], [], []
    for _ in range(repeat):
        out, ms = timed(lambda: model(**inputs, use_cache=True), device)
        prefill.append(ms)
        g1.append(timed(lambda: model.generate(**inputs, max_new_tokens=1, min_new_tokens=1, **gen), device)[1])
        gn.append(timed(lambda: model.generate(**inputs, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1,
                                               **gen), device)[1])

        def cached_loop():
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(new_tokens):
                o = model(input_ids=tok, past_key_values=past, use_cache=True)
                past, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
            return tok

        loop.append(timed(cached_loop, device)[1])
    per_gen, per_loop = (med(gn) - med(g1)) / new_tokens, med(loop) / new_tokens
    return {"prefill_ms": med(prefill), "generate_ms_per_token": per_gen, "generate_tokens_per_s": 1e3 / per_gen,
            "loop_ms_per_token": per_loop, "loop_tokens_per_s": 1e3 / per_loop, "new_tokens": new_tokens,
            "repeat": repeat, "attn_implementation": model.config._attn_implementation}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=["llava_next_mistral", "internvl3_8b", "qwen2vl_7b", "qwen25vl_7b", "llama3_8b"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--json")
    ap.add_argument("--text-tokens", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--image-size", type=int, default=672)
    ap.add_argument("--no-hf-bench", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="toy sizes, for a dry run of this script")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    device = torch.device(a.device)
    torch.manual_seed(0)
    cfg = shapes(a.family, a.tiny)
    os.makedirs(a.out, exist_ok=True)
    templ = write_side_files(a.family, cfg, a.out, a.image_size)
    cls = {"llava_next_mistral": LlavaNextForConditionalGeneration, "internvl3_8b": InternVLForConditionalGeneration,
           "qwen2vl_7b": Qwen2VLForConditionalGeneration, "qwen25vl_7b": Qwen2_5_VLForConditionalGeneration,
           "llama3_8b": LlamaForCausalLM}[a.family]
    t0 = time.perf_counter()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.set_default_dtype(dtype)
    with device:
        model = cls(cfg)
    torch.set_default_dtype(torch.float32)
    model = model.eval()
    model.save_pretrained(a.out, max_shard_size="5GB")
    made_s = time.perf_counter() - t0
    # The prompt: the first words whose text makes --text-tokens tokens through the processor.
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(a.text_tokens)) + "."
    text = templ.replace("{prompt}", prompt)
    image = Image.open(os.path.join(a.out, "bench_image.png")).convert("RGB") if a.family != "llama3_8b" else None
    if a.family == "llama3_8b":
        from transformers import AutoTokenizer
        inputs = AutoTokenizer.from_pretrained(a.out)(text, return_tensors="pt")
    elif a.family == "llava_next_mistral":
        # kvlens's ids (tokenizer_image_token over the embedded SentencePiece model, <image> = 32000,
        # past that model's own vocabulary) with the processor's pixel values and token count.
        import sentencepiece as spm
        proc = AutoProcessor.from_pretrained(a.out)
        px = proc.image_processor(images=image, return_tensors="pt")
        n_visual = proc._get_num_multimodal_tokens(image_sizes=[[image.height, image.width]])["num_image_tokens"][0]
        sp = spm.SentencePieceProcessor(model_file=os.path.join(a.out, "tokenizer.model"))
        ids = llava_prompt_ids(sp, text, 32000, n_visual)
        inputs = {"input_ids": torch.tensor([ids]), "pixel_values": px["pixel_values"], "image_sizes": px["image_sizes"]}
    else:
        proc = AutoProcessor.from_pretrained(a.out)
        pad = "<|image_pad|>" if a.family in ("qwen2vl_7b", "qwen25vl_7b") else "<IMG_CONTEXT>"
        inputs = proc(images=image, text=text.replace("<image>", pad), return_tensors="pt")
    inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in inputs.items()
              if k != "attention_mask"}
    result = {"family": a.family, "checkpoint": a.out, "parameters": sum(p.numel() for p in model.parameters()),
              "make_seconds": made_s, "prompt": prompt, "template": templ, "prompt_tokens": int(inputs["input_ids"].shape[1]),
              "image": "bench_image.png" if image else None, "image_size": a.image_size if image else None,
              "device": str(device), "torch": torch.__version__}
    if not a.no_hf_bench:
        import transformers
        result["transformers"] = transformers.__version__
        result["hf"] = hf_bench(model, inputs, a.new_tokens, a.repeat, device)
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
