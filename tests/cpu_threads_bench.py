#!/usr/bin/env python3
"""CPU threads against caption time: kvlens and HF transformers on the same CPU, the same call.

kvlens captions the image once (greedy, to its EOS) for the prompt ids and the number of new
tokens. For each N in --threads, kvlens runs `bench --backend cpu --threads N --max-new-tokens`
that number, with OMP_NUM_THREADS and OPENBLAS_NUM_THREADS set to N as well (whatever the user
sets must not slow it down); then HF transformers (LlavaForConditionalGeneration, eager
attention, fp32) captions the same image from those prompt ids with torch.set_num_threads(N),
greedy, at most that many new tokens (the same ones where the ids agree), median of --repeat
runs after one warm-up. With --rounds R each side runs its whole list of thread counts R times
over (odd rounds walk the list in reverse, so a drift within a round favours no end of it), and a
figure is the median of its R rounds' medians (a shared host's speed drifts within a call). The
rounds' captions are printed in the order the list was given. A table last: vision, prefill and caption ms of kvlens, HF's caption ms, and whether HF's
greedy ids equal kvlens's.

  python3 tests/cpu_threads_bench.py --kvlens build/kvlens [--threads 1 2 4 8 16] [--repeat 10] [--rounds 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "..", "assets", "models", "kvlens-scenes-6m")
DEFAULT_IMAGE = os.path.join(HERE, "..", "assets", "images", "scene_000.png")


def round_order(threads, r):
    """The thread counts of round r: ascending in even rounds, descending in odd ones, so that a
    host whose speed drifts during a round favours no end of the list."""
    return list(threads) if r % 2 == 0 else list(reversed(threads))


def kvlens_run(exe, args, n, n_new, tmp):
    env = dict(os.environ, OMP_NUM_THREADS=str(n), OPENBLAS_NUM_THREADS=str(n))
    out = os.path.join(tmp, "bench_%d.json" % n)
    cmd = [exe, "bench", "--backend", "cpu", "--model", args.model, "--image", args.image,
           "--repeat", str(args.repeat), "--threads", str(n), "--max-new-tokens", str(n_new), "--json", out]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def kvlens_ids(exe, args, tmp):
    out = os.path.join(tmp, "caption.json")
    subprocess.run([exe, "caption", "--backend", "cpu", "--model", args.model, "--image", args.image,
                    "--json", out], check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(out) as f:
        c = json.load(f)
    return c["prompt_ids"], c["generated_ids"]


def hf_times(args, prompt_ids, new_ids, threads):
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    pixels = AutoImageProcessor.from_pretrained(args.model)(
        images=Image.open(args.image).convert("RGB"), return_tensors="pt")["pixel_values"]
    ids = torch.tensor([prompt_ids])
    n_new = len(new_ids)
    rounds = {n: [] for n in threads}
    same = {n: True for n in threads}
    for r in range(args.rounds):
        for n in round_order(threads, r):
            torch.set_num_threads(n)
            ms, out = [], None
            with torch.inference_mode():
                for r in range(args.repeat + 1):
                    t0 = time.perf_counter()
                    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                                         max_new_tokens=n_new, do_sample=False)
                    if r:
                        ms.append(1e3 * (time.perf_counter() - t0))
            rounds[n].append(statistics.median(ms))
            same[n] = same[n] and out[0, ids.shape[1]:].tolist() == list(new_ids)
    return {n: (statistics.median(rounds[n]), same[n], rounds[n]) for n in threads}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kvlens", required=True, help="the kvlens executable")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--image", default=DEFAULT_IMAGE)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1, help="passes over the thread counts; medians of their medians")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prompt_ids, new_ids = kvlens_ids(args.kvlens, args, tmp)
        runs = {n: [] for n in args.threads}
        for r in range(args.rounds):
            for n in round_order(args.threads, r):
                runs[n].append(kvlens_run(args.kvlens, args, n, len(new_ids), tmp))
        keys = ("vision_ms", "prefill_ms", "caption_total_ms")
        kv = {n: dict({k: statistics.median(r[k] for r in runs[n]) for k in keys},
                      caption_rounds=[r["caption_total_ms"] for r in runs[n]]) for n in args.threads}
    hf = hf_times(args, prompt_ids, new_ids, args.threads)
    rows = []
    print("%7s %10s %10s %12s %12s %10s   %s" % ("threads", "vision ms", "prefill ms", "caption ms", "HF caption",
                                                 "HF ids =", "caption / HF caption in each round"))
    for n in args.threads:
        k = kv[n]
        rows.append({"threads": n, "vision_ms": k["vision_ms"], "prefill_ms": k["prefill_ms"],
                     "caption_ms": k["caption_total_ms"], "hf_caption_ms": hf[n][0], "hf_ids_equal": hf[n][1],
                     "caption_ms_rounds": k["caption_rounds"], "hf_caption_ms_rounds": hf[n][2]})
        print("%7d %10.1f %10.1f %12.1f %12.1f %10s   %s / %s" % (
            n, k["vision_ms"], k["prefill_ms"], k["caption_total_ms"], hf[n][0], "yes" if hf[n][1] else "NO",
            " ".join("%.0f" % v for v in k["caption_rounds"]), " ".join("%.0f" % v for v in hf[n][2])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu_count": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0 if all(r["hf_ids_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
