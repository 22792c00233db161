#!/usr/bin/env python3
"""Trains kvlens's embedded default model: a small LlavaForConditionalGeneration learned from
scratch on the procedural scenes that `kvlens scenes` writes.

Stages: SentencePiece tokenizer on the scene text -> prompts built exactly as the C++ runner builds
them -> images decoded once (in parallel) into one uint8 tensor on the device -> AdamW training
under a wall-clock budget -> fp16 save (model, tokenizer, preprocessor, train_info.json) ->
held-out evaluation of the saved weights reloaded in fp32 with eager attention and greedy
decoding (eval.json), plus reference generations for token-by-token checks of the C++ runner.

Usage (see assets/models/kvlens-scenes-6m/train_embedded.sh for the full GPU run):
  python3 assets/models/kvlens-scenes-6m/train_embedded.py --train /tmp/scenes_train --heldout /tmp/scenes_heldout \
      --out /tmp/kvlens_model --minutes 6 --hf-outputs /tmp/hf_outputs.json [--preset scenes-deep]
  python3 -m torch.distributed.run --standalone --nproc_per_node 2 assets/models/kvlens-scenes-6m/train_embedded.py \
      ... --pack --compile          (data parallel over 2 GPUs, every sample of an image in one row)
"""
import argparse
import io
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time

import numpy as np
from PIL import Image

from presets import PRESETS, llava_config  # (this script's folder)
from packing import PackedTable, packed_mask
from ranks import Ranks
from tokenizer_files import (BOS_ID, EOS_ID, IMAGE_PLACEHOLDER, UNK_ID, hf_tokenizer_check,
                             write_tokenizer_files, write_tokenizer_json)

# OpenAI CLIP normalization, as CLIPImageProcessor and the C++ PreprocessConfig use it.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
PRESET = PRESETS["scenes-6m"]
IMAGE_SIZE = 224          # crop size and shortest edge after resize (set by apply_preset)
PATCH_SIZE = 16           # -> 14 x 14 = 196 visual tokens (CLS dropped: "default" strategy)
N_VISUAL = (IMAGE_SIZE // PATCH_SIZE) ** 2


def apply_preset(name):
    global PRESET, IMAGE_SIZE, PATCH_SIZE, N_VISUAL
    PRESET = PRESETS[name]
    IMAGE_SIZE, PATCH_SIZE = PRESET["image_size"], PRESET["patch_size"]
    N_VISUAL = (IMAGE_SIZE // PATCH_SIZE) ** 2

# Prompt layout of the C++ runner (LLaVA-1.5 style); CAPTION_PROMPT is its default prompt.
PROMPT_TEMPLATE = "USER: <image>\n{prompt} ASSISTANT:"
CAPTION_PROMPT = "Describe the image."

T_START = time.time()


LOG_HERE = True  # False on ranks other than 0


def log(msg):
    if LOG_HERE:
        print(f"[{time.time() - T_START:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

def load_scenes(root):
    """Reads DIR/annotations.json. Returns images (in file order), per-image caption lists (the
    first one canonical), questions, and the info block."""
    with open(os.path.join(root, "annotations.json")) as f:
        ann = json.load(f)
    images = ann["images"]
    caps = {im["id"]: [] for im in images}
    for a in ann["annotations"]:  # file order: the first annotation of an image is canonical
        caps[a["image_id"]].append(a["caption"])
    missing = [im["id"] for im in images if not caps[im["id"]]]
    if missing:
        raise SystemExit(f"{root}: {len(missing)} images have no caption (first: {missing[0]})")
    questions = ann.get("questions", [])
    return images, [caps[im["id"]] for im in images], questions, ann.get("info", {})


def clip_preprocess_uint8(path):
    """CLIPImageProcessor's resize + center crop on a PIL image, kept as uint8 HWC: bicubic resize
    of the shortest edge to IMAGE_SIZE (long edge int(size * long / short)), then crop."""
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        short, long_ = (w, h) if w <= h else (h, w)
        new_short, new_long = IMAGE_SIZE, int(IMAGE_SIZE * long_ / short)
        nw, nh = (new_short, new_long) if w <= h else (new_long, new_short)
        if (nw, nh) != (w, h):
            im = im.resize((nw, nh), resample=Image.BICUBIC)
        a = np.asarray(im, dtype=np.uint8)
    top = (a.shape[0] - IMAGE_SIZE) // 2
    left = (a.shape[1] - IMAGE_SIZE) // 2
    if top < 0 or left < 0:
        raise ValueError(f"{path}: image smaller than the crop after resize")
    return np.ascontiguousarray(a[top:top + IMAGE_SIZE, left:left + IMAGE_SIZE])


def decode_images(root, images, workers):
    """Decodes and preprocesses every image of a scene set into one [N, S, S, 3] uint8 array (S: the preset's image size)."""
    paths = [os.path.join(root, im["file_name"]) for im in images]
    out = np.empty((len(paths), IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    workers = max(1, min(workers, os.cpu_count() or 1, len(paths)))
    if workers == 1:
        for i, p in enumerate(paths):
            out[i] = clip_preprocess_uint8(p)
        return out
    with mp.get_context("fork").Pool(workers) as pool:
        for i, a in enumerate(pool.imap(clip_preprocess_uint8, paths, chunksize=64)):
            out[i] = a
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def train_sentencepiece(texts, vocab_size, threads):
    """Trains a Llama-like BPE SentencePiece model on `texts`; returns the serialized model."""
    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buf,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,          # procedural text may not support the full size
        byte_fallback=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
        num_threads=max(1, threads),
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        max_sentence_length=4096,
        minloglevel=2,
    )
    return buf.getvalue()


def tokenizer_texts(cap_lists, questions):
    """All caption / question / answer text plus the prompt template words."""
    texts = []
    for caps in cap_lists:
        texts.extend(caps)
    for q in questions:
        texts.append(q["question"])
        texts.append(str(q["answer"]))
    # The template split at the placeholder and at the newline, as lines the trainer can use.
    head, tail = PROMPT_TEMPLATE.split(IMAGE_PLACEHOLDER)
    for prompt in [CAPTION_PROMPT] + [q["question"] for q in questions[:2000]]:
        for part in (head + tail.replace("{prompt}", prompt)).split("\n"):
            texts.append(part)
    return [t for t in texts if t.strip()]


def encode_prompt(sp, prompt, image_token_index, n_visual=None):
    """tokenizer_image_token as the C++ runner does it: the filled template split at <image>,
    every chunk encoded on its own (each gets the dummy prefix), BOS once at the start, the image
    token repeated n_visual times between chunks."""
    if n_visual is None:
        n_visual = N_VISUAL
    text = PROMPT_TEMPLATE.replace("{prompt}", prompt)
    chunks = text.split(IMAGE_PLACEHOLDER)
    ids = [BOS_ID]
    for i, chunk in enumerate(chunks):
        if i > 0:
            ids.extend([image_token_index] * n_visual)
        ids.extend(sp.encode(chunk))
    return ids


def encode_target(sp, answer):
    return sp.encode(answer) + [EOS_ID]


def write_preprocessor_config(out):
    cfg = {
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "image_processor_type": "CLIPImageProcessor",
        "resample": 3,
        "rescale_factor": 1.0 / 255.0,
        "size": {"shortest_edge": IMAGE_SIZE},
    }
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


# ---------------------------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------------------------

class SampleTable:
    """Tokenized (prompt, target) pairs padded into one array: caption samples first (one per
    image, target = canonical caption), then one VQA sample per question."""

    def __init__(self, sp, cap_lists, questions, id_to_row, image_token_index):
        rows, prompts, targets = [], [], []
        cap_ids = encode_prompt(sp, CAPTION_PROMPT, image_token_index)
        for i, caps in enumerate(cap_lists):
            rows.append(i)
            prompts.append(cap_ids)
            targets.append(encode_target(sp, caps[0]))
        self.n_caption = len(rows)
        qcache = {}
        for q in questions:
            if q["image_id"] not in id_to_row:
                continue
            if q["question"] not in qcache:
                qcache[q["question"]] = encode_prompt(sp, q["question"], image_token_index)
            rows.append(id_to_row[q["image_id"]])
            prompts.append(qcache[q["question"]])
            targets.append(encode_target(sp, str(q["answer"])))
        self.n_vqa = len(rows) - self.n_caption
        n = len(rows)
        self.plen = np.array([len(p) for p in prompts], dtype=np.int64)
        self.tlen = self.plen + np.array([len(t) for t in targets], dtype=np.int64)
        self.max_len = int(self.tlen.max())
        self.tokens = np.zeros((n, self.max_len), dtype=np.int64)
        for k, (p, t) in enumerate(zip(prompts, targets)):
            self.tokens[k, :len(p)] = p
            self.tokens[k, len(p):len(p) + len(t)] = t
        self.image_row = np.array(rows, dtype=np.int64)
        self.max_target = int((self.tlen - self.plen).max())


class CyclicSampler:
    """Walks shuffled permutations of range(lo, hi), reshuffling at each pass."""

    def __init__(self, lo, hi, rng):
        self.lo, self.hi, self.rng = lo, hi, rng
        self.perm, self.pos = None, 0

    def take(self, k):
        out = []
        while k > 0:
            if self.perm is None or self.pos >= len(self.perm):
                self.perm = self.rng.permutation(np.arange(self.lo, self.hi))
                self.pos = 0
            m = min(k, len(self.perm) - self.pos)
            out.append(self.perm[self.pos:self.pos + m])
            self.pos += m
            k -= m
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

def build_config(text_vocab, image_token_index, max_pos):
    return llava_config(PRESET, text_vocab, image_token_index, max_pos, BOS_ID, EOS_ID)


def make_pixels(imgs_u8, rows, mean, std):
    """uint8 [N,H,W,3] rows -> normalized float32 [B,3,H,W] (rescale then normalize)."""
    x = imgs_u8[rows].permute(0, 3, 1, 2).float().mul_(1.0 / 255.0)
    return (x - mean) / std


# ---------------------------------------------------------------------------------------------
# Greedy decoding
# ---------------------------------------------------------------------------------------------

def greedy_generate(model, input_ids, pixel_values, max_new, torch):
    """Greedy decoding with the model's KV cache for equal-length prompts (no padding). Returns
    per row the generated ids (ending in EOS if it came) and the smallest top-1/top-2 logit gap."""
    out = model(input_ids=input_ids, pixel_values=pixel_values, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1].float()
    b = input_ids.shape[0]
    steps, gaps = [], []
    done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
    for t in range(max_new):
        top = logits.topk(2, dim=-1)
        nxt = top.indices[:, 0]
        steps.append(nxt)
        gaps.append(top.values[:, 0] - top.values[:, 1])
        done |= nxt == EOS_ID
        if t == max_new - 1 or bool(done.all()):
            break
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
    ids = torch.stack(steps, 1).cpu().tolist()
    gap = torch.stack(gaps, 1).cpu().tolist()
    res = []
    for r in range(b):
        seq, g = [], []
        for tok, gg in zip(ids[r], gap[r]):
            seq.append(tok)
            g.append(gg)
            if tok == EOS_ID:
                break
        res.append((seq, min(g)))
    return res


def run_generation(model, items, imgs_u8, mean, std, batch, max_new, torch, device):
    """items: list of (prompt_ids, image_row). Groups prompts by length so each batch is
    unpadded; returns results in item order."""
    groups = {}
    for k, (p, _) in enumerate(items):
        groups.setdefault(len(p), []).append(k)
    results = [None] * len(items)
    for _, ks in sorted(groups.items()):
        for s in range(0, len(ks), batch):
            chunk = ks[s:s + batch]
            ids = torch.tensor([items[k][0] for k in chunk], dtype=torch.long, device=device)
            rows = torch.tensor([items[k][1] for k in chunk], dtype=torch.long, device=device)
            px = make_pixels(imgs_u8, rows, mean, std)
            for k, r in zip(chunk, greedy_generate(model, ids, px, max_new, torch)):
                results[k] = r
    return results


def decode_text(sp, ids):
    return sp.decode([t for t in ids if t != EOS_ID])


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="scene set to train on (kvlens scenes --out)")
    ap.add_argument("--heldout", required=True, help="scene set with another seed, for evaluation")
    ap.add_argument("--out", required=True, help="model folder to write")
    ap.add_argument("--steps", type=int, default=100000,
                    help="step cap; the wall budget (--minutes) normally ends training first")
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.02)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=6.0, help="wall budget of the training loop")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="unix time by which the training loop must end (0: none)")
    ap.add_argument("--device", default="auto", help="cuda, cpu, ... (auto: cuda if available)")
    ap.add_argument("--eval-n", type=int, default=500, help="held-out images to evaluate")
    ap.add_argument("--train-eval-n", type=int, default=200,
                    help="training images whose captions are also scored (overfitting check)")
    ap.add_argument("--eval-batch", type=int, default=256)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="scenes-6m",
                    help="model shape: scenes-6m (the embedded default) or scenes-deep (LLaVA-1.5 geometry, 12 layers)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: the preset's (40 / 96)")
    ap.add_argument("--hf-outputs", default="", help="reference generations for the C++ runner")
    ap.add_argument("--hf-n", type=int, default=64)
    ap.add_argument("--caption-frac", type=float, default=0.5, help="caption share of a batch")
    ap.add_argument("--vocab", type=int, default=640, help="SentencePiece vocab size (soft)")
    ap.add_argument("--workers", type=int, default=16, help="image decoding processes")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--compile", action="store_true", help="torch.compile the training model")
    ap.add_argument("--pack", action="store_true",
                    help="one row an image holding all its samples (packing.py); --batch counts images")
    return ap.parse_args(argv)


def main(argv=None):
    global LOG_HERE
    args = parse_args(argv)
    apply_preset(args.preset)
    ranks = Ranks(args.device)
    LOG_HERE = ranks.main
    if args.max_new_tokens <= 0:
        args.max_new_tokens = PRESET["max_new_tokens"]
    os.makedirs(args.out, exist_ok=True)
    random.seed(args.seed)
    np.random.seed(args.seed)

    # ---- data + tokenizer (before any CUDA work, so the decode pool can fork) ----
    tr_images, tr_caps, tr_qs, tr_info = load_scenes(args.train)
    ho_images, ho_caps, ho_qs, ho_info = load_scenes(args.heldout)
    log(f"train: {len(tr_images)} images, {sum(map(len, tr_caps))} captions, {len(tr_qs)} questions"
        f" | heldout: {len(ho_images)} images, {len(ho_qs)} questions")

    import sentencepiece as spm
    texts = tokenizer_texts(tr_caps, tr_qs)  # training text only; byte fallback covers the rest
    sp_bytes = ranks.share(lambda: train_sentencepiece(texts, args.vocab, args.workers))
    sp = spm.SentencePieceProcessor(model_proto=sp_bytes)
    sp_vocab = sp.get_piece_size()
    image_token_index = sp_vocab
    text_vocab = (sp_vocab + 1 + 7) // 8 * 8
    log(f"tokenizer: {sp_vocab} pieces, <image>={image_token_index}, text vocab {text_vocab}")

    tr_id_to_row = {im["id"]: r for r, im in enumerate(tr_images)}
    table = SampleTable(sp, tr_caps, tr_qs, tr_id_to_row, image_token_index)
    max_pos = max(512, 1 << (table.max_len + args.max_new_tokens - 1).bit_length())
    log(f"samples: {table.n_caption} caption + {table.n_vqa} vqa, max length {table.max_len}"
        f" (longest target {table.max_target})")
    packed = PackedTable(table, image_token_index, len(tr_images)) if args.pack else None
    if packed:
        log(f"packed: {len(tr_images)} rows of up to {packed.max_len} tokens (prefix {packed.prefix})")
    if table.max_target > args.max_new_tokens:
        log(f"WARNING: a training target has {table.max_target} tokens (> --max-new-tokens"
            f" {args.max_new_tokens}); such samples cannot match exactly at evaluation")

    t0 = time.time()
    tr_u8 = decode_images(args.train, tr_images, args.workers)
    eval_n = min(args.eval_n, len(ho_images))
    ho_u8 = decode_images(args.heldout, ho_images[:eval_n], args.workers)
    tr_n = min(args.train_eval_n, len(tr_images))
    tr_eval_u8 = tr_u8[:tr_n].copy()
    log(f"decoded {len(tr_u8)} + {len(ho_u8)} images in {time.time() - t0:.1f}s")

    # ---- model ----
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import LlavaForConditionalGeneration
    torch.manual_seed(args.seed)
    device = ranks.device(args.device if args.device != "auto" else
                          "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.manual_seed_all(args.seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    config = build_config(text_vocab, image_token_index, max_pos)
    config._attn_implementation = "sdpa"
    model = LlavaForConditionalGeneration(config)
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = None
    model.to(device).train()
    params = list(model.parameters())
    ranks.same_parameters(params)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f} M params ({2 * n_params / 2**20:.1f} MiB fp16),"
        f" {N_VISUAL} visual tokens, attn {model.config._attn_implementation}, device {device},"
        f" {ranks.world} process(es)")

    imgs = torch.from_numpy(tr_u8).to(device)
    del tr_u8
    if packed is None:
        tokens = torch.from_numpy(table.tokens).to(device)
        plen_d = torch.from_numpy(table.plen).to(device)
        tlen_d = torch.from_numpy(table.tlen).to(device)
        img_row_d = torch.from_numpy(table.image_row).to(device)
    else:
        tokens = torch.from_numpy(packed.tokens).to(device)
        pos_d = torch.from_numpy(packed.pos).to(device)
        seg_d = torch.from_numpy(packed.seg).to(device)
        tgt_d = torch.from_numpy(packed.target).to(device)
    mean = torch.tensor(CLIP_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=device).view(1, 3, 1, 1)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "embed" in n or "norm" in n else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-8, fused=device.type == "cuda")
    fwd = torch.compile(model) if args.compile else model
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                              enabled=device.type == "cuda")

    rng = np.random.default_rng(args.seed)
    cap_s = CyclicSampler(0, table.n_caption, rng)  # packed: the images
    vqa_s = CyclicSampler(table.n_caption, table.n_caption + table.n_vqa, rng) if table.n_vqa else None
    n_cap = args.batch if vqa_s is None or packed else int(round(args.batch * args.caption_frac))
    max_len = table.max_len if packed is None else packed.max_len

    def batch(idx_np):
        """input ids, labels, image rows, positions and mask (None: plain causal) of samples idx_np."""
        # a compiled model keeps one shape: every batch padded to the longest sample
        L = max_len if args.compile or packed else int(table.tlen[idx_np].max())
        idx = torch.from_numpy(idx_np).to(device, non_blocking=True)
        ids = tokens[idx, :L]
        if packed is not None:
            labels = torch.where(tgt_d[idx], ids, torch.full_like(ids, -100))
            return ids, labels, idx, pos_d[idx], packed_mask(seg_d[idx], torch)
        pos = torch.arange(L, device=device)[None, :]
        tgt = (pos >= plen_d[idx][:, None]) & (pos < tlen_d[idx][:, None])
        return ids, torch.where(tgt, ids, torch.full_like(ids, -100)), img_row_d[idx], None, None
    if args.batch % ranks.world:
        raise SystemExit(f"--batch {args.batch} is not a multiple of the {ranks.world} processes")
    per_rank = args.batch // ranks.world  # every rank draws the same batch and takes its slice

    # ---- train: cosine over max(step / steps, elapsed / budget), so it completes on time ----
    t_train = time.time()
    budget = args.minutes * 60.0
    if args.deadline > 0:
        budget = min(budget, args.deadline - t_train)
    budget = max(budget, 1.0)
    what = (f"{args.batch} images, all {packed.samples} samples packed" if packed else
            f"{args.batch} ({n_cap} caption)")
    log(f"training: batch {what}; {per_rank} a process, lr {args.lr},"
        f" warmup {args.warmup}, budget {budget:.0f}s, step cap {args.steps},"
        f" {'compiled, length ' + str(max_len) if args.compile else 'not compiled'}")
    sync_every = 1 if ranks.world == 1 else 10  # rank 0's clock sets lr and the end for all
    time_progress = 0.0
    step, loss_acc, loss_n, last_loss, recent, curve = 0, None, 0, float("nan"), [], []
    progress = 0.0
    while step < args.steps:
        if step % sync_every == 0:
            time_progress = ranks.from_main((time.time() - t_train) / budget, device)
        progress = max(step / args.steps, time_progress)
        if progress >= 1.0:
            break
        warm = min(1.0, (step + 1) / max(1, args.warmup))
        cosf = 0.5 * (1.0 + math.cos(math.pi * progress))
        lr = args.lr * warm * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosf)
        for g in opt.param_groups:
            g["lr"] = lr

        idx_np = cap_s.take(n_cap)
        if vqa_s is not None and args.batch - n_cap > 0:
            idx_np = np.concatenate([idx_np, vqa_s.take(args.batch - n_cap)])
        ids, labels, rows, pos, mask = batch(idx_np[ranks.rank * per_rank:(ranks.rank + 1) * per_rank])
        px = make_pixels(imgs, rows, mean, std)

        with autocast:
            logits = fwd(input_ids=ids, pixel_values=px, position_ids=pos, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                               labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        ranks.average_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ld = loss.detach()
        loss_acc = ld if loss_acc is None else loss_acc + ld
        loss_n += 1
        if step % args.log_every == 0 or step == 1:
            last_loss = (loss_acc / loss_n).item()
            recent.append(last_loss)
            curve.append([step, round(last_loss, 6)])
            if not math.isfinite(last_loss):
                log(f"WARNING: loss is {last_loss} at step {step}")
            el = time.time() - t_train
            log(f"step {step:6d}  loss {last_loss:.4f}  lr {lr:.2e}  train {el:6.1f}s"
                f"  {step / max(el, 1e-9):.2f} it/s")
            loss_acc, loss_n = None, 0
    if loss_n:
        last_loss = (loss_acc / loss_n).item()
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t_train
    log(f"trained {step} steps in {train_s:.1f}s, final loss {last_loss:.4f}"
        f"{' (rank 0)' if ranks.world > 1 else ''}")
    world = ranks.world
    if world > 1:
        log(f"parameters equal on all {world} processes: {ranks.parameters_agree(params, device)}")
    ranks.close()
    if not ranks.main:
        return 0  # rank 0 saves and evaluates

    # ---- save (fp16) ----
    model.eval()
    model.to(torch.float16)
    model.config.dtype = torch.float16
    model.config.text_config.dtype = torch.float16
    model.config.vision_config.dtype = torch.float16
    model.save_pretrained(args.out, safe_serialization=True)
    write_tokenizer_files(args.out, sp_bytes, sp, image_token_index, max_pos)
    tok_json = write_tokenizer_json(args.out)
    write_preprocessor_config(args.out)
    del model, opt, fwd, imgs
    tokens = None  # the training arrays' GPU memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
    st_bytes = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    log(f"saved {args.out} (model.safetensors {st_bytes / 2**20:.1f} MiB)")

    # ---- evaluate the saved weights: fp32 (no TF32), eager attention, greedy ----
    t_eval = time.time()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = LlavaForConditionalGeneration.from_pretrained(
        args.out, dtype=torch.float32, attn_implementation="eager").to(device).eval()
    assert model.config.image_token_index == image_token_index
    ho_imgs = torch.from_numpy(ho_u8).to(device)
    cap_prompt = encode_prompt(sp, CAPTION_PROMPT, image_token_index)
    ho_id_to_row = {im["id"]: r for r, im in enumerate(ho_images[:eval_n])}
    ho_eval_qs = [q for q in ho_qs if q["image_id"] in ho_id_to_row]
    qprompt_cache = {}

    def qprompt(text):
        if text not in qprompt_cache:
            qprompt_cache[text] = encode_prompt(sp, text, image_token_index)
        return qprompt_cache[text]

    with torch.no_grad():
        cap_items = [(cap_prompt, r) for r in range(eval_n)]
        cap_res = run_generation(model, cap_items, ho_imgs, mean, std, args.eval_batch,
                                 args.max_new_tokens, torch, device)
        q_items = [(qprompt(q["question"]), ho_id_to_row[q["image_id"]]) for q in ho_eval_qs]
        q_res = run_generation(model, q_items, ho_imgs, mean, std, args.eval_batch,
                               args.max_new_tokens, torch, device)

        cap_any = cap_canon = cap_eos = 0
        cap_examples = []
        for r, (ids, _) in enumerate(cap_res):
            text = decode_text(sp, ids).strip()
            refs = [c.strip() for c in ho_caps[r]]
            cap_any += text in refs
            cap_canon += text == refs[0]
            cap_eos += bool(ids) and ids[-1] == EOS_ID
            if r < 8:
                cap_examples.append({"image": ho_images[r]["file_name"], "generated": text,
                                     "canonical": refs[0]})
        by_type = {}
        q_ok = 0
        q_examples = []
        for q, (ids, _) in zip(ho_eval_qs, q_res):
            text = decode_text(sp, ids).strip()
            ok = text == str(q["answer"]).strip()
            q_ok += ok
            t = by_type.setdefault(q.get("type", "unknown"), [0, 0])
            t[0] += ok
            t[1] += 1
            if len(q_examples) < 8:
                q_examples.append({"question": q["question"], "generated": text,
                                   "answer": q["answer"]})

        # captions of training images: distance between train and held-out exposes overfitting
        tr_cap = None
        if tr_n > 0:
            tr_res = run_generation(model, [(cap_prompt, r) for r in range(tr_n)],
                                    torch.from_numpy(tr_eval_u8).to(device), mean, std,
                                    args.eval_batch, args.max_new_tokens, torch, device)
            tr_cap = sum(decode_text(sp, ids).strip() == tr_caps[r][0].strip()
                         for r, (ids, _) in enumerate(tr_res)) / tr_n

        # reference generations for the C++ runner, one prompt at a time (batch 1, like it runs)
        hf = None
        if args.hf_outputs:
            hf_caps, hf_qs = [], []
            for r in range(min(args.hf_n, eval_n)):
                (ids, gap), = run_generation(model, [(cap_prompt, r)], ho_imgs, mean, std, 1,
                                             args.max_new_tokens, torch, device)
                hf_caps.append({"image_id": ho_images[r]["id"], "file_name": ho_images[r]["file_name"],
                                "prompt": CAPTION_PROMPT, "input_ids": cap_prompt,
                                "generated_ids": ids, "text": decode_text(sp, ids),
                                "min_top2_logit_gap": gap})
            for q in ho_eval_qs[:args.hf_n]:
                p = qprompt(q["question"])
                row = ho_id_to_row[q["image_id"]]
                (ids, gap), = run_generation(model, [(p, row)], ho_imgs, mean, std, 1,
                                             args.max_new_tokens, torch, device)
                hf_qs.append({"question_id": q["id"], "image_id": q["image_id"],
                              "file_name": ho_images[row]["file_name"], "prompt": q["question"],
                              "input_ids": p, "generated_ids": ids, "text": decode_text(sp, ids),
                              "answer": q["answer"], "min_top2_logit_gap": gap})
            hf = {"heldout": os.path.abspath(args.heldout), "model": os.path.abspath(args.out),
                  "dtype": "float32", "attn_implementation": "eager", "decoding": "greedy",
                  "max_new_tokens": args.max_new_tokens, "eos_token_id": EOS_ID,
                  "image_token_index": image_token_index, "n_visual": N_VISUAL,
                  "prompt_template": PROMPT_TEMPLATE, "heldout_info": ho_info,  # seed, size, generator version
                  "captions": hf_caps, "questions": hf_qs}
            d = os.path.dirname(os.path.abspath(args.hf_outputs))
            os.makedirs(d, exist_ok=True)
            with open(args.hf_outputs, "w") as f:
                json.dump(hf, f)
    eval_s = time.time() - t_eval

    # HF tokenizer loaded from the written files must reproduce the runner's prompt ids.
    check_texts = sorted({t for caps in ho_caps[:eval_n] for t in caps} |
                         {str(q[k]) for q in ho_eval_qs for k in ("question", "answer")})
    check_prompts = [CAPTION_PROMPT] + sorted({q["question"] for q in ho_eval_qs})[:50]
    tok_check = hf_tokenizer_check(args.out, sp, PROMPT_TEMPLATE,
                                   lambda p: encode_prompt(sp, p, image_token_index, n_visual=1),
                                   check_texts, check_prompts)
    log(f"tokenizer.json: {tok_json}; AutoTokenizer vs runner: {tok_check}")

    n_cap_eval = max(1, eval_n)
    n_q_eval = max(1, len(ho_eval_qs))
    result = {
        "heldout": os.path.abspath(args.heldout), "heldout_seed": ho_info.get("seed"),
        "n_images": eval_n, "n_questions": len(ho_eval_qs),
        "caption_exact_any": cap_any / n_cap_eval,
        "caption_exact_canonical": cap_canon / n_cap_eval,
        "caption_stopped_at_eos": cap_eos / n_cap_eval,
        "vqa_accuracy": q_ok / n_q_eval,
        "vqa_accuracy_by_type": {k: {"accuracy": v[0] / v[1], "n": v[1]}
                                 for k, v in sorted(by_type.items())},
        "train_caption_exact_canonical": tr_cap, "train_caption_n": tr_n,
        "dtype": "float32 (from fp16 weights)", "attn_implementation": "eager",
        "decoding": "greedy", "max_new_tokens": args.max_new_tokens,
        "caption_examples": cap_examples, "vqa_examples": q_examples,
        "eval_seconds": round(eval_s, 1),
    }
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(result, f, indent=2)

    info = {
        "seed": args.seed, "steps": step, "batch": args.batch, "processes": world, "lr": args.lr,
        "compiled": args.compile, "packed": args.pack,
        "min_lr_ratio": args.min_lr_ratio, "warmup": args.warmup,
        "weight_decay": args.weight_decay, "caption_frac": None if args.pack else args.caption_frac,
        "minutes": args.minutes, "budget_seconds": round(budget, 1),
        "train_seconds": round(train_s, 1), "wall_seconds": round(time.time() - T_START, 1),
        "preset": args.preset, "final_loss": last_loss, "loss_log": recent[-20:],
        "loss_curve": curve,  # [step, mean loss since the previous entry], every --log-every steps
        "params": n_params, "safetensors_bytes": st_bytes,
        "train_set": {"dir": os.path.abspath(args.train), "images": len(tr_images),
                      "captions": sum(map(len, tr_caps)), "questions": len(tr_qs),
                      "seed": tr_info.get("seed"), "info": tr_info},
        "heldout_set": {"dir": os.path.abspath(args.heldout), "images": len(ho_images),
                        "questions": len(ho_qs), "seed": ho_info.get("seed"), "info": ho_info},
        "samples": {"caption": table.n_caption, "vqa": table.n_vqa, "max_len": table.max_len},
        "tokenizer": {"sp_vocab": sp_vocab, "image_token_index": image_token_index,
                      "text_vocab_size": text_vocab, "tokenizer_json": tok_json,
                      "hf_tokenizer_check": tok_check},
        "prompt_template": PROMPT_TEMPLATE, "caption_prompt": CAPTION_PROMPT,
        "n_visual": N_VISUAL, "device": _device_name(torch, device),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "config": json.loads(config.to_json_string()),
        "eval": {k: result[k] for k in ("caption_exact_any", "caption_exact_canonical",
                                        "vqa_accuracy", "train_caption_exact_canonical")},
    }
    with open(os.path.join(args.out, "train_info.json"), "w") as f:
        json.dump(info, f, indent=2)

    rows = [
        ("params", f"{n_params / 1e6:.2f} M"),
        ("safetensors", f"{st_bytes / 2**20:.1f} MiB"),
        ("steps", f"{step} x batch {args.batch} ({world} process{'es' if world > 1 else ''})"),
        ("train time", f"{train_s:.1f} s"),
        ("wall time", f"{time.time() - T_START:.1f} s"),
        ("final loss", f"{last_loss:.4f}"),
        ("caption exact (any ref)", f"{100 * cap_any / n_cap_eval:.1f} % of {eval_n}"),
        ("caption exact (canonical)", f"{100 * cap_canon / n_cap_eval:.1f} %"),
        ("train caption exact", "-" if tr_cap is None else f"{100 * tr_cap:.1f} % of {tr_n}"),
        ("VQA exact", f"{100 * q_ok / n_q_eval:.1f} % of {len(ho_eval_qs)}"),
    ] + [(f"  VQA {k}", f"{100 * v[0] / v[1]:.1f} % of {v[1]}") for k, v in sorted(by_type.items())] + [
        ("HF tokenizer check", tok_check[:70]),
    ]
    w = max(len(k) for k, _ in rows)
    print("\n" + "-" * (w + 30))
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print("-" * (w + 30), flush=True)


def _device_name(torch, device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(device)


if __name__ == "__main__":
    sys.exit(main())
