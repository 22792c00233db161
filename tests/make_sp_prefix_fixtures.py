#!/usr/bin/env python3
"""SentencePiece tokenizers whose "▁" prefix HF transformers places by tokenizer_config.json, and
HF's ids for a few prompts (tests/models/test_sp_prefix.cpp checks kvlens against them).

The same SentencePiece model (make_hf_fixtures.py's, <image> = 352) in four folders under --out
(default tests/fixtures/tokenizers/sp_prefix), differing in tokenizer_config.json alone:
  legacy_true     "legacy": true             the prefix before every text section
  legacy_false    "legacy": false            before the text's first section only
  legacy_absent   no "legacy"                as transformers 5.x defaults it
  no_prefix_space "add_prefix_space": false  before none
cases.json: for each folder and prompt template (with <image> at the start, inside and absent),
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

VARIANTS = {"legacy_true": {"legacy": True}, "legacy_false": {"legacy": False}, "legacy_absent": {"legacy": None},
            "no_prefix_space": {"add_prefix_space": False}}
TEMPLATES = ["USER: <image>\n{prompt} ASSISTANT:", "<image>\n{prompt}", "[INST] <image> {prompt} [/INST]",
             " {prompt}", "{prompt}<image>"]
PROMPT = "Describe the image."
N_VISUAL = 3


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
        write_tokenizer_files(folder, proto, SP_VOCAB, 14, "default")
        os.remove(os.path.join(folder, "processor_config.json"))
        path = os.path.join(folder, "tokenizer_config.json")
        with open(path) as f:
            cfg = json.load(f)
        for k, v in change.items():
            if v is None:
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
