#!/usr/bin/env python3
"""Build tiny LLaVA-1.5 reference checkpoints and record HF transformers outputs.

kvlens' C++ CPU runner must reproduce HF transformers exactly. This script
writes one folder per checkpoint under --out (default tests/fixtures/hf). Each
folder is a complete HF-format LLaVA-1.5 model directory (config, weights,
tokenizer, image processor) with random weights, plus the inputs and the
outputs HF produced for them:

  image.png          exact-size RGB input (resizing/cropping is a no-op)
  expected.json      prompt ids, greedy ids, margins, metadata
  logits.f32         first-step logits at the last prompt position [V]
  attn0.f32          text layer-0 attention probabilities [H, T, T]
  step_logits.f32    logits used to pick each greedy token [n_steps, V]
  pixel_values.f32   CLIP-preprocessed image [3, S, S]
  image_features.f32 projector output that replaces the image tokens [N, D]

All .f32 files are raw little-endian float32, row-major.

Folders and what each one exercises:

  mha_fp32_hub        MHA, fp32, single model.safetensors with the published
                      llava-hf hub tensor names; config.json pruned like the
                      published llava-1.5 config so that loader defaults apply.
  gqa_fp16_save       GQA with explicit head_dim, fp16, exactly what
                      transformers' save_pretrained writes (names + config),
                      tied embeddings, positive vision_feature_layer,
                      strategy "full", projector without bias, CLIP "gelu".
  bf16_sharded_inmem  bf16, sharded, tensor names in the transformers
                      4.52+ in-memory layout (model.language_model...,
                      model.vision_tower.vision_model..., lm_head.weight),
                      legacy top-level rope_theta, vision_feature_layer -1.

HF outputs are always computed in fp32 with eager attention, from the fp32
upcast of the stored weights (the folder is loaded back with
dtype=torch.float32), because the C++ runner computes in fp32.

Usage: python3 tests/make_hf_fixtures.py [--out tests/fixtures/hf]
"""

import argparse
import io
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from PIL import Image

import sentencepiece as spm
import transformers
from transformers import (
    AutoImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

PROMPT = "Describe the image."
TEMPLATE = "USER: <image>\n{prompt} ASSISTANT:"
N_GREEDY = 8
SP_VOCAB = 352  # image_token_index == SP_VOCAB; text vocab padded to a multiple of 8
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Training text for the tokenizer. Plain English about pictures plus the chat
# template words, so "USER", "ASSISTANT" and "Describe the image." get merges.
CORPUS = """
USER: Describe the image. ASSISTANT: The image shows a small red house next to a tall green tree.
USER: Describe the image. ASSISTANT: A dog is running across the grass in a large park.
USER: What is in the picture? ASSISTANT: There are two cats sitting on a wooden table near the window.
USER: Describe the image. ASSISTANT: The photo shows a busy street with cars, a bus and many people.
USER: How many birds are there? ASSISTANT: There are 3 birds on the wire and 12 more in the sky.
USER: Describe the image. ASSISTANT: A blue boat is floating on the calm water of the lake at sunset.
USER: What color is the car? ASSISTANT: The car in the image is bright yellow with black wheels.
USER: Describe the image. ASSISTANT: The image shows a plate with bread, cheese and a green apple.
The sky is blue and the sun is shining over the hills. A man is walking with his dog along the road.
The children are playing with a ball in the garden while their mother reads a book under the tree.
In the center of the picture there is a round table with a white cup and a red flower.
On the left side of the image a woman is holding an umbrella because it is raining.
The mountains in the background are covered with snow, and the river below is very wide.
A train is crossing the bridge over the river, and a few boats are waiting near the shore.
The room has a large window, a soft chair, a lamp and a shelf full of books.
There is a cat sleeping on the bed next to a pile of clean clothes.
The picture was taken in the morning, so the light is warm and the shadows are long.
Two people are sitting on a bench in the park, talking and eating sandwiches.
The image is a drawing of a castle with four towers, a gate and a bridge over the water.
A little girl is holding a kite, and the kite is flying high above the trees.
On the right there is a sign with the number 42 and an arrow pointing to the station.
The kitchen is clean and bright, with a bowl of fruit on the counter and a kettle on the stove.
The street is wet after the rain, and the lights of the shops are shining on the ground.
A group of students is standing in front of the school, waiting for the bus at 8 o'clock.
The field is full of yellow flowers, and a horse is eating grass near the fence.
The image shows a city at night with tall buildings, bright windows and a full moon.
Describe the image in detail. The image contains shapes, colors, lines and a smooth gradient.
USER: Can you describe the image? ASSISTANT: Sure. The image shows a red circle, a blue square and a green line.
USER: Describe the image. ASSISTANT: It is a simple picture with soft colors and a bright spot in the middle.
The top of the image is dark blue, the bottom is light orange, and there is a pink shape in the corner.
The number 7 is written on the door, and the number 2019 is painted on the wall.
There are 5 apples, 10 oranges and 100 grapes in the basket on the kitchen table.
"""

# Published llava-hf/llava-1.5-7b-hf preprocessor_config.json, with the sizes
# replaced by the tiny image size.
def preprocessor_config(image_size):
    return {
        "crop_size": {"height": image_size, "width": image_size},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_processor_type": "CLIPImageProcessor",
        "image_std": CLIP_STD,
        "processor_class": "LlavaProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": image_size},
    }


# ----------------------------------------------------------------------------
# Checkpoint specs
# ----------------------------------------------------------------------------

def spec(name, layout, dtype, shards, config_style, seed, vision, text, llava):
    """One fixture checkpoint: its tensor-name layout, dtype, shard count, config style and seed."""
    return {"name": name, "layout": layout, "dtype": dtype, "shards": shards, "config_style": config_style,
            "seed": seed, "init_std": 0.15, "vision": vision, "text": text, "llava": llava}


SPECS = [
    spec("mha_fp32_hub", "hub", "float32", 1, "hub_pruned", 1000,
         vision=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                     image_size=32, patch_size=8, projection_dim=16),
         text=dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=256, rms_norm_eps=1e-5),
         llava=dict(vision_feature_layer=-2, vision_feature_select_strategy="default",
                    projector_hidden_act="gelu", tie_word_embeddings=False)),
    spec("gqa_fp16_save", "save", "float16", 1, "save", 2000,
         vision=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=3,
                     image_size=48, patch_size=8, projection_dim=16, hidden_act="gelu"),
         text=dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
         llava=dict(vision_feature_layer=2, vision_feature_select_strategy="full",
                    multimodal_projector_bias=False, tie_word_embeddings=True)),
    spec("bf16_sharded_inmem", "inmem", "bfloat16", 3, "legacy_rope", 3000,
         vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     image_size=40, patch_size=8, projection_dim=16),
         text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, max_position_embeddings=256,
                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
         llava=dict(vision_feature_layer=-1, vision_feature_select_strategy="default",
                    projector_hidden_act="gelu", tie_word_embeddings=False)),
]

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------

def train_tokenizer():
    """Train a Llama-like SentencePiece BPE model; returns serialized bytes."""
    lines = [ln.strip() for ln in CORPUS.strip().splitlines() if ln.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        model_type="bpe",
        vocab_size=SP_VOCAB,
        character_coverage=1.0,
        byte_fallback=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
        num_threads=1,
        minloglevel=2,
    )
    proto = buf.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=proto)
    assert sp.get_piece_size() == SP_VOCAB, sp.get_piece_size()
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    return proto, sp


def special_token_entry(content):
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def write_tokenizer_files(folder, proto, image_token_index, patch_size, strategy):
    with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
        f.write(proto)
    special = {0: "<unk>", 1: "<s>", 2: "</s>", image_token_index: "<image>"}
    tok_cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(k): special_token_entry(v) for k, v in special.items()},
        "bos_token": "<s>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "legacy": False,
        "model_max_length": 4096,
        "pad_token": None,
        "padding_side": "left",
        "processor_class": "LlavaProcessor",
        "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }
    write_json(os.path.join(folder, "tokenizer_config.json"), tok_cfg)
    strip = {k: v for k, v in special_token_entry("").items() if k != "special"}
    stm = {name: dict(strip, content=tok) for name, tok in
           (("bos_token", "<s>"), ("eos_token", "</s>"), ("unk_token", "<unk>"))}
    write_json(os.path.join(folder, "special_tokens_map.json"), stm)
    write_json(os.path.join(folder, "added_tokens.json"), {"<image>": image_token_index})
    write_json(os.path.join(folder, "processor_config.json"), {
        "image_token": "<image>",
        "num_additional_image_tokens": 1,
        "patch_size": patch_size,
        "processor_class": "LlavaProcessor",
        "vision_feature_select_strategy": strategy,
    })


def llava_prompt_ids(sp, text, image_token_index, n_visual):
    """LLaVA's tokenizer_image_token: chunks split on <image>, each encoded on
    its own (so each gets SentencePiece's dummy prefix), BOS once at the start,
    the image token repeated n_visual times between chunks. HF's processors do
    the same for a tokenizer_config.json with "legacy": true (the embedded
    model's, make_family7b.py's) but for a chunk that starts with a space (its
    space is its prefix there); with "legacy": false the chunks after the first
    get no prefix, and the fixtures take the processor's own ids."""
    chunks = text.split("<image>")
    ids = [sp.bos_id()]
    for i, chunk in enumerate(chunks):
        if i > 0:
            ids += [image_token_index] * n_visual
        ids += sp.encode(chunk)
    return ids


# ----------------------------------------------------------------------------
# Image
# ----------------------------------------------------------------------------

def make_image(size, seed):
    """Smooth synthetic RGB picture: per-channel sinusoidal gradients plus a
    soft disc and a soft rectangle."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float64) / size
    img = np.zeros((size, size, 3))
    for c in range(3):
        fx, fy = rng.uniform(0.4, 1.6, 2)
        ph = rng.uniform(0, 2 * np.pi)
        img[..., c] = 0.5 + 0.35 * np.sin(2 * np.pi * (fx * x + fy * y) + ph) + 0.15 * (x - y)
    cx, cy, r = rng.uniform(0.3, 0.7), rng.uniform(0.3, 0.7), rng.uniform(0.15, 0.3)
    d = np.sqrt((x - cx) ** 2 + (y - cy) ** 2)
    a = 1.0 / (1.0 + np.exp((d - r) * size / 1.5))
    img = img * (1 - a[..., None]) + rng.uniform(0, 1, 3) * a[..., None]
    x0, y0 = rng.uniform(0.05, 0.4, 2)
    w, h = rng.uniform(0.2, 0.45, 2)
    k = size / 1.5
    bx = 1 / (1 + np.exp(-(x - x0) * k)) * 1 / (1 + np.exp((x - x0 - w) * k))
    by = 1 / (1 + np.exp(-(y - y0) * k)) * 1 / (1 + np.exp((y - y0 - h) * k))
    b = 0.8 * bx * by
    img = img * (1 - b[..., None]) + rng.uniform(0, 1, 3) * b[..., None]
    arr = np.clip(np.round(img * 255.0), 0, 255).astype(np.uint8)
    return Image.fromarray(arr, mode="RGB")


# ----------------------------------------------------------------------------
# Model construction
# ----------------------------------------------------------------------------

def build_config(spec, text_vocab, image_token_index):
    vc = CLIPVisionConfig(**spec["vision"])
    tc = LlamaConfig(vocab_size=text_vocab, initializer_range=spec["init_std"], **spec["text"])
    return LlavaConfig(vision_config=vc, text_config=tc, image_token_index=image_token_index,
                       image_seq_length=n_visual_tokens_for(spec), **spec["llava"])


def n_visual_tokens_for(spec):
    v = spec["vision"]
    n = (v["image_size"] // v["patch_size"]) ** 2
    return n + 1 if spec["llava"]["vision_feature_select_strategy"] == "full" else n


def random_init(model, seed, std):
    """Deterministic init of every parameter: matrices/embeddings N(0, std),
    norm weights 1 + N(0, 0.1), biases N(0, 0.1). Non-trivial norm weights and
    biases make a missing or misplaced term visible in the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            leaf = name.rsplit(".", 1)[-1]
            is_norm = "norm" in name or "layrnorm" in name
            if leaf == "bias":
                val = 0.1 * torch.randn(p.shape, generator=g)
            elif is_norm:
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            else:
                val = std * torch.randn(p.shape, generator=g)
            p.copy_(val.to(p.dtype))


# ----------------------------------------------------------------------------
# Tensor-name layouts
# ----------------------------------------------------------------------------

from hf_layouts import (canonical, check_config_roundtrip, hub_pruned_config,  # noqa: E402
                        legacy_rope_config, relayout_weights, stored_tensors, write_json)


def load_reference(folder, device):
    """Load the folder with from_pretrained as fp32/eager and prove that every
    stored tensor reached the model (upcast, bit-exact)."""
    model, info = LlavaForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if v}
    stored = stored_tensors(folder)
    params = dict(model.named_parameters())
    # map every stored tensor to the in-memory (5.x) parameter name
    mem = {}
    for k, v in stored.items():
        part, rest = canonical(k)
        name = {"lm": "model.language_model.", "head": "lm_head.", "vis": "model.vision_tower.",
                "proj": "model.multi_modal_projector."}[part] + rest
        mem[name] = v
    mismatched = []
    for name, p in params.items():
        src = mem.get(name)
        if src is None and name == "lm_head.weight" and model.config.tie_word_embeddings:
            src = mem.get("model.language_model.embed_tokens.weight")
        if src is None or not torch.equal(src.float(), p.detach().float()):
            mismatched.append(name)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    ok = not problems and not mismatched
    model.to(device).eval()
    return model, ok, {"loading_info": problems, "mismatched": mismatched}


@torch.no_grad()
def run_reference(model, input_ids, pixel_values, device, image_token_index):
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)
    pv = pixel_values.to(device)
    out = model(input_ids=ids, pixel_values=pv, output_attentions=True, use_cache=True)
    first_logits = out.logits[0, -1].float().cpu()
    attn0 = out.attentions[0][0].float().cpu()  # [H, T, T]
    feats = out.image_hidden_states  # (one tensor per image in transformers ≥ 5.2x)
    feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
    image_features = feats.float().cpu()
    past = out.past_key_values
    logits = out.logits[0, -1]
    greedy, margins, step_logits = [], [], []
    for step in range(N_GREEDY):
        top = torch.topk(logits.float(), 2)
        tok = int(torch.argmax(logits))
        assert tok == int(top.indices[0])
        margins.append(float(top.values[0] - top.values[1]))
        greedy.append(tok)
        step_logits.append(logits.float().cpu())
        if step + 1 < N_GREEDY:
            o = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits = o.logits[0, -1]
    step_logits = torch.stack(step_logits)
    # cross-check the cached loop against one full recompute over prompt + greedy[:-1]
    recompute = None
    if all(t != image_token_index for t in greedy):
        full = torch.tensor([input_ids + greedy[:-1]], device=device)
        o = model(input_ids=full, pixel_values=pv, use_cache=False)
        rl = o.logits[0, len(input_ids) - 1:].float().cpu()
        recompute = {
            "argmax_agree": bool((rl.argmax(-1) == torch.tensor(greedy)).all()),
            "max_abs_diff": float((rl - step_logits).abs().max()),
        }
    return {
        "first_logits": first_logits, "attn0": attn0, "image_features": image_features,
        "greedy": greedy, "margins": margins, "step_logits": step_logits, "recompute": recompute,
    }


@torch.no_grad()
def greedy_decode(model, out):
    """N_GREEDY greedy steps on from a forward pass `out` (its last logits and cache): the ids,
    each step's top-2 margin and the logits that chose each id."""
    logits, past = out.logits[0, -1], out.past_key_values
    greedy, margins, steps = [], [], []
    for step in range(N_GREEDY):
        top = torch.topk(logits.float(), 2)
        tok = int(top.indices[0])
        greedy.append(tok)
        margins.append(float(top.values[0] - top.values[1]))
        steps.append(logits.float())
        if step + 1 < N_GREEDY:
            o = model(input_ids=torch.tensor([[tok]], device=logits.device), past_key_values=past, use_cache=True)
            logits, past = o.logits[0, -1], o.past_key_values
    return greedy, margins, steps


def protobuf_available():
    try:
        import google.protobuf  # noqa: F401
        return True
    except ImportError:
        return False


def hf_processor_ids(folder, image, text):
    """HF's own LlavaProcessor (AutoProcessor) loaded from the folder: its ids are
    the prompt_ids kvlens must give (build_folder stops where it fails; the error
    is returned, not raised). transformers reads tokenizer.model only through
    protobuf."""
    try:
        from transformers import AutoProcessor
        proc = AutoProcessor.from_pretrained(folder)
        enc = proc(images=image, text=text, return_tensors="pt")
        return {"ids": enc["input_ids"][0].tolist(), "pixel_values": enc["pixel_values"][0],
                "processor_class": type(proc).__name__,
                "tokenizer_class": type(proc.tokenizer).__name__,
                "image_processor_class": type(proc.image_processor).__name__}
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def hf_llama_tokenizer_ids(folder, text, n_visual):
    """Informational: the LlamaTokenizer class named in tokenizer_config.json,
    on the text with <image> expanded n_visual times (as LlavaProcessor does)."""
    try:
        from transformers import LlamaTokenizer
        tok = LlamaTokenizer.from_pretrained(folder)
        return {"ids": tok(text.replace("<image>", "<image>" * n_visual))["input_ids"],
                "tokenizer_class": type(tok).__name__}
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def manual_pixel_values(image, cfg):
    """CLIP preprocessing of an exact-size image, spelled out: float32(u8 *
    rescale_factor in float64), then (x - mean) / std in float32, CHW."""
    x = np.asarray(image, dtype=np.uint8).astype(np.float64) * cfg["rescale_factor"]
    x = x.astype(np.float32)
    x = (x - np.asarray(cfg["image_mean"], dtype=np.float32)) / np.asarray(cfg["image_std"], dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------

def write_f32(path, t):
    np.ascontiguousarray(np.asarray(t, dtype="<f4")).tofile(path)


def folder_size(folder):
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def pick_device():
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        return torch.device("cuda")
    return torch.device("cpu")


# ----------------------------------------------------------------------------
# One folder
# ----------------------------------------------------------------------------

def build_folder(spec, out_root, proto, sp, device, args):
    text_vocab = (SP_VOCAB + 1 + 7) // 8 * 8
    image_token_index = SP_VOCAB
    n_visual = n_visual_tokens_for(spec)
    dtype = TORCH_DTYPES[spec["dtype"]]
    folder = os.path.join(out_root, spec["name"])
    image_size = spec["vision"]["image_size"]
    patch = spec["vision"]["patch_size"]
    strategy = spec["llava"]["vision_feature_select_strategy"]
    text = TEMPLATE.format(prompt=PROMPT)

    fallback = None
    for attempt in range(args.max_tries):
        seed = spec["seed"] + attempt
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        os.makedirs(folder)

        cfg = build_config(spec, text_vocab, image_token_index)
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(cfg)
        random_init(model, seed, spec["init_std"])
        model = model.to(dtype)

        with tempfile.TemporaryDirectory() as tmp:
            if spec["shards"] > 1:
                total = sum(p.numel() * p.element_size() for p in model.parameters())
                model.save_pretrained(tmp, max_shard_size=total // spec["shards"] + 1)
            else:
                model.save_pretrained(tmp)
            saved_names = sorted(stored_tensors(tmp).keys())
            relayout_weights(tmp, folder, spec["layout"], spec["shards"])
            saved_cfg = json.load(open(os.path.join(tmp, "config.json")))
            if spec["config_style"] == "save":
                shutil.copy2(os.path.join(tmp, "config.json"), folder)
            elif spec["config_style"] == "hub_pruned":
                write_json(os.path.join(folder, "config.json"), hub_pruned_config(model.config))
            elif spec["config_style"] == "legacy_rope":
                write_json(os.path.join(folder, "config.json"), legacy_rope_config(saved_cfg))
            if os.path.exists(os.path.join(tmp, "generation_config.json")):
                shutil.copy2(os.path.join(tmp, "generation_config.json"), folder)
        del model

        write_tokenizer_files(folder, proto, image_token_index, patch, strategy)
        write_json(os.path.join(folder, "preprocessor_config.json"), preprocessor_config(image_size))
        image = make_image(image_size, seed)
        image.save(os.path.join(folder, "image.png"))
        image = Image.open(os.path.join(folder, "image.png")).convert("RGB")
        assert image.size == (image_size, image_size)

        # The prompt as HF's LlavaProcessor gives it from the folder's files: kvlens's reference.
        hfp = hf_processor_ids(folder, image, text)
        if "ids" not in hfp:
            raise SystemExit(f"{spec['name']}: HF's processor failed: {hfp['error']}")
        prompt_ids = hfp["ids"]

        improc = AutoImageProcessor.from_pretrained(folder, backend="pil")
        pixel_values = improc(images=image, return_tensors="pt")["pixel_values"].float()
        assert tuple(pixel_values.shape) == (1, 3, image_size, image_size)

        ref, loads_ok, load_report = load_reference(folder, device)
        if not loads_ok:
            raise SystemExit(f"{spec['name']}: from_pretrained did not load every tensor: {load_report}")
        check_config_roundtrip(cfg, ref.config)
        res = run_reference(ref, prompt_ids, pixel_values, device, image_token_index)
        del ref
        assert res["image_features"].shape[0] == n_visual, res["image_features"].shape

        margin_ok = min(res["margins"]) > args.min_margin
        ids_ok = all(3 <= t < image_token_index for t in res["greedy"])
        varied = len(set(res["greedy"])) >= 3
        status = f"seed {seed}: min margin {min(res['margins']):.4g}, greedy {res['greedy']}"
        if margin_ok and ids_ok and varied:
            print(f"  [{spec['name']}] accept {status}")
            break
        print(f"  [{spec['name']}] reject {status}")
        if margin_ok and ids_ok and fallback is None:
            fallback = seed
        if attempt + 1 == args.max_tries:
            if fallback is None:
                raise SystemExit(f"{spec['name']}: no seed with margins > {args.min_margin}")
            # rebuild with the best acceptable (but repetitive) seed
            spec = dict(spec, seed=fallback)
            args2 = argparse.Namespace(**vars(args))
            args2.max_tries = 1
            return build_folder(spec, out_root, proto, sp, device, args2)

    # HF's processor gave prompt_ids above (hfp); the LlamaTokenizer class alone, informational.
    hf_ids = hfp["ids"]
    hft = hf_llama_tokenizer_ids(folder, text, n_visual)
    manual_pv_diff = float((manual_pixel_values(image, preprocessor_config(image_size)) - pixel_values[0]).abs().max())
    hf_pv_diff = None
    if "pixel_values" in hfp:
        hf_pv_diff = float((hfp["pixel_values"].float() - pixel_values[0]).abs().max())
    try:
        fast = AutoImageProcessor.from_pretrained(folder, backend="torchvision")
        fast_pv = fast(images=image, return_tensors="pt")["pixel_values"].float()
        torchvision_diff = float((fast_pv - pixel_values).abs().max())
    except Exception as e:  # noqa: BLE001
        torchvision_diff = f"{type(e).__name__}: {e}"[:300]

    write_f32(os.path.join(folder, "logits.f32"), res["first_logits"].numpy())
    write_f32(os.path.join(folder, "attn0.f32"), res["attn0"].numpy())
    write_f32(os.path.join(folder, "step_logits.f32"), res["step_logits"].numpy())
    write_f32(os.path.join(folder, "pixel_values.f32"), pixel_values[0].numpy())
    write_f32(os.path.join(folder, "image_features.f32"), res["image_features"].numpy())

    H, T, _ = res["attn0"].shape
    expected = {
        "prompt": PROMPT,
        "template": TEMPLATE,
        "prompt_ids": prompt_ids,
        "greedy_ids": res["greedy"],
        "n_visual_tokens": n_visual,
        "image_token_index": image_token_index,
        "margins": res["margins"],
        "logits_file": "logits.f32",
        "attn0_file": "attn0.f32",
        "attn0_shape": [H, T, T],
        "hf_processor_ids_agree": hf_ids == prompt_ids,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "layout": spec["layout"],
        "dtype": spec["dtype"],
        # extras
        "image_file": "image.png",
        "image_size": image_size,
        "vocab_size": text_vocab,
        "logits_shape": [text_vocab],
        "step_logits_file": "step_logits.f32",
        "step_logits_shape": [N_GREEDY, text_vocab],
        "pixel_values_file": "pixel_values.f32",
        "pixel_values_shape": [3, image_size, image_size],
        "image_features_file": "image_features.f32",
        "image_features_shape": list(res["image_features"].shape),
        "vision_feature_layer": spec["llava"]["vision_feature_layer"],
        "vision_feature_select_strategy": strategy,
        "compute": {"device": device.type, "dtype": "float32", "attn_implementation": "eager",
                    "weights": f"fp32 upcast of stored {spec['dtype']}"},
        "seed": seed,
        "min_margin_required": args.min_margin,
        "hf_from_pretrained_loads": True,
        "save_pretrained_tensor_names_sample": [n for n in saved_names if ".layers.1." not in n
                                                 and ".layers.2." not in n],
        "recompute_check": res["recompute"],
        "hf_processor": {k: v for k, v in hfp.items() if k not in ("ids", "pixel_values")},
        "hf_processor_ids": hf_ids,
        "hf_processor_pixel_values_max_abs_diff": hf_pv_diff,
        "hf_llama_tokenizer": {k: v for k, v in hft.items() if k != "ids"},
        "hf_llama_tokenizer_ids": hft.get("ids"),
        "hf_llama_tokenizer_ids_agree": hft.get("ids") == prompt_ids,
        "protobuf_available": protobuf_available(),
        "pixel_values_processor": type(improc).__name__,
        "pixel_values_manual_max_abs_diff": manual_pv_diff,
        "torchvision_backend_pixel_values_max_abs_diff": torchvision_diff,
    }
    write_json(os.path.join(folder, "expected.json"), expected)
    for f in os.listdir(folder):
        os.chmod(os.path.join(folder, f), 0o644)
    size = folder_size(folder)
    assert size < 2 * 1024 * 1024, (folder, size)
    return {"folder": spec["name"], "layout": spec["layout"], "dtype": spec["dtype"], "size": size,
            "min_margin": min(res["margins"]), "seed": seed, "T": T,
            "hf_ids_agree": hf_ids == prompt_ids, "files": sorted(os.listdir(folder))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf"))
    ap.add_argument("--only", nargs="*", help="build only these folder names")
    ap.add_argument("--min-margin", type=float, default=1e-2,
                    help="required top1-top2 logit gap at every greedy step (default 1e-2)")
    ap.add_argument("--max-tries", type=int, default=200)
    args = ap.parse_args()

    device = pick_device()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {device}")
    os.makedirs(args.out, exist_ok=True)
    proto, sp = train_tokenizer()

    rows = []
    for spec in SPECS:
        if args.only and spec["name"] not in args.only:
            continue
        rows.append(build_folder(spec, args.out, proto, sp, device, args))

    print()
    print(f"{'folder':<22}{'layout':<8}{'dtype':<10}{'size':>10}  {'min margin':>11}  {'seed':>5}  {'T':>4}  hf_ids")
    for r in rows:
        print(f"{r['folder']:<22}{r['layout']:<8}{r['dtype']:<10}{r['size']:>10}  {r['min_margin']:>11.4g}  "
              f"{r['seed']:>5}  {r['T']:>4}  {r['hf_ids_agree']}")


if __name__ == "__main__":
    sys.exit(main())
