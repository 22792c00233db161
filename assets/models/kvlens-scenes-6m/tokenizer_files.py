"""The tokenizer files train_embedded.py writes beside the weights (tokenizer.model and the
transformers configs around it, tokenizer.json) and the check that transformers' AutoTokenizer
reads them to the runner's ids."""
import json
import os

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
IMAGE_PLACEHOLDER = "<image>"


def write_tokenizer_files(out, sp_bytes, sp, image_token_index, max_len):
    with open(os.path.join(out, "tokenizer.model"), "wb") as f:
        f.write(sp_bytes)

    def tok(content, special=True):
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": special}

    unk, bos, eos = sp.id_to_piece(UNK_ID), sp.id_to_piece(BOS_ID), sp.id_to_piece(EOS_ID)
    cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "add_prefix_space": None,
        "added_tokens_decoder": {
            str(UNK_ID): tok(unk), str(BOS_ID): tok(bos), str(EOS_ID): tok(eos),
            str(image_token_index): tok(IMAGE_PLACEHOLDER),
        },
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": max_len,
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": "LlamaTokenizer",
        "use_default_system_prompt": False,
        "image_token": IMAGE_PLACEHOLDER,
        "extra_special_tokens": {"image_token": IMAGE_PLACEHOLDER},
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": tok(bos), "eos_token": tok(eos), "unk_token": tok(unk)}, f, indent=2)
    with open(os.path.join(out, "added_tokens.json"), "w") as f:
        json.dump({IMAGE_PLACEHOLDER: image_token_index}, f, indent=2)


def write_tokenizer_json(out):
    """Adds tokenizer.json, converted by transformers' LlamaTokenizer from tokenizer.model.
    AutoTokenizer loads llava folders through the generic tokenizers backend, which needs it.
    The conversion reads the SentencePiece proto (needs protobuf); failure is reported, not
    fatal: the C++ runner reads tokenizer.model."""
    import shutil
    import tempfile
    try:
        from transformers import LlamaTokenizer
        tok = LlamaTokenizer.from_pretrained(out)  # legacy=True: "▁" after special tokens
        with tempfile.TemporaryDirectory() as tmp:
            tok.save_pretrained(tmp)
            shutil.copyfile(os.path.join(tmp, "tokenizer.json"), os.path.join(out, "tokenizer.json"))
        return "written"
    except Exception as e:
        return f"not written ({type(e).__name__}: {str(e)[:160]})"


def hf_tokenizer_check(out, sp, template, prompt_ids, texts, prompts):
    """Loads the written tokenizer with AutoTokenizer and compares its ids with the runner's:
    the filled prompt `template` against prompt_ids(prompt) (one <image> token) for each prompt,
    and BOS + sp.encode(text) for each text. Informative only: the runner uses tokenizer.model
    directly."""
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(out)
        bad, n = [], 0
        for p in prompts:
            got = tok(template.replace("{prompt}", p)).input_ids
            want = prompt_ids(p)
            n += 1
            if got != want:
                bad.append(f"prompt {p!r}: hf {got} vs runner {want}")
        for t in texts:
            n += 1
            if tok(t).input_ids != [BOS_ID] + sp.encode(t):
                bad.append(f"text {t!r}: hf {tok(t).input_ids} vs runner {[BOS_ID] + sp.encode(t)}")
        if bad:
            return f"{len(bad)} of {n} differ ({type(tok).__name__}); first: {bad[0][:300]}"
        return f"match ({n} strings, {type(tok).__name__})"
    except Exception as e:  # informative only
        return f"not loaded ({type(e).__name__}: {str(e)[:160]})"
