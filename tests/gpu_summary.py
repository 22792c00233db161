#!/usr/bin/env python3
"""The short table tests/gpu_check.sh prints last, from the JSON and logs in its output folder."""

import json
import os
import re
import sys


def load(d, name):
    try:
        with open(os.path.join(d, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "gpu_out"
    gpu = open(os.path.join(d, "gpu.txt")).read().strip().splitlines() if os.path.exists(os.path.join(d, "gpu.txt")) else []
    print("\n==== kvlens GPU check ====")
    if len(gpu) > 1:
        print("GPU:", gpu[1])
    ct = os.path.join(d, "ctest.txt")
    if os.path.exists(ct):
        t = open(ct).read()
        m = re.search(r"(\d+)% tests passed(?:, (\d+) tests failed)? out of (\d+)", t)
        skipped = len({a or b for a, b in re.findall(r"#\d+: (\S+) \.*\s*\*\*\*Skipped|\d+ - (\S+) \(Skipped\)", t)})
        print("tests:", m.group(0) if m else "no ctest summary", f"({skipped} skipped)")
        for line in t.splitlines():
            if "***Failed" in line or "(Failed)" in line:
                print("  FAILED", line.strip())
    e = load(d, "bench_embedded.json")
    s7 = load(d, "bench_7b.json")
    hf = load(d, "hf_bench.json")
    print(f"\n{'model':<24}{'vision ms':>10}{'prefill ms':>11}{'decode tok/s':>13}{'roofline':>10}{'share':>8}")
    s7u = load(d, "bench_7b_unchained.json")
    for name, b in (("embedded 6M (cuda)", e), ("LLaVA-7B shape (cuda)", s7), ("7B, steps unchained", s7u)):
        if b:
            print(f"{name:<24}{b['vision_ms']:>10.2f}{b['prefill_ms']:>11.2f}{b['decode_tokens_per_s']:>13.1f}"
                  f"{b['roofline_tokens_per_s']:>10.1f}{100 * b['share_of_roofline']:>7.1f}%")
    if hf and "hf" in hf:
        h = hf["hf"]
        print(f"{'HF 7B shape generate()':<24}{'':>10}{h['prefill_ms']:>11.2f}{h['generate_tokens_per_s']:>13.1f}"
              f"   (cached loop {h['loop_tokens_per_s']:.1f} tok/s, {h['attn_implementation']})")
    if s7:
        print(f"7B: prompt {s7['prompt_tokens']} tokens, copy {s7['copy_bandwidth_gbs']:.0f} GB/s, "
              f"weights {s7['lm_weight_bytes'] / 1e9:.2f} GB/token, vision+prefill {s7['vision_ms'] + s7['prefill_ms']:.1f} ms")
    methods = sorted(f for f in os.listdir(d) if f.startswith("bench_7b_method_") and f.endswith(".json"))
    if methods:
        print(f"\n7B shape by method: {'method':<26}{'compress ms':>12}{'decode tok/s':>13}{'share':>8}")
        for f in methods:
            b = load(d, f)
            if b:
                print(f"{'':<20}{f[len('bench_7b_method_'):-5]:<26}{b['compress_ms']:>12.1f}"
                      f"{b['decode_tokens_per_s']:>13.1f}{100 * b['share_of_roofline']:>7.1f}%")
    for suffix, how in (("", "each call timed alone on a held stream"), ("_b2b", "calls back to back")):
        a = load(d, f"bench_attention{suffix}.json")
        sd = load(d, f"sdpa{suffix}.json")
        if not a:
            continue
        sdpa = {(r["batch"], r["context"]): r for r in (sd or {}).get("rows", [])}
        floor = f", an empty kernel {a['empty_kernel_ms']:.4f} ms" if "empty_kernel_ms" in a else ""
        print(f"\ndecode attention 32x128, {how} (copy {a['copy_bandwidth_gbs']:.0f} GB/s{floor}): "
              "ms / share of copy / speed-up vs fp16")
        formats = ("fp16", "q4", "q2", "q1", "q2+calib", "q1+calib")
        print(f"{'batch':>5}{'context':>8}{'sdpa fp16':>11}" + "".join(f"{f:>20}" for f in formats))
        keys = sorted({(r["batch"], r["context"]) for r in a["rows"]})
        for k in keys:
            row = f"{k[0]:>5}{k[1]:>8}"
            s = sdpa.get(k)
            row += f"{s['ms']:>11.4f}" if s else f"{'-':>11}"
            for f in formats:
                r = next((r for r in a["rows"] if (r["batch"], r["context"]) == k and r["format"] == f), None)
                row += f"{r['ms']:>9.4f} {100 * r['share_of_copy']:>4.0f}% {r['speedup_vs_fp16']:>4.1f}x" if r else f"{'-':>20}"
            print(row)
    pf = load(d, "bench_prefill.json")
    if pf:
        print("\nprefill / vision attention alone (us a call, from a graph; TFLOP/s; ms for all layers)")
        for r in pf["rows"]:
            split = r["key_split"] or "auto"
            print(f"{r['part']:>7} T={r['tokens']:<5} split {split!s:<4} ran {r['key_split_used']} "
                  f"{r['graph_us']:>8.2f} us (eager {r['eager_us']:.2f}) {r['tflops']:>6.1f} TFLOP/s "
                  f"{r['graph_us'] * r['layers'] / 1e3:>7.3f} ms")
    t = load(d, "bench_throughput.json")
    if t:
        print(f"\nthroughput, {t['visual_tokens']} visual tokens (tokens/s, batch): KV budget GB")
        budgets = sorted({r["budget_gb"] for r in t["rows"]})
        fmts = [f for f in ("fp16", "q2", "q1") if any(r["format"] == f for r in t["rows"])]
        print(f"{'budget':>7}" + "".join(f"{f:>22}" for f in fmts) + f"{'q1 / fp16':>11}")
        for b in budgets:
            row, base, q1 = f"{b:>7.0f}", None, None
            for f in fmts:
                r = next((r for r in t["rows"] if r["budget_gb"] == b and r["format"] == f), None)
                if r:
                    row += f"{r['tokens_per_s']:>14.1f} (B={r['batch']:>3})"
                    base = r["tokens_per_s"] if f == "fp16" else base
                    q1 = r["tokens_per_s"] if f == "q1" else q1
            row += f"{q1 / base:>10.2f}x" if base and q1 else f"{'-':>11}"
            print(row)
    for name, model in (("cpu_threads.json", "kvlens-scenes-6m"), ("cpu_threads_14m.json", "kvlens-scenes-14m")):
        ct = load(d, name)
        if not ct:
            continue
        print(f"\nCPU caption of {model} by threads ({ct['cpu_count']} cores; ms, kvlens against HF transformers)")
        print(f"{'threads':>7}{'vision':>8}{'prefill':>9}{'caption':>9}{'HF':>8}  HF ids equal  caption in each round")
        for r in ct["rows"]:
            rounds = " ".join("%.0f" % v for v in r.get("caption_ms_rounds", []))
            print(f"{r['threads']:>7}{r['vision_ms']:>8.1f}{r['prefill_ms']:>9.1f}{r['caption_ms']:>9.1f}"
                  f"{r['hf_caption_ms']:>8.1f}  {('yes' if r['hf_ids_equal'] else 'NO'):<12}  {rounds}")
    for f in sorted(f for f in os.listdir(d) if f.startswith("kernels_7b_") and f.endswith(".json")):
        k = load(d, f)
        if not k:
            continue
        total = sum(r["total_us"] for r in k.values())
        print(f"\nkernels of a 7B bench (vision, prefills, two 20-token decodes), {f[len('kernels_7b_'):-5]} "
              f"(ncu, serialized; {total / 1e3:.1f} ms in all): launches, median µs, share")
        for name, r in sorted(k.items(), key=lambda x: -x[1]["total_us"])[:8]:
            print(f"  {name[:52]:<52}{r['launches']:>7}{r['median_us']:>10.2f}{100 * r['total_us'] / total:>7.1f}%")
    steps = os.path.join(d, "steps.log")
    if os.path.exists(steps):
        bad = [l.strip() for l in open(steps) if re.search(r"exit [1-9]", l)]
        if bad:
            print("\nsteps that failed:", "; ".join(bad))


if __name__ == "__main__":
    main()
