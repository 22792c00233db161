#!/usr/bin/env python3
"""SentencePiece tokenizers whose "▁" prefix HF transformers places by tokenizer_config.json, and
HF's ids for a few prompts (ChatTemplate.SentencePiecePrefixAsTransformersPlacesIt in
tests/models/test_chat_template.cpp checks kvlens against them).

The same SentencePiece model (make_hf_fixtures.py's, <image> = 352) in five folders under --out
(default tests/fixtures/tokenizers/sp_prefix), differing in tokenizer_config.json alone:
  legacy_true     "legacy": true             the prefix before every text section
  legacy_false    "legacy": false            before the text's first section only
  legacy_absent   no "legacy"                as transformers 5.x defaults it
  legacy_null     "legacy": null             the same
  no_prefix_space "add_prefix_space": false  before none
  self_test       "legacy": false, and the model carries SentencePiece self-test samples (which
                  a copy of the model without its prefix must not be checked against)
  strip_spaces    "legacy": true, and the model's normalizer removes extra whitespace (a leading
                  space among it; transformers ignores that setting)
cases.json: for each folder and prompt template (<image> at the start, inside, twice, last and
absent; sections that start with a space or with "▁"; <s>, </s> and <unk> written in the text),
HF's AutoTokenizer ids for the template with {prompt} filled and <image> written three times, as
the processors expand it, and the transformers version that gave them.

  python3 tests/make_sp_prefix_fixtures.py [--out DIR]
"""
import argparse
import json
import os
import shutil

import transformers
from transformers import AutoTokenizer

from make_hf_fixtures import SP_VOCAB, train_tokenizer, write_tokenizer_files
from hf_layouts import write_json

VARIANTS = {"legacy_true": {"legacy": True}, "legacy_false": {"legacy": False}, "legacy_absent": {"legacy": ...},
            "legacy_null": {"legacy": None}, "no_prefix_space": {"add_prefix_space": False},
            "self_test": {"legacy": False}, "strip_spaces": {"legacy": True}}
TEMPLATES = ["USER: <image>\n{prompt} ASSISTANT:", "<image>\n{prompt}", "[INST] <image> {prompt} [/INST]",
             " {prompt}", "{prompt}<image>", "A<image>B<image>C {prompt}", "\u2581{prompt} x<image>\u2581y",
             "<s>[INST] <image>\n{prompt} </s>x [/INST]", "{prompt}<unk> y</s>"]
PROMPT = "Describe the image."
N_VISUAL = 3


def with_self_test(proto):
    """The model with self-test samples (ModelProto field 4, SelfTestData: samples = 1 of
    {input = 1, expected = 2}, written here as protobuf bytes): each input and its pieces joined
    by spaces, as SentencePiece checks them when it loads the model."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_proto=proto)

    def field(number, payload):
        n, size = (number << 3) | 2, len(payload)
        out = bytearray([n])
        while True:
            out.append((size & 0x7F) | (0x80 if size > 0x7F else 0))
            size >>= 7
            if not size:
                return bytes(out) + payload

    samples = b"".join(field(1, field(1, t.encode()) + field(2, " ".join(sp.encode(t, out_type=str)).encode()))
                       for t in ("Describe the image.", " a red circle", "\nhello"))
    with_test = proto + field(4, samples)
    spm.SentencePieceProcessor(model_proto=with_test)  # (loads)
    return with_test


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                                                  "tokenizers", "sp_prefix"))
    args = ap.parse_args()
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)
    proto, _ = train_tokenizer()
    cases = {"transformers_version": transformers.__version__, "image_token_index": SP_VOCAB,
             "n_visual": N_VISUAL, "prompt": PROMPT, "variants": {}}
    for name, change in VARIANTS.items():
        folder = os.path.join(args.out, name)
        os.makedirs(folder)
        model = {"self_test": with_self_test(proto),
                 # NormalizerSpec (field 3) again with remove_extra_whitespaces (its field 4) on: merged
                 "strip_spaces": proto + b"\x1a\x02\x20\x01"}.get(name, proto)
        write_tokenizer_files(folder, model, SP_VOCAB, 14, "default")
        os.remove(os.path.join(folder, "processor_config.json"))
        path = os.path.join(folder, "tokenizer_config.json")
        with open(path) as f:
            cfg = json.load(f)
        for k, v in change.items():
            if v is ...:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        cfg.pop("processor_class", None)
        write_json(path, cfg)
        tok = AutoTokenizer.from_pretrained(folder)
        rows = []
        for t in TEMPLATES:
            text = t.replace("{prompt}", PROMPT).replace("<image>", "<image>" * N_VISUAL)
            rows.append({"template": t, "ids": tok(text)["input_ids"]})
        cases["variants"][name] = rows
        print(name, [r["ids"][:6] for r in rows])
    write_json(os.path.join(args.out, "cases.json"), cases)


if __name__ == "__main__":
    main()
