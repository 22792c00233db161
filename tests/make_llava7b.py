#!/usr/bin/env python3
"""Make a LLaVA-1.5-7B-shaped checkpoint with random fp16 weights, and time HF transformers on it.

The checkpoint has LLaVA-1.5-7B's shapes (vision: CLIP ViT-L/14 at 336 px, 24 layers, hidden
1024, 16 heads, 576 image tokens; language model: 32 layers, hidden 4096, 32 heads, MLP 11008,
vocabulary 32064) and random weights (transformers' own initialisation, fp16), written with
save_pretrained so kvlens loads it as any HF LLaVA checkpoint. The tokenizer is the embedded
model's SentencePiece model with <image> = 32000 (the ids past its vocabulary are never decoded
to text; only speed is measured on this checkpoint).

It also writes the prompt text that makes exactly --text-tokens text tokens with the default
template (so kvlens prefills 576 + 40 tokens) and times HF transformers on the same GPU:
prefill (vision + 616 tokens) and greedy decode, with model.generate() and with a plain cached
loop, as the baseline researchers use.

Usage (on the GPU host): python3 tests/make_llava7b.py --out /tmp/llava7b --json OUT/hf_bench.json
"""

import argparse
import json
import os
import shutil
import time

import sentencepiece as spm
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

HERE = os.path.dirname(os.path.abspath(__file__))
EMBEDDED = os.path.join(HERE, "..", "assets", "models", "kvlens-scenes-6m")
TEMPLATE = "USER: <image>\n{prompt} ASSISTANT:"
IMAGE_TOKEN = 32000
WORDS = ("Describe the image in detail, naming every object, its colour, its size and where it is "
         "placed relative to the others, then say what the scene as a whole shows and which "
         "object stands out most clearly").split()


def prompt_ids(sp, prompt, n_visual):
    """kvlens's tokenization: BOS, each chunk around <image> encoded on its own."""
    text = TEMPLATE.replace("{prompt}", prompt)
    before, after = text.split("<image>")
    return [sp.bos_id()] + sp.encode(before) + [IMAGE_TOKEN] * n_visual + sp.encode(after)


def choose_prompt(sp, want_text):
    """The prompt of the first n words (WORDS repeated) whose text tokens come closest to want_text."""
    words = lambda n: " ".join(WORDS[i % len(WORDS)] for i in range(n)) + "."  # noqa: E731
    lo, hi = 1, 1
    while len(prompt_ids(sp, words(hi), 0)) < want_text:
        hi *= 2
    while lo < hi:  # the first n reaching want_text (counts grow with n)
        mid = (lo + hi) // 2
        if len(prompt_ids(sp, words(mid), 0)) < want_text:
            lo = mid + 1
        else:
            hi = mid
    best = None
    for n in range(max(1, lo - 2), lo + 3):
        p = words(n)
        ids = prompt_ids(sp, p, 0)
        if best is None or abs(len(ids) - want_text) < abs(len(best[1]) - want_text):
            best = (p, ids)
    return best


def config(image_size=336):
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                              num_attention_heads=16, image_size=image_size, patch_size=14,
                              projection_dim=768, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    text = LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu",
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       tie_word_embeddings=False)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                       image_seq_length=(image_size // 14) ** 2, projector_hidden_act="gelu", vision_feature_layer=-2,
                       vision_feature_select_strategy="default", multimodal_projector_bias=True,
                       tie_word_embeddings=False)


def write_side_files(out, image_size=336):
    for f in ("tokenizer.model", "special_tokens_map.json"):
        shutil.copy(os.path.join(EMBEDDED, f), os.path.join(out, f))
    with open(os.path.join(EMBEDDED, "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc["added_tokens_decoder"] = {k: v for k, v in tc["added_tokens_decoder"].items() if v["content"] != "<image>"}
    tc["added_tokens_decoder"][str(IMAGE_TOKEN)] = {"content": "<image>", "lstrip": False, "normalized": False,
                                                    "rstrip": False, "single_word": False, "special": True}
    tc["model_max_length"] = 4096
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
    with open(os.path.join(out, "added_tokens.json"), "w") as f:
        json.dump({"<image>": IMAGE_TOKEN}, f)
    pre = {"crop_size": {"height": image_size, "width": image_size}, "do_center_crop": True, "do_convert_rgb": True,
           "do_normalize": True, "do_rescale": True, "do_resize": True,
           "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
           "image_processor_type": "CLIPImageProcessor", "resample": 3, "rescale_factor": 1 / 255,
           "size": {"shortest_edge": image_size}}
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f, indent=2)


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return r, (time.perf_counter() - t0) * 1e3


@torch.no_grad()
def hf_bench(model, ids, new_tokens, repeat):
    dev = torch.device("cuda")
    x = torch.tensor([ids], device=dev)
    size = model.config.vision_config.image_size
    pv = torch.randn(1, 3, size, size, device=dev, dtype=torch.float16)
    gen = dict(do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    model.generate(input_ids=x, pixel_values=pv, max_new_tokens=4, min_new_tokens=4, **gen)  # warm-up
    prefill, g1, gn, loop = [], [], [], []
    for _ in range(repeat):
        out, ms = timed(lambda: model(input_ids=x, pixel_values=pv, use_cache=True))
        prefill.append(ms)
        _, ms1 = timed(lambda: model.generate(input_ids=x, pixel_values=pv, max_new_tokens=1, min_new_tokens=1, **gen))
        _, msn = timed(lambda: model.generate(input_ids=x, pixel_values=pv, max_new_tokens=new_tokens + 1,
                                              min_new_tokens=new_tokens + 1, **gen))
        g1.append(ms1)
        gn.append(msn)

        def cached_loop():
            past = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
            for _ in range(new_tokens):
                o = model(input_ids=tok, past_key_values=past, use_cache=True)
                past, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
            return tok

        _, ml = timed(cached_loop)
        loop.append(ml)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    per_gen = (med(gn) - med(g1)) / new_tokens
    per_loop = med(loop) / new_tokens
    return {"prefill_ms": med(prefill), "generate_ms_per_token": per_gen, "generate_tokens_per_s": 1e3 / per_gen,
            "loop_ms_per_token": per_loop, "loop_tokens_per_s": 1e3 / per_loop, "new_tokens": new_tokens,
            "repeat": repeat, "attn_implementation": model.config._attn_implementation}


@torch.no_grad()
def hf_capture(model, ids):
    """HF transformers' attention capture: eager attention with output_attentions=True, every
    layer's [heads][T][T] probabilities on the GPU, then copied to the host as fp32."""
    dev = torch.device("cuda")
    x = torch.tensor([ids], device=dev)
    size = model.config.vision_config.image_size
    pv = torch.randn(1, 3, size, size, device=dev, dtype=torch.float16)
    model.set_attn_implementation("eager")
    model(input_ids=x, pixel_values=pv, output_attentions=True)  # warm-up
    out, gpu_ms = timed(lambda: model(input_ids=x, pixel_values=pv, output_attentions=True))
    t0 = time.perf_counter()
    host = [a.float().cpu() for a in out.attentions]
    host_ms = (time.perf_counter() - t0) * 1e3
    nbytes = sum(h.numel() * 4 for h in host)
    model.set_attn_implementation("sdpa")
    return {"prompt_tokens": len(ids), "capture_gpu_ms": gpu_ms, "copy_to_host_ms": host_ms,
            "capture_to_host_ms": gpu_ms + host_ms, "host_bytes": nbytes}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="checkpoint folder to write")
    ap.add_argument("--json", help="write the HF timings and the chosen prompt here")
    ap.add_argument("--text-tokens", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-hf-bench", action="store_true")
    ap.add_argument("--image-size", type=int, default=336, help="the tower's image size (672: 2,304 visual tokens)")
    ap.add_argument("--hf-capture", action="store_true",
                    help="also time HF's prefill with output_attentions=True (eager) and the copy of its maps to the host")
    a = ap.parse_args()
    torch.manual_seed(0)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(EMBEDDED, "tokenizer.model"))
    prompt, text_ids = choose_prompt(sp, a.text_tokens)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.float16)
    with torch.device("cuda"):
        model = LlavaForConditionalGeneration(config(a.image_size))
    torch.set_default_dtype(torch.float32)
    model = model.half().eval()
    n_params = sum(p.numel() for p in model.parameters())
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, max_shard_size="5GB")
    write_side_files(a.out, a.image_size)
    made_s = time.perf_counter() - t0
    n_visual = (a.image_size // 14) ** 2
    ids = prompt_ids(sp, prompt, n_visual)
    result = {"checkpoint": a.out, "parameters": n_params, "make_seconds": made_s, "prompt": prompt,
              "prompt_tokens": len(ids), "text_tokens": len(text_ids), "visual_tokens": n_visual,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not a.no_hf_bench:
        import transformers
        result["transformers"] = transformers.__version__
        result["hf"] = hf_bench(model, ids, a.new_tokens, a.repeat)
    if a.hf_capture:
        result["hf_capture"] = hf_capture(model, ids)
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
