#!/usr/bin/env python3
"""Build tiny text-only reference checkpoints (HF LlamaForCausalLM, MistralForCausalLM) and
record HF transformers outputs, as tests/make_hf_fixtures.py does for LLaVA-1.5.

Each folder under --out (default tests/fixtures/hf) is a complete HF model directory written by
save_pretrained (config, safetensors, SentencePiece tokenizer) with random weights, plus:

  expected.json      prompt, template, prompt ids, greedy ids, margins, metadata ("text_only")
  logits.f32         first-step logits at the last prompt position [V]
  attn0.f32          layer-0 attention probabilities [H, T, T]
  step_logits.f32    logits used to pick each greedy token [n_steps, V]

Folders:

  llama_text_fp32_tied   LlamaForCausalLM, MHA, fp32, tied embeddings (no lm_head tensor),
                         rope_parameters with a non-default theta.
  llama3_bpe_rope_scaled LlamaForCausalLM in Llama-3's shape: a byte-level BPE tokenizer.json
                         (tests/fixtures/tokenizers/llama3_style, BOS from its post-processor),
                         rope_parameters of type llama3 whose three frequency bands all occur at
                         head_dim 16, GQA 4:2, fp16.
  qwen2_bpe_chatml       Qwen2ForCausalLM: q/k/v biases without an o bias, GQA 4:2, tied embeddings,
                         bf16, a Qwen2-style byte-level BPE tokenizer.json (NFC, no BOS) and the
                         ChatML chat template.
  mistral_gqa_bf16_shard MistralForCausalLM, GQA 4:2 with an explicit head_dim, bf16, sharded
                         safetensors, a sliding_window longer than the context.

HF outputs are computed in fp32 with eager attention from the fp32 upcast of the stored weights.
Usage: python3 tests/make_hf_text_fixtures.py [--out tests/fixtures/hf]
"""

import argparse
import os
import shutil
import sys

import torch
import transformers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import (N_GREEDY, SP_VOCAB, greedy_decode, random_init, special_token_entry,  # noqa: E402
                              train_tokenizer)  # noqa: E402
from hf_layouts import write_json  # noqa: E402
from make_hf_next_fixtures import build_first_clear, fresh_folder  # noqa: E402
from make_chat_template_fixtures import CHATML, LLAMA3  # noqa: E402

PROMPT = "The picture was taken in the morning, so the light is"
TEMPLATE = "{prompt}"
VOCAB = SP_VOCAB  # no image token: the text vocabulary is the SentencePiece one

SPECS = [
    dict(name="llama_text_fp32_tied", cls=LlamaForCausalLM, cfg=LlamaConfig, dtype=torch.float32, shard=None, seed=11,
         text=dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    dict(name="llama3_bpe_rope_scaled", cls=LlamaForCausalLM, cfg=LlamaConfig, dtype=torch.float16, shard=None, seed=13,
         tokenizer="llama3_style", vocab=704, chat_template=LLAMA3,
         text=dict(hidden_size=64, intermediate_size=144, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                   tie_word_embeddings=False,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64})),
    dict(name="qwen2_bpe_chatml", cls=Qwen2ForCausalLM, cfg=Qwen2Config, dtype=torch.bfloat16, shard=None, seed=15,
         tokenizer="qwen2_style", vocab=704, chat_template=CHATML,
         text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    dict(name="mistral_gqa_bf16_shard", cls=MistralForCausalLM, cfg=MistralConfig, dtype=torch.bfloat16, shard="40KB",
         seed=12,
         text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=24, max_position_embeddings=512, rms_norm_eps=1e-6,
                   sliding_window=128, tie_word_embeddings=False)),
]


def write_tokenizer(folder, proto):
    with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
        f.write(proto)
    special = {0: "<unk>", 1: "<s>", 2: "</s>"}
    write_json(os.path.join(folder, "tokenizer_config.json"), {
        "add_bos_token": True, "add_eos_token": False,
        "added_tokens_decoder": {str(k): special_token_entry(v) for k, v in special.items()},
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
        "clean_up_tokenization_spaces": False, "legacy": False, "model_max_length": 4096,
        "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer",
    })


def write_f32(path, t):
    t.detach().float().contiguous().numpy().astype("<f4").tofile(path)


MIN_MARGIN = 0.05  # greedy ids must not hinge on rounding: each step's top-2 gap at least this


@torch.no_grad()
def build_seed(spec, out_root, proto, sp, seed):
    """The folder for this seed, or a falsy value where its greedy steps do not all have a clear
    winner or repeat one token throughout (build_first_clear then tries the next seed)."""
    folder = fresh_folder(out_root, spec["name"])
    vocab = spec.get("vocab", VOCAB)
    bpe_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tokenizers",
                           spec["tokenizer"]) if spec.get("tokenizer") else None
    if bpe_dir:  # a byte-level BPE tokenizer.json (tests/make_bpe_fixtures.py); its own BOS / EOS
        import tokenizers
        bpe = tokenizers.Tokenizer.from_file(os.path.join(bpe_dir, "tokenizer.json"))
        bos = bpe.token_to_id("<|begin_of_text|>")  # (None: Qwen2 has no BOS)
        eos = bpe.token_to_id("<|eot_id|>") or bpe.token_to_id("<|im_end|>")
    else:
        bos, eos = 1, 2
    cfg = spec["cfg"](vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, **spec["text"])
    torch.manual_seed(seed)
    model = spec["cls"](cfg)
    random_init(model, seed, 0.08)
    model = model.to(spec["dtype"])
    kw = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
    model.save_pretrained(folder, safe_serialization=True, **kw)
    if bpe_dir:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(os.path.join(bpe_dir, f), folder)
    if spec.get("chat_template"):
        with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
            f.write(spec["chat_template"])
    else:
        write_tokenizer(folder, proto)
    # The reference: the folder loaded back, upcast to fp32, eager attention.
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ids = AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"] if bpe_dir else [1] + sp.encode(PROMPT)
    try:
        hf_ids = AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]
    except Exception as e:  # (the tokenizer's converter needs protobuf)
        hf_ids = None
        print("  HF tokenizer not compared:", e)
    x = torch.tensor([ids])
    out = ref(input_ids=x, output_attentions=True, use_cache=True)
    greedy, margins, steps = greedy_decode(ref, out)
    if min(margins) < MIN_MARGIN or len(set(greedy)) < 3:
        return False
    chat = {}
    if spec.get("chat_template"):  # what HF's tokenizer gives for the prompt as one user turn
        tok = AutoTokenizer.from_pretrained(folder)
        turn = [{"role": "user", "content": PROMPT}]
        chat = {"chat_prompt_ids": tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False),
                "chat_prompt_text": tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)}
    write_f32(os.path.join(folder, "logits.f32"), out.logits[0, -1])
    write_f32(os.path.join(folder, "attn0.f32"), out.attentions[0][0])
    write_f32(os.path.join(folder, "step_logits.f32"), torch.stack(steps))
    H, T = out.attentions[0].shape[1], len(ids)
    write_json(os.path.join(folder, "expected.json"), {
        "text_only": True, "prompt": PROMPT, "template": TEMPLATE, "prompt_ids": ids, "greedy_ids": greedy,
        "n_visual_tokens": 0, "margins": margins, "logits_file": "logits.f32", "attn0_file": "attn0.f32",
        "attn0_shape": [H, T, T], "step_logits_file": "step_logits.f32", "step_logits_shape": [N_GREEDY, vocab],
        "logits_shape": [vocab], "vocab_size": vocab, "hf_tokenizer_ids_agree": hf_ids == ids if hf_ids else None,
        "architecture": spec["cls"].__name__, "seed": seed, "dtype": str(spec["dtype"]).replace("torch.", ""),
        "transformers_version": transformers.__version__, "torch_version": torch.__version__, **chat,
    })
    print("%-24s seed %d, %d prompt ids, greedy %s, min margin %.3g, HF tokenizer agrees: %s"
          % (spec["name"], seed, len(ids), greedy, min(margins), hf_ids == ids if hf_ids else "-"))
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf"))
    ap.add_argument("--only", nargs="*", help="build only these folders")
    args = ap.parse_args()
    proto, sp = train_tokenizer()
    for spec in SPECS:
        if not args.only or spec["name"] in args.only:
            build_first_clear(spec, build_seed, args.out, proto, sp)


if __name__ == "__main__":
    main()
