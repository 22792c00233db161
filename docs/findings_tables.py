#!/usr/bin/env python3
"""Prints every table of docs/findings.md from the reports docs/findings.sh wrote to OUT.

    python3 docs/findings_tables.py OUT > OUT/tables.md

Each `kvlens run` report holds the methods in the order of OUT/<set>.specs; every number below
is a mean (or count, or median) over the images of one set, computed from those reports and the
held-out annotations (OUT/heldout/annotations.json).
"""
import functools
import glob
import json
import os
import statistics
import sys
from collections import Counter

OUT = sys.argv[1] if len(sys.argv) > 1 else "out/findings"


def model_shape():
    """Decoder layers, KV heads and head_dim of the model the reports ran (its config.json)."""
    for f in sorted(glob.glob(os.path.join(OUT, "*", "*.json"))):
        r = json.load(open(f))
        if "model" not in r:
            continue
        cfg = json.load(open(os.path.join(r["model"], "config.json")))
        t = cfg.get("text_config", cfg)
        heads = t["num_attention_heads"]
        return t["num_hidden_layers"], t.get("num_key_value_heads") or heads, t.get("head_dim") or t["hidden_size"] // heads
    sys.exit(f"findings_tables.py: no kvlens run report under {OUT}")


L, KH, D = model_shape()  # 4, 8, 32 for the embedded kvlens-scenes-6m
LCOLS = [f"L{l}" for l in range(L)]
LSPAN = f"L0–L{L - 1}"
LSLASH = "/".join(LCOLS)
ROW = KH * (2 * D * 2 + 4)  # fp16 K and V of one token in one layer, plus its int32 positions


def load(name):
    specs = [s.strip() for s in open(os.path.join(OUT, name + ".specs")) if s.strip()]
    reps = []
    for f in sorted(glob.glob(os.path.join(OUT, name, "*.json"))):
        r = json.load(open(f))
        assert len(r["methods"]) == len(specs), f"{f}: {len(r['methods'])} methods, {len(specs)} specs"
        r["by_spec"] = dict(zip(specs, r["methods"]))
        r["image"] = int(os.path.basename(f)[:-5])
        reps.append(r)
    return specs, reps


ANN = json.load(open(os.path.join(OUT, "heldout", "annotations.json")))
CAPTIONS = {}
for a in ANN["annotations"]:
    CAPTIONS.setdefault(a["image_id"], set()).add(a["caption"].strip())
COUNT = {q["image_id"]: q["answer"].strip() for q in ANN["questions"] if q["question"] == "how many shapes are there?"}
OBJECTS = {im["id"]: len(im["objects"]) for im in ANN["images"]}


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def sd(xs):
    xs = list(xs)
    return statistics.pstdev(xs) if len(xs) > 1 else 0.0


def med(xs):
    xs = list(xs)
    return statistics.median(xs) if xs else None


def fmt(x, nd=2):
    if x is None or x != x:
        return "–"
    return f"{x:.{nd}f}"


def table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    print()


def layer_mse(m, l):
    return m["layers"][l]["softmax_mse"]


def exact(rep, m):
    return m["caption"].strip() in CAPTIONS[rep["image"]]


def divergence(reps, spec):
    pos, pf = [], []
    for r in reps:
        d = r["by_spec"][spec]["first_divergence"]
        if d["position"] >= 0:
            pos.append(d["position"])
            pf.append(d["full_prob"])
    return pos, pf


def rows_kept(m):
    """Prompt rows per KV head after prefill: (text, visual), means over layers."""
    text, vis = [], []
    for l in m["layers"]:
        rows = l["bytes"]["indices"] / 4 / KH
        v = sum(l["token_fate"]["kept"])
        vis.append(v)
        text.append(rows - v)
    return mean(text), mean(vis)


# ---- §1 calibration --------------------------------------------------------------------------
def section1():
    specs, reps = load("s1")
    off = "calibquant:bits=1,calibrate=off"
    print(f"### §1 Softmax MSE ×1e-4 per layer, {len(reps)} images, 32 new tokens, 4 diagnostic steps\n")
    rows = []
    for s in specs:
        ms = [mean(layer_mse(r["by_spec"][s], l) for r in reps) for l in range(L)]
        wins = "/".join(str(sum(layer_mse(r["by_spec"][s], l) < layer_mse(r["by_spec"][off], l) for r in reps))
                        for l in range(L)) if s != off else "–"
        rows.append([f"`{s}`"] + [fmt(x * 1e4) for x in ms] + [fmt(mean(ms) * 1e4), wins,
                    fmt(mean(r["by_spec"][s]["mean_attn_output_rel_error"] for r in reps)),
                    f"{sum(r['by_spec'][s]['same_as_full'] for r in reps)}/{len(reps)}"])
    table(["spec"] + LCOLS + ["mean", f"wins vs off ({LSLASH})", "attn-out", "= full"], rows)
    grid = [f"calibquant:bits=1,tau1={a},tau2={b}" for a in range(4) for b in range(4)]
    arg = Counter()
    for r in reps:
        best = min(grid, key=lambda s: r["by_spec"][s]["mean_softmax_mse"])
        arg[best.split(",", 1)[1]] += 1
    print("Per-image argmin of the mean MSE over the {0..3}² grid: " +
          ", ".join(f"{k} on {v}" for k, v in arg.most_common()) + ".\n")
    t2 = [f"calibquant:bits=1,tau1=0,tau2={b}" for b in (0, 1, 2, 3, 4, 5, 6, 8)]
    best = []
    for l in range(L):
        b = min(t2, key=lambda s: mean(layer_mse(r["by_spec"][s], l) for r in reps))
        best.append(b.rsplit("=", 1)[1])
    print(f"τ1 = 0: the τ2 of lowest mean MSE per layer ({LSPAN}), τ2 ∈ {{0..6, 8}}: " + " / ".join(best) + ".\n")
    # Histograms: image 0, first decode step, visual keys, every head pooled.
    r0 = next(r for r in reps if r["image"] == 0)

    def moments(h, kind):
        n = len(h[kind])
        w = (h["hi"] - h["lo"]) / n
        centres = [h["lo"] + (i + 0.5) * w for i in range(n)]
        tot = sum(h[kind])
        mu = sum(c * k for c, k in zip(centres, h[kind])) / tot
        var = sum(k * (c - mu) ** 2 for c, k in zip(centres, h[kind])) / tot
        acc, p95 = 0, centres[-1]
        for c, k in zip(centres, h[kind]):
            acc += k
            if acc >= 0.95 * tot:
                p95 = c
                break
        nz = [i for i, k in enumerate(h[kind]) if k]
        return (h["lo"] + nz[0] * w, h["lo"] + (nz[-1] + 1) * w), mu, var ** 0.5, p95

    print("### §1 Score histograms, image 000000, layer 1, first decode step, visual keys of all heads "
          "(40 shared bins; moments from bin centres)\n")
    rows = []
    for s, label in (("calibquant:bits=1,tau1=0,tau2=3", "bits=1 default"), ("calibquant:preset=official", "official (shrink)")):
        h = r0["by_spec"][s]["layers"][1]["visual_score_histogram"]
        m = {k: moments(h, k) for k in ("exact", "quantized", "calibrated")}
        rows.append([f"{label}: range"] + [f"[{fmt(m[k][0][0], 1)}, {fmt(m[k][0][1], 1)}]" for k in m])
        rows.append(["mean / sd / p95"] + [f"{fmt(m[k][1])} / {fmt(m[k][2])} / {fmt(m[k][3])}" for k in m])
    table(["layer 1, spec", "exact", "quantized (q·k̂)", "calibrated"], rows)
    rows = []
    for s, label in (("calibquant:bits=1,tau1=0,tau2=3", "bits=1 default"), ("calibquant:preset=official", "official")):
        for k in ("exact", "quantized", "calibrated"):
            rows.append([f"{label}, {k}"] + [fmt(moments(r0["by_spec"][s]["layers"][l]["visual_score_histogram"], k)[2])
                                             for l in range(L)])
    table(["sd of the visual scores, image 000000"] + LCOLS, rows)


# ---- §2 CacheHitRate ---------------------------------------------------------------------------
STRATS = ["accumulated", "normalized", "sliding_window", "post_vision", "recency"]


def rate(r, level, strat, step, l):
    hr = r["cache_hit_rate"]
    if step not in hr["steps"]:
        return None
    return hr[level][strat][hr["steps"].index(step)][l]


def section2():
    _, b01 = load("s4")
    _, b02 = load("s2_b02")
    _, w8 = load("s2_w8")
    k1, k2 = b01[0]["cache_hit_rate"]["k"], b02[0]["cache_hit_rate"]["k"]
    for level, name in (("rates", "layer level (VL-Cache: head-mean truth and prediction)"),
                        ("rates_per_kv_head", "per KV head (truth and prediction per head, averaged over heads)")):
        print(f"### §2 CacheHitRate, {name}\n")
        n8 = sum(8 in r["cache_hit_rate"]["steps"] for r in b01)
        print(f"Per layer {LSLASH}; step 0 over {len(b01)} images, step 8 over the {n8} whose caption has more "
              "than 8 tokens. sliding_window: w = 32.\n")
        rows = []
        for s in ("accumulated", "normalized", "recency", "sliding_window", "post_vision"):
            cells = []
            for reps in (b01, b02):
                for step in (0, 8):
                    cells.append(" / ".join(fmt(mean(x for x in (rate(r, level, s, step, l) for r in reps) if x is not None))
                                            for l in range(L)))
            rows.append([s] + cells)
        table(["strategy", f"0.1 (k = {k1}): step 0", "step 8", f"0.2 (k = {k2}): step 0", "step 8"], rows)
        rows = []
        for s in STRATS:
            row = [s]
            for reps in (b01, b02):
                for step in (0, 2, 4, 8):
                    row.append(fmt(mean(mean(rate(r, level, s, step, l) for l in range(L)) for r in reps
                                        if step in r["cache_hit_rate"]["steps"])))
            rows.append(row)
        row = ["sliding_window, w = 8"]
        for step in (0, 2, 4, 8):
            row.append(fmt(mean(mean(rate(r, level, "sliding_window", step, l) for l in range(L)) for r in w8
                                if step in r["cache_hit_rate"]["steps"])))
        rows.append(row + [""] * 4)
        table(["layer mean", "0.1: s=0", "s=2", "s=4", "s=8", f"0.2 (k = {k2}): s=0", "s=2", "s=4", "s=8"], rows)
        rows = []
        for budget, reps in (("0.1", b01), ("0.2", b02)):
            for other in ("accumulated", "normalized", "recency"):
                for step in (0, 2, 4, 8):
                    cells = []
                    for l in range(L):
                        pairs = [(rate(r, level, "post_vision", step, l), rate(r, level, other, step, l)) for r in reps]
                        pairs = [(x, y) for x, y in pairs if x is not None]
                        cells.append(f"{sum(x > y for x, y in pairs)}/{sum(x < y for x, y in pairs)}")
                    rows.append([budget, f"post_vision vs {other}", step] + cells)
        table(["budget", "pair (wins/losses of post_vision)", "step"] + LCOLS, rows)


# ---- §3 ZipCache -------------------------------------------------------------------------------
def main_row(reps, s, scale):
    ms = [mean(layer_mse(r["by_spec"][s], l) for r in reps) for l in range(L)]
    return [fmt(x * scale, 1) for x in ms] + [fmt(mean(ms) * scale, 2),
            fmt(mean(r["by_spec"][s]["mean_attn_output_rel_error"] for r in reps), 3),
            f"{sum(r['by_spec'][s]['same_as_full'] for r in reps)}/{len(reps)}",
            fmt(mean(r["by_spec"][s]["compression_vs_fp16"] for r in reps))]


def defaults():
    """Each method's canonical spec at its defaults, from the run reports (the methods given by
    their bare name), as {method: {param: value}}."""
    out = {}
    for f in glob.glob(os.path.join(OUT, "s4", "*.json"))[:1]:
        for m in json.load(open(f))["methods"]:
            if ":" not in m["short_spec"]:
                out[m["method"]] = dict(kv.split("=", 1) for kv in m["spec"].split(":", 1)[1].split(","))
    return out


def short(canonical):
    """A canonical spec with the values equal to the method's defaults left out."""
    name, _, rest = canonical.partition(":")
    d = defaults().get(name)
    if not rest or d is None:
        return canonical
    kept = [kv for kv in rest.split(",") if d.get(kv.split("=", 1)[0]) != kv.split("=", 1)[1]]
    return name + (":" + ",".join(kept) if kept else "")


@functools.lru_cache(maxsize=None)
def eval_table(name):
    """The `kvlens eval --json` table OUT/name.json, read once (None when absent)."""
    p = os.path.join(OUT, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None


def evals(name):
    """`kvlens eval --json` table: canonical spec -> caption exact-match share and VQA accuracy."""
    t = eval_table(name)
    if t is None:
        return {}
    return {r["spec"]: {"caption_accuracy": r["caption_exact"] / t["images"], "vqa_accuracy": r["VQA"]} for r in t["rows"]}


def eval_images(name, dflt):
    """How many images the `kvlens eval --json` table `name` ran on (dflt when it is absent)."""
    t = eval_table(name)
    return dflt if t is None else t["images"]


def eval_of(ev, canonical_prefix):
    """The eval entry whose canonical spec is `canonical_prefix` (the full spec string)."""
    return ev.get(canonical_prefix)


def section3():
    specs, reps = load("s3")
    print(f"### §3 ZipCache, {len(reps)} images, 40 new tokens (defaults: 4/2 bits, r = 0.4, random+recent probes, "
          "per-layer subsets, token ranges over all heads)\n")
    rows = [[f"`{s}`"] + main_row(reps, s, 1e5) for s in specs]
    table(["spec"] + LCOLS + ["MSE ×1e-5 mean", "attn-out", "= full", "×fp16"], rows)
    for a, b in (("zipcache", "zipcache:saliency=accumulated"), ("zipcache:probe=all", "zipcache:probe=all,saliency=accumulated"),
                 ("zipcache:low_bits=1", "zipcache:low_bits=1,saliency=accumulated"),
                 ("zipcache:low_bits=1,probe=all", "zipcache:low_bits=1,probe=all,saliency=accumulated")):
        w = sum(r["by_spec"][a]["mean_softmax_mse"] < r["by_spec"][b]["mean_softmax_mse"] for r in reps)
        print(f"- normalized lower mean MSE than accumulated on {w}/{len(reps)} images: `{a}` vs `{b}`")
    print()
    for a, b in (("zipcache", "zipcache:ranges=segment,value_token_range=head"),
                 ("zipcache:low_bits=1", "zipcache:low_bits=1,ranges=segment,value_token_range=head")):
        w = sum(r["by_spec"][a]["mean_softmax_mse"] < r["by_spec"][b]["mean_softmax_mse"] for r in reps)
        print(f"- `{a}` lower mean MSE than `{b}` on {w}/{len(reps)} images")
    print()
    specs, reps = load("s3_stream")
    print(f"### §3 ZipCache streaming, {len(reps)} images, 40 new tokens, MSE over 16 decode steps\n")
    rows = []
    for s in specs:
        fin = [r["by_spec"][s]["bytes_final"]["total"] for r in reps]
        dense = [r["full"]["bytes_fp16"]["total"] + L * ROW * (len(r["by_spec"][s]["generated_ids"]) - 1) for r in reps]
        gen = [len(r["by_spec"][s]["generated_ids"]) - 1 for r in reps]
        pos, _ = divergence(reps, s)
        rows.append([f"`{s}`", fmt(mean(gen), 1), f"{mean(r['by_spec'][s]['bytes_after_prefill']['total'] for r in reps):.0f}",
                     f"{mean(fin):.0f}", fmt(mean(d / f for d, f in zip(dense, fin))),
                     fmt(mean(r["by_spec"][s]["mean_softmax_mse"] for r in reps) * 1e5),
                     f"{sum(r['by_spec'][s]['same_as_full'] for r in reps)}/{len(reps)}", fmt(med(pos), 1)])
    table(["spec", "tokens appended", "bytes after prefill", "bytes final", "×fp16 final", "MSE ×1e-5 (16 steps)",
           "= full", "median div pos"], rows)


# ---- §4 bytes against caption agreement ------------------------------------------------------
def section4():
    specs, reps = load("s4")
    ec, ev = evals("eval_captions"), evals("eval_vqa")
    full_eval = ec.get("full")
    nc, nv = eval_images("eval_captions", 100), eval_images("eval_vqa", 30)
    print(f"### §4 Bytes and caption agreement, {len(reps)} images, 40 new tokens; eval: {nc} images (captions), "
          f"{nv} images (VQA)\n")
    print(f"Full cache (fp16 rows): exact caption on {sum(exact(r, {'caption': r['full']['caption']}) for r in reps)}"
          f"/{len(reps)} run images; eval exact {fmt(100 * full_eval['caption_accuracy'], 0) if full_eval else '–'} %, "
          f"VQA {fmt(100 * ev['full']['vqa_accuracy'], 1) if 'full' in ev else '–'} %.\n")
    rows = []
    for s in specs:
        m0 = reps[0]["by_spec"][s]
        canon = m0["spec"]
        pos, pf = divergence(reps, s)
        e1, e2 = ec.get(canon), ev.get(canon)
        rows.append([f"`{s}`", f"{mean(r['by_spec'][s]['bytes_after_prefill']['total'] for r in reps):.0f}",
                     fmt(mean(r["by_spec"][s]["compression_vs_fp16"] for r in reps)),
                     f"{mean(r['by_spec'][s]['mean_softmax_mse'] for r in reps):.1e}",
                     fmt(mean(r["by_spec"][s]["mean_attn_output_rel_error"] for r in reps), 3),
                     sum(r["by_spec"][s]["same_as_full"] for r in reps), sum(exact(r, r["by_spec"][s]) for r in reps),
                     f"{fmt(100 * e1['caption_accuracy'], 0)} %" if e1 else "", f"{fmt(100 * e2['vqa_accuracy'], 1)} %" if e2 else "",
                     fmt(med(pos), 1), fmt(mean(pf)) if pf else "–"])
    table(["spec", "KV bytes", "×fp16", "softmax MSE", "attn-out", f"= full ({len(reps)})", f"exact ({len(reps)})",
           f"eval exact ({nc})", f"VQA ({nv} img)", "div pos", "p_full@div"], rows)
    ex = {canon: e for canon, e in ec.items()}
    extra = [k for k in ex if k not in {reps[0]["by_spec"][s]["spec"] for s in specs} and k != "full"]
    if extra:
        table([f"eval only ({nc} images)", "exact"], [[f"`{short(k)}`", f"{fmt(100 * ex[k]['caption_accuracy'], 0)} %"] for k in extra])
    evextra = [k for k in ev if k not in {reps[0]["by_spec"][s]["spec"] for s in specs} and k != "full"]
    if evextra:
        table([f"VQA only ({nv} images)", "VQA"], [[f"`{short(k)}`", f"{fmt(100 * ev[k]['vqa_accuracy'], 1)} %"] for k in evextra])
    # Exact captions by the number of shapes in the image.
    rows = []
    bins = ((1, 2), (3, 4)) if max(OBJECTS.values()) <= 4 else ((1, 5), (6, 9), (10, 99))  # classic / rich scenes
    for s in ("full", "calibquant:bits=1", "calibquant:bits=2", "zipcache", "lookm", "vlcache"):
        cells = []
        for lo, hi in bins:
            sel = [r for r in reps if lo <= OBJECTS[r["image"]] <= hi]
            cells.append(f"{sum(exact(r, r['by_spec'][s]) for r in sel)}/{len(sel)}")
        rows.append([f"`{s}`"] + cells)
    table(["exact captions by objects in the image"] + [f"{lo}–{hi} objects" if hi < 99 else f"{lo}+ objects" for lo, hi in bins], rows)
    # Where the bytes go: per layer sums of the first image's reports.
    r0 = reps[0]
    rows = []
    for s in ("full:storage=fp32", "full", "calibquant:bits=1", "kivi", "zipcache", "vlcache", "stack"):
        b = {k: sum(l["bytes"][k] for l in r0["by_spec"][s]["layers"]) for k in ("codes", "scales", "zeros", "indices", "meta", "total")}
        rows.append([f"`{s}`"] + [b[k] for k in ("codes", "scales", "zeros", "indices", "meta", "total")])
    table([f"bytes of image {r0['image']:06d} (all layers)", "codes", "scales", "zeros", "indices", "meta", "total"], rows)


def vl_grid(name, prompt, count):
    specs, reps = load(name)
    print(f"### §4 VL-Cache budget × recent window, {prompt}, {len(reps)} images\n")
    print("Divergence positions count generated tokens; position 0 comes from the exact prefill logits and "
          "cannot diverge, so position 1 is the earliest possible.\n")
    rows = []
    for s in specs:
        pos, _ = divergence(reps, s)
        text, vis = zip(*(rows_kept(r["by_spec"][s]) for r in reps))
        cells = [f"`{s}`", sum(r["by_spec"][s]["same_as_full"] for r in reps), sum(p == 1 for p in pos), fmt(med(pos), 1)]
        if count:
            cells.append(sum(r["by_spec"][s]["caption"].strip() == COUNT[r["image"]] for r in reps))
        cells += [fmt(mean(text), 1), fmt(mean(vis), 1)]
        rows.append(cells)
    hdr = ["spec", "= full", "diverge @1", "median div pos"] + (["answer correct"] if count else []) + \
          ["text rows kept / head", "visual rows kept / head"]
    n_text = len(reps[0]["prompt_ids"]) - reps[0]["n_visual_tokens"]
    print(f"The prompt has {len(reps[0]['prompt_ids'])} tokens, {n_text} of them text."
          + (f" Full cache: answer correct on {sum(r['full']['caption'].strip() == COUNT[r['image']] for r in reps)}"
             f"/{len(reps)}." if count else "") + "\n")
    table(hdr, rows)


def section4_lookm():
    specs, reps = load("s4_lookm")
    print(f"### §4 LOOK-M merges as printed (paper) and as coded (official), {len(reps)} images\n")
    rows = []
    for s in specs:
        pos, _ = divergence(reps, s)
        merged = mean(mean(x for l in r["by_spec"][s]["layers"] for x in l["token_fate"]["merged"] if x > 0) or 0
                      for r in reps if any(x > 0 for l in r["by_spec"][s]["layers"] for x in l["token_fate"]["merged"]))
        rows.append([f"`{s}`", sum(r["by_spec"][s]["same_as_full"] for r in reps),
                     f"{mean(r['by_spec'][s]['mean_softmax_mse'] for r in reps):.2e}",
                     fmt(mean(r["by_spec"][s]["mean_attn_output_rel_error"] for r in reps), 3), fmt(med(pos), 1),
                     fmt(merged, 1)])
    table(["spec", "= full", "softmax MSE", "attn-out", "median div pos", "rows merged into a merged visual row"], rows)


# ---- §5 sparsity --------------------------------------------------------------------------------
def section5():
    _, s4 = load("s4")
    _, p0001 = load("s5_p0001")
    _, p01 = load("s5_p01")
    print("### §5 Sparsity γ(l) of the full cache (share of attention entries < p · row max, mean over heads; "
          "mean ± sd over images)\n")
    rows = []
    for p, reps in (("0.001", p0001), ("0.01", s4), ("0.1", p01)):
        for phase in ("prefill", "decode"):
            rows.append([p, phase, len(reps)] + [f"{fmt(mean(r['full']['sparsity_' + phase][l] for r in reps))} ± "
                                                 f"{fmt(sd(r['full']['sparsity_' + phase][l] for r in reps))}" for l in range(L)])
    table(["p", "phase", "images"] + LCOLS, rows)
    rows = []
    for s in ("vlcache", "vlcache:budget=0.2", "h2o", "pyramidkv"):
        rows.append([f"`{s}`"] + [fmt(mean(r["by_spec"][s]["layers"][l]["bytes"]["indices"] / 4 / KH for r in s4), 1)
                                  for l in range(L)])
    table(["rows kept per KV head"] + LCOLS, rows)


if __name__ == "__main__":
    print(f"<!-- generated by docs/findings_tables.py from {OUT} -->\n")
    section1()
    section2()
    section3()
    section4()
    vl_grid("s4_vl_caption", "prompt \"Describe the image.\", 40 new tokens", False)
    if os.path.isdir(os.path.join(OUT, "s4_vl_count")):  # classic scenes only (findings.sh)
        vl_grid("s4_vl_count", "prompt \"how many shapes are there?\", 10 new tokens", True)
    section4_lookm()
    section5()
