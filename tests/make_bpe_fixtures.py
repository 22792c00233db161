#!/usr/bin/env python3
"""Build small byte-level BPE tokenizers with HF `tokenizers` in the layouts of GPT-2, Llama-3 and
Qwen2, and record what HF gives for a set of texts, for tests/models/test_bpe_tokenizer.cpp.

Each folder under --out (default tests/fixtures/tokenizers) holds:

  tokenizer.json         trained on the fixture corpus (a few hundred merges), with its family's
                         normalizer, pre-tokenizer, post-processor, decoder and special tokens
  tokenizer_config.json  bos_token / eos_token / add_bos_token as the family's checkpoints set them
  cases.json             for each text: HF's ids without special tokens, its ids with them (the
                         post-processor's BOS), and its decode of the ids (special tokens skipped);
                         for non-ASCII texts the decode of every prefix of the ids as well

Folders:

  gpt2_style    ByteLevel pre-tokenizer with GPT-2's regex, no BOS
  llama3_style  Split with Llama-3's regex (digits in threes) then ByteLevel, ignore_merges,
                TemplateProcessing putting <|begin_of_text|> first, 256-style reserved tokens
  qwen2_style   NFC normalizer, Split with Qwen2's regex (digits one by one) then ByteLevel, no
                BOS, the chat and vision special tokens
  ignore_merges_probe  a hand-made vocabulary where ignore_merges changes the ids

Usage: python3 tests/make_bpe_fixtures.py [--out tests/fixtures/tokenizers]
"""

import argparse
import json
import os
import sys

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import CORPUS  # noqa: E402

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

EXTRA_CORPUS = """
Le café est très bon. Das Bild zeigt einen großen Baum. Η εικόνα δείχνει ένα σπίτι. τ1 = 0, τ2 = 3.
图像显示了一只猫。 画像には犬がいます。 🙂 👍🏽 The price is $1,234,567.89 on 2026-11-29.
I'm sure you'll see it; we've done it, they'd say. DON'T SHOUT! It's 3.14159 and 42.
"""

TEXTS = [
    "Describe the image.",
    "USER: <image>\nDescribe the image. ASSISTANT:",
    "I'm sure you'll see it; WE'VE done it, they'd say. DON'T!",
    "1234567 and 3.14159, 2026-11-29, $1,234,567.89",
    "  leading spaces, trailing spaces   ",
    "tabs\t\tand\nnew lines\n\n\nand \r\n windows",
    "a  b   c    d",
    "café, cafe\u0301 (decomposed), naïve, Ærø",
    "τ1 = 0, τ2 = 3; γ(l) and δ",
    "图像显示了一只猫。画像には犬がいます。",
    "emoji 🙂👍🏽 and a rare one 🦩",
    "<|im_start|>user\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>",
    "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>Describe.",
    "<|endoftext|>",
    "",
    " ",
    "x",
    "The picture was taken in the morning, so the light is warm and the shadows are long.",
]

FAMILIES = {
    "gpt2_style": dict(
        specials=["<|endoftext|>"], bos=None, eos="<|endoftext|>", add_bos=False, normalizer=None,
        pre=lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), ignore_merges=False,
        post=lambda tok: processors.ByteLevel(trim_offsets=False)),
    "llama3_style": dict(
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        + ["<|reserved_special_token_%d|>" % i for i in range(8)],
        bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True, normalizer=None,
        pre=lambda: pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]),
        ignore_merges=True,
        post=lambda tok: processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                          special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])])),
    "qwen2_style": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>"],
        bos=None, eos="<|im_end|>", add_bos=False, normalizer=lambda: normalizers.NFC(),
        pre=lambda: pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]),
        ignore_merges=False,
        post=lambda tok: processors.ByteLevel(trim_offsets=False)),
}


def build(name, fam, out_root):
    folder = os.path.join(out_root, name)
    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer(models.BPE(ignore_merges=fam["ignore_merges"]))
    if fam["normalizer"]:
        tok.normalizer = fam["normalizer"]()
    tok.pre_tokenizer = fam["pre"]()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=1, special_tokens=fam["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS, EXTRA_CORPUS] * 3, trainer=trainer)
    tok.post_processor = fam["post"](tok)
    tok.save(os.path.join(folder, "tokenizer.json"))
    cfg = {"add_bos_token": fam["add_bos"], "bos_token": fam["bos"], "eos_token": fam["eos"],
           "clean_up_tokenization_spaces": False, "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    cases = []
    for text in TEXTS:
        plain = tok.encode(text, add_special_tokens=False).ids
        with_special = tok.encode(text, add_special_tokens=True).ids
        case = {"text": text, "ids": plain, "ids_with_special_tokens": with_special,
                "decoded": tok.decode(plain, skip_special_tokens=True)}
        if any(ord(ch) > 127 for ch in text):  # prefixes that end inside a character decode to U+FFFD
            case["decoded_prefixes"] = [tok.decode(plain[:k], skip_special_tokens=True) for k in range(1, len(plain))]
        cases.append(case)
    with open(os.path.join(folder, "cases.json"), "w") as f:
        json.dump({"tokenizers_version": tokenizers.__version__, "vocab_size": tok.get_vocab_size(),
                   "cases": cases}, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("%-14s vocab %d, %d cases, %d ids in all" % (name, tok.get_vocab_size(), len(cases),
                                                     sum(len(c["ids"]) for c in cases)))


def build_ignore_merges_probe(out_root):
    """A hand-made vocabulary holding "abc" and "Ġabc" while the merges only reach "ab": with
    ignore_merges a word found whole is one token, without it the merges split it."""
    folder = os.path.join(out_root, "ignore_merges_probe")
    os.makedirs(folder, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for w in ["ab", "abc", "\u0120abc", "\u0120a"]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("\u0120", "a")], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False, "bos_token": None, "eos_token": None}, f, indent=2)
        f.write("\n")
    cases = [{"text": t, "ids": tok.encode(t).ids, "ids_with_special_tokens": tok.encode(t).ids,
              "decoded": tok.decode(tok.encode(t).ids)} for t in ["abc", "abc abc abcd", "cab ab abcabc"]]
    with open(os.path.join(folder, "cases.json"), "w") as f:
        json.dump({"tokenizers_version": tokenizers.__version__, "vocab_size": tok.get_vocab_size(), "cases": cases},
                  f, indent=1)
        f.write("\n")
    print("%-14s vocab %d, %s" % ("ignore_merges_probe", tok.get_vocab_size(), [c["ids"] for c in cases]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tokenizers"))
    args = ap.parse_args()
    for name, fam in FAMILIES.items():
        build(name, fam, args.out)
    build_ignore_merges_probe(args.out)


if __name__ == "__main__":
    main()
