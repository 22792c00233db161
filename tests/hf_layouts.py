"""Tensor-name layouts and config variants of the LLaVA checkpoints that
tests/make_hf_fixtures.py writes: the llava-hf hub layout, the transformers 5 save_pretrained
layout and the transformers >= 4.52 in-memory layout, plus the pruned hub-style config."""
import json
import os
import shutil

import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def canonical(name):
    """Map any known LLaVA / LLaVA-NeXT tensor name to (part, rest)."""
    n = name[len("model."):] if name.startswith("model.") else name
    if n in ("lm_head.weight", "language_model.lm_head.weight"):
        return ("head", "weight")
    if n == "image_newline":  # LLaVA-NeXT's row-end token
        return ("newline", "")
    if n.startswith("language_model.model."):
        return ("lm", n[len("language_model.model."):])
    if n.startswith("language_model."):
        return ("lm", n[len("language_model."):])
    if n.startswith("vision_tower.vision_model."):
        return ("vis", n[len("vision_tower.vision_model."):])
    if n.startswith("vision_tower."):
        return ("vis", n[len("vision_tower."):])
    if n.startswith("visual."):  # Qwen2-VL's vision tower and merger
        return ("vis", n[len("visual."):])
    if name.startswith("model.") and n.split(".")[0] in ("embed_tokens", "layers", "norm"):  # Qwen2-VL's decoder
        return ("lm", n)
    if n.startswith("multi_modal_projector."):
        return ("proj", n[len("multi_modal_projector."):])
    raise ValueError("unknown tensor name " + name)


LAYOUT_PREFIX = {
    # published llava-hf checkpoints (transformers < 4.52 module names)
    "hub": {"lm": "language_model.model.", "head": "language_model.lm_head.",
            "vis": "vision_tower.vision_model.", "proj": "multi_modal_projector.", "newline": "image_newline"},
    # InternVL's "-hf" hub checkpoints: everything under model., no vision_model segment
    "model_prefix": {"lm": "model.language_model.", "head": "lm_head.", "vis": "model.vision_tower.",
                     "proj": "model.multi_modal_projector.", "newline": "model.image_newline"},
    # Qwen2-VL's module names in memory (its hub names are what save_pretrained writes)
    "qwen_inmem": {"lm": "model.language_model.", "head": "lm_head.", "vis": "model.visual."},
    # transformers 4.52+ in-memory module names (LlavaModel under .model)
    "inmem": {"lm": "model.language_model.", "head": "lm_head.",
              "vis": "model.vision_tower.vision_model.", "proj": "model.multi_modal_projector.",
              "newline": "model.image_newline"},
}


def rename(name, layout):
    part, rest = canonical(name)
    return LAYOUT_PREFIX[layout][part] + rest


def relayout_weights(src_dir, dst_dir, layout, n_shards):
    """Copy the save_pretrained tensors from src_dir into dst_dir, renamed to
    `layout` ("save" keeps the files byte-identical)."""
    files = sorted(f for f in os.listdir(src_dir) if f.endswith(".safetensors"))
    index_path = os.path.join(src_dir, "model.safetensors.index.json")
    if layout == "save":
        for f in files:
            shutil.copy2(os.path.join(src_dir, f), os.path.join(dst_dir, f))
        if os.path.exists(index_path):
            shutil.copy2(index_path, dst_dir)
        return
    weight_map = {}
    for f in files:
        with safe_open(os.path.join(src_dir, f), "pt") as h:
            meta = h.metadata() or {}
        tensors = load_file(os.path.join(src_dir, f))
        out = {rename(k, layout): v.contiguous() for k, v in tensors.items()}
        assert len(out) == len(tensors)
        save_file(out, os.path.join(dst_dir, f), metadata=meta)
        for k in out:
            weight_map[k] = f
    if os.path.exists(index_path):
        index = json.load(open(index_path))
        index["weight_map"] = dict(sorted(weight_map.items()))
        write_json(os.path.join(dst_dir, "model.safetensors.index.json"), index)
    assert (len(files) > 1) == (n_shards > 1), (files, n_shards)


def stored_tensors(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


# ----------------------------------------------------------------------------
# config.json variants
# ----------------------------------------------------------------------------

def hub_pruned_config(cfg):
    """Like the published llava-hf/llava-1.5-7b-hf config.json: keys equal to
    the HF defaults are omitted (no num_key_value_heads, rope_theta,
    hidden_act, head_dim, layer_norm_eps, ...), old `torch_dtype` key, and a
    few extra keys the loader has to tolerate (ignore_index, vocab_size)."""
    tc, vc = cfg.text_config, cfg.vision_config
    assert tc.num_key_value_heads == tc.num_attention_heads
    assert tc.head_dim == tc.hidden_size // tc.num_attention_heads
    assert tc.hidden_act == "silu" and vc.hidden_act == "quick_gelu"
    assert tc.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert cfg.vision_feature_layer == -2 and cfg.vision_feature_select_strategy == "default"
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "ignore_index": -100,
        "image_token_index": cfg.image_token_index,
        "model_type": "llava",
        "projector_hidden_act": cfg.projector_hidden_act,
        "text_config": {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": tc.hidden_size,
            "intermediate_size": tc.intermediate_size,
            "max_position_embeddings": tc.max_position_embeddings,
            "model_type": "llama",
            "num_attention_heads": tc.num_attention_heads,
            "num_hidden_layers": tc.num_hidden_layers,
            "rms_norm_eps": tc.rms_norm_eps,
            "torch_dtype": "float32",
            "vocab_size": tc.vocab_size,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": transformers.__version__,
        "vision_config": {
            "hidden_size": vc.hidden_size,
            "image_size": vc.image_size,
            "intermediate_size": vc.intermediate_size,
            "model_type": "clip_vision_model",
            "num_attention_heads": vc.num_attention_heads,
            "num_hidden_layers": vc.num_hidden_layers,
            "patch_size": vc.patch_size,
            "projection_dim": vc.projection_dim,
            "vocab_size": cfg.image_token_index,
        },
        "vision_feature_layer": cfg.vision_feature_layer,
        "vision_feature_select_strategy": cfg.vision_feature_select_strategy,
        "vocab_size": tc.vocab_size,
    }


def legacy_rope_config(saved):
    """save_pretrained's config, but with the pre-5.x RoPE keys (top-level
    rope_theta in text_config, rope_scaling null) and `torch_dtype`."""
    cfg = json.loads(json.dumps(saved))
    tc = cfg["text_config"]
    rp = tc.pop("rope_parameters")
    assert rp.get("rope_type", "default") == "default", rp
    tc["rope_theta"] = rp["rope_theta"]
    tc["rope_scaling"] = None
    for d in (cfg, tc):
        if "dtype" in d:
            d["torch_dtype"] = d.pop("dtype")
    return cfg


def check_config_roundtrip(built, loaded):
    """The folder's config.json must describe exactly the built model."""
    pairs = [
        ("text_config", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                         "rms_norm_eps", "rope_parameters", "attention_bias", "mlp_bias"]),
        ("vision_config", ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "image_size", "patch_size", "hidden_act", "layer_norm_eps", "num_channels"]),
        (None, ["image_token_index", "projector_hidden_act", "vision_feature_layer",
                "vision_feature_select_strategy", "multimodal_projector_bias", "tie_word_embeddings"]),
    ]
    for sub, keys in pairs:
        a = getattr(built, sub) if sub else built
        b = getattr(loaded, sub) if sub else loaded
        for k in keys:
            va, vb = getattr(a, k), getattr(b, k)
            if va != vb:
                raise AssertionError(f"config mismatch {sub}.{k}: built {va!r} vs loaded {vb!r}")


# ----------------------------------------------------------------------------
# Reference run
# ----------------------------------------------------------------------------
