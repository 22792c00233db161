#!/usr/bin/env python3
"""Build tiny LLaVA-NeXT reference checkpoints (HF LlavaNextForConditionalGeneration) and record
HF transformers outputs, as tests/make_hf_fixtures.py does for LLaVA-1.5.

Each folder under --out (default tests/fixtures/hf) is a complete HF model directory (config,
safetensors, SentencePiece tokenizer, LlavaNextImageProcessor config) with random weights, an
image whose size is not a multiple of the tile, and:

  expected.json        prompt, template, prompt ids, greedy ids, margins, the processor's token
                       count, the image's tiles and grid, metadata
  pixel_values.f32     the PIL-backend LlavaNextImageProcessor's output [1 + tiles, 3, S, S]
  image_features.f32   the packed image features (base, unpadded tiles, newlines) [N, hidden]
  logits.f32           first-step logits at the last prompt position [V]
  attn0.f32            layer-0 attention probabilities [H, T, T]
  step_logits.f32      logits used to pick each greedy token [n_steps, V]
  processor_cases.json images of other sizes (../processor_images/processor_*.png, one copy
                       for every fixture), the processor's pixel values for each
                       (processor_*.f32) and its token count

Folders:

  next_llama_fp32_save     Llama backbone, MHA, fp32, transformers 5 save_pretrained names; an
                           80x20 image: 1x3 tiles, unpadding cuts rows.
  next_mistral_bf16_hub    Mistral backbone, GQA 6:2, bf16, the llava-hf hub tensor names, sharded
                           safetensors; a 19x50 image: 3x1 tiles, unpadding cuts rows.

HF outputs are computed in fp32 with eager attention from the fp32 upcast of the stored weights.
Usage: python3 tests/make_hf_next_fixtures.py [--out tests/fixtures/hf]
"""

import argparse
import os
import shutil
import sys
import tempfile

import torch
import transformers
from PIL import Image
from transformers import (AutoImageProcessor, AutoProcessor, CLIPVisionConfig, LlamaConfig, LlavaNextConfig,
                          LlavaNextForConditionalGeneration, MistralConfig)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import (CLIP_MEAN, CLIP_STD, N_GREEDY, SP_VOCAB, greedy_decode, make_image,  # noqa: E402
                              random_init, train_tokenizer, write_tokenizer_files)
from hf_layouts import relayout_weights, write_json  # noqa: E402
from make_chat_template_fixtures import LLAVA_NEXT_MISTRAL  # noqa: E402

PROMPT = "Describe the image."
TEXT_VOCAB = (SP_VOCAB + 1 + 7) // 8 * 8
IMAGE_TOKEN = SP_VOCAB

SPECS = [
    dict(name="next_llama_fp32_save", layout="save", dtype=torch.float32, shards=None, seed=21,
         template="USER: <image>\n{prompt} ASSISTANT:", image_wh=(80, 20),
         vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     image_size=32, patch_size=4, projection_dim=16),
         text_cls=LlamaConfig,
         text=dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=1024, rms_norm_eps=1e-5),
         next=dict(image_grid_pinpoints=[[32, 64], [64, 32], [64, 64], [32, 96], [96, 32]],
                   vision_feature_layer=-2, vision_feature_select_strategy="default")),
    dict(name="next_mistral_bf16_hub", layout="hub", dtype=torch.bfloat16, shards="150KB", seed=31,
         chat_template=LLAVA_NEXT_MISTRAL,
         template="[INST] <image>\n{prompt} [/INST]", image_wh=(19, 50),
         vision=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=3,
                     image_size=24, patch_size=4, projection_dim=16, hidden_act="gelu"),
         text_cls=MistralConfig,
         text=dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
                   sliding_window=4096),
         next=dict(image_grid_pinpoints=[[24, 48], [48, 24], [48, 48], [72, 24]],
                   vision_feature_layer=[-3, -1], vision_feature_select_strategy="default",
                   multimodal_projector_bias=False)),
]

MIN_MARGIN = 0.05


def write_f32(path, t):
    t.detach().float().contiguous().cpu().numpy().astype("<f4").tofile(path)


def preprocessor_config(spec):
    """The published llava-hf/llava-v1.6-mistral-7b-hf preprocessor_config.json, with the tiny
    tower's sizes and pinpoints."""
    s = spec["vision"]["image_size"]
    return {
        "aspect_ratio_setting": "anyres",
        "crop_size": {"height": s, "width": s},
        "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True, "do_pad": True,
        "do_rescale": True, "do_resize": True,
        "image_grid_pinpoints": spec["next"]["image_grid_pinpoints"],
        "image_mean": CLIP_MEAN, "image_processor_type": "LlavaNextImageProcessor", "image_std": CLIP_STD,
        "processor_class": "LlavaNextProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": s},
    }


def make_wide_image(w, h, seed):
    """make_image's smooth synthetic picture, resized (nearest) to w x h so the tiles have texture."""
    side = max(w, h)
    return make_image(side, seed).resize((w, h), Image.NEAREST)


# Images of other sizes through the same processor: tiny, thin both ways, near-square and large
# (relative to the tile), each with the processor's pixel values and token count.
PROCESSOR_SIZES = [(1, 1), (5, 300), (300, 5), (33, 31), (600, 577), (41, 1500)]


# The images are the same for every fixture: one copy beside the fixture folders, which each
# fixture's processor_cases.json names relative to its own folder.
PROCESSOR_IMAGES = "processor_images"


def write_processor_cases(folder, process):
    """Images of PROCESSOR_SIZES through `process(image, w, h)`, which gives the processor's pixel
    values and the case's other facts (its token count); processor_cases.json lists them."""
    shared = os.path.join(os.path.dirname(os.path.abspath(folder)), PROCESSOR_IMAGES)
    os.makedirs(shared, exist_ok=True)
    cases = []
    for i, (w, h) in enumerate(PROCESSOR_SIZES):
        name = "processor_%dx%d" % (w, h)
        path = os.path.join(shared, name + ".png")
        make_wide_image(w, h, 100 + i).save(path)
        image = Image.open(path).convert("RGB")
        pv, facts = process(image, w, h)
        write_f32(os.path.join(folder, name + ".f32"), pv)
        cases.append(dict({"image": "../%s/%s.png" % (PROCESSOR_IMAGES, name), "pixel_values_file": name + ".f32",
                           "pixel_values_shape": list(pv.shape)}, **facts))
    write_json(os.path.join(folder, "processor_cases.json"), cases)


def clear_greedy(name, seed, greedy, margins, usable):
    """Whether a seed's greedy ids are clear to compare with: top-2 margins of MIN_MARGIN, three
    different ids, each `usable`; else the seed is rejected, said so."""
    if min(margins) < MIN_MARGIN or len(set(greedy)) < 3 or not all(usable(t) for t in greedy):
        print("  [%s] reject seed %d: margins %.3g, greedy %s" % (name, seed, min(margins), greedy))
        return False
    return True


def write_references(folder, pixel_values, feats, out, steps):
    """The reference tensors every image fixture records."""
    write_f32(os.path.join(folder, "pixel_values.f32"), pixel_values)
    write_f32(os.path.join(folder, "image_features.f32"), feats)
    write_f32(os.path.join(folder, "logits.f32"), out.logits[0, -1])
    write_f32(os.path.join(folder, "attn0.f32"), out.attentions[0][0])
    write_f32(os.path.join(folder, "step_logits.f32"), torch.stack(steps))


def image_expected(spec, seed, arch, template, ids, greedy, margins, n_visual, image_token, image_wh, family, improc,
                   pixel_values, hf_pv_diff, feats, out, vocab, rendered):
    """expected.json of an image fixture built from a chat template: the prompt, greedy ids and
    image; `family`'s own entries; the reference tensors' files and shapes and the versions."""
    H, T = out.attentions[0].shape[1], len(ids)
    rec = {"architecture": arch, "prompt": PROMPT, "template": template, "prompt_ids": ids, "greedy_ids": greedy,
           "margins": margins, "n_visual_tokens": n_visual, "image_token_index": image_token, "image_file": "image.png",
           "image_width": image_wh[0], "image_height": image_wh[1]}
    rec.update(family)
    rec.update({
        "pixel_values_file": "pixel_values.f32", "pixel_values_shape": list(pixel_values.shape),
        "pixel_values_processor": type(improc).__name__, "hf_processor_pixel_values_max_abs_diff": hf_pv_diff,
        "image_features_file": "image_features.f32", "image_features_shape": list(feats.shape),
        "logits_file": "logits.f32", "logits_shape": [vocab], "attn0_file": "attn0.f32", "attn0_shape": [H, T, T],
        "step_logits_file": "step_logits.f32", "step_logits_shape": [N_GREEDY, vocab], "vocab_size": vocab,
        "chat_prompt_text": rendered, "dtype": str(spec["dtype"]).replace("torch.", ""), "seed": seed,
        "compute": {"device": "cpu", "dtype": "float32", "attn_implementation": "eager"},
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
    })
    return rec


def build_first_clear(spec, build_seed, *args):
    """build_seed(spec, *args, seed) from the spec's seed on, until a seed gives clear greedy ids."""
    for seed in range(spec["seed"], spec["seed"] + 200):
        if build_seed(spec, *args, seed):
            return
    raise SystemExit(spec["name"] + ": no seed gave clear greedy margins")


def save_weights(model, spec, folder):
    """The model in spec's dtype as save_pretrained writes it, or with spec's "layout" the same
    weights under that layout's tensor names (and spec's shards), with save_pretrained's config
    files beside them."""
    if not spec.get("layout"):
        model.to(spec["dtype"]).save_pretrained(folder, safe_serialization=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model.to(spec["dtype"]).save_pretrained(tmp, safe_serialization=True, max_shard_size=spec["shards"])
        relayout_weights(tmp, folder, spec["layout"], 2)
        for f in ("config.json", "generation_config.json"):
            if os.path.exists(os.path.join(tmp, f)):
                shutil.copy2(os.path.join(tmp, f), folder)


def fresh_folder(out_root, name):
    """out_root/name, emptied (a rejected seed's files gone)."""
    folder = os.path.join(out_root, name)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    return folder


@torch.no_grad()
def build_seed(spec, out_root, proto, sp, seed):
    folder = fresh_folder(out_root, spec["name"])
    tc = spec["text_cls"](vocab_size=TEXT_VOCAB, bos_token_id=1, eos_token_id=2, **spec["text"])
    cfg = LlavaNextConfig(vision_config=CLIPVisionConfig(**spec["vision"]), text_config=tc,
                          image_token_index=IMAGE_TOKEN, **spec["next"])
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(cfg)
    random_init(model, seed, 0.15)
    model = model.to(spec["dtype"])
    kw = {"max_shard_size": spec["shards"]} if spec["shards"] else {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True, **kw)
        relayout_weights(tmp, folder, spec["layout"], 2 if spec["shards"] else 1)
        shutil.copy2(os.path.join(tmp, "config.json"), folder)
    del model
    v = spec["vision"]
    write_tokenizer_files(folder, proto, IMAGE_TOKEN, v["patch_size"], "default")
    write_json(os.path.join(folder, "processor_config.json"), {
        "image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": v["patch_size"],
        "processor_class": "LlavaNextProcessor", "vision_feature_select_strategy": "default"})
    write_json(os.path.join(folder, "preprocessor_config.json"), preprocessor_config(spec))
    if spec.get("chat_template"):  # the processor's, as llava-hf ships it
        write_json(os.path.join(folder, "chat_template.json"), {"chat_template": spec["chat_template"]})
    w, h = spec["image_wh"]
    make_wide_image(w, h, seed).save(os.path.join(folder, "image.png"))
    image = Image.open(os.path.join(folder, "image.png")).convert("RGB")

    improc = AutoImageProcessor.from_pretrained(folder, backend="pil")
    enc = improc(images=image, return_tensors="pt")
    pixel_values, image_sizes = enc["pixel_values"].float(), enc["image_sizes"]
    assert image_sizes.tolist() == [[h, w]], image_sizes
    # The processor's token count for the image (LlavaNextProcessor._get_number_of_features).
    proc = AutoProcessor.from_pretrained(folder)
    n_visual = proc._get_num_multimodal_tokens(image_sizes=[[h, w]])["num_image_tokens"][0]
    text = spec["template"].replace("{prompt}", PROMPT)
    # The prompt as HF's LlavaNextProcessor gives it: the ids kvlens must give.
    hf = proc(images=image, text=text, return_tensors="pt")
    ids = hf_ids = hf["input_ids"][0].tolist()
    hf_pv_diff = float((hf["pixel_values"].float() - pixel_values).abs().max())
    try:
        fast = AutoImageProcessor.from_pretrained(folder, backend="torchvision")
        if type(fast) is type(improc):  # (transformers falls back to PIL without torchvision)
            raise RuntimeError("torchvision is not installed")
        tv_diff = float((fast(images=image, return_tensors="pt")["pixel_values"].float() - pixel_values).abs().max())
    except Exception as e:  # noqa: BLE001
        tv_diff = f"{type(e).__name__}: {e}"[:300]

    chat = {}
    if spec.get("chat_template"):  # the template as one user turn, and HF's ids for it (informational)
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
        rendered = proc.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        chat = {"chat_prompt_text": rendered,
                "chat_template_is_template": rendered == spec["template"].replace("{prompt}", PROMPT)}
    ref = LlavaNextForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    x = torch.tensor([ids])
    out = ref(input_ids=x, pixel_values=pixel_values, image_sizes=image_sizes, output_attentions=True, use_cache=True)
    feats = out.image_hidden_states
    feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats.reshape(-1, feats.shape[-1])
    assert feats.shape[0] == n_visual, (feats.shape, n_visual)
    greedy, margins, steps = greedy_decode(ref, out)
    if not clear_greedy(spec["name"], seed, greedy, margins, lambda t: 3 <= t < IMAGE_TOKEN):
        return False
    write_references(folder, pixel_values[0], feats, out, steps)
    H, T = out.attentions[0].shape[1], len(ids)
    write_json(os.path.join(folder, "expected.json"), {
        "architecture": "LlavaNextForConditionalGeneration", "prompt": PROMPT, "template": spec["template"],
        "prompt_ids": ids, "greedy_ids": greedy, "margins": margins, "n_visual_tokens": n_visual,
        "image_token_index": IMAGE_TOKEN, "image_file": "image.png", "image_width": w, "image_height": h,
        "tiles": [int(pixel_values.shape[1]) - 1],
        "pixel_values_file": "pixel_values.f32", "pixel_values_shape": list(pixel_values.shape[1:]),
        "pixel_values_processor": type(improc).__name__,
        "image_features_file": "image_features.f32", "image_features_shape": list(feats.shape),
        "logits_file": "logits.f32", "logits_shape": [TEXT_VOCAB], "attn0_file": "attn0.f32",
        "attn0_shape": [H, T, T], "step_logits_file": "step_logits.f32", "step_logits_shape": [N_GREEDY, TEXT_VOCAB],
        "vocab_size": TEXT_VOCAB, "hf_processor_ids_agree": hf_ids == ids if hf_ids else None,
        "hf_processor_ids": hf_ids, "hf_processor_pixel_values_max_abs_diff": hf_pv_diff,
        "torchvision_backend_pixel_values_max_abs_diff": tv_diff,
        "layout": spec["layout"], "dtype": str(spec["dtype"]).replace("torch.", ""), "seed": seed,
        "compute": {"device": "cpu", "dtype": "float32", "attn_implementation": "eager"},
        "transformers_version": transformers.__version__, "torch_version": torch.__version__, **chat,
    })
    write_processor_cases(folder, lambda image, w, h: (
        improc(images=image, return_tensors="pt")["pixel_values"][0].float(),
        {"n_visual_tokens": proc._get_num_multimodal_tokens(image_sizes=[[h, w]])["num_image_tokens"][0]}))
    print("%-24s seed %d, %dx%d image, %d tiles, %d visual tokens, %d prompt ids, greedy %s, min margin %.3g, "
          "HF processor ids agree: %s, torchvision pixel diff %s"
          % (spec["name"], seed, w, h, pixel_values.shape[1] - 1, n_visual, len(ids), greedy, min(margins),
             hf_ids == ids if hf_ids else "-", tv_diff))
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf"))
    args = ap.parse_args()
    proto, sp = train_tokenizer()
    for spec in SPECS:
        build_first_clear(spec, build_seed, args.out, proto, sp)


if __name__ == "__main__":
    main()
