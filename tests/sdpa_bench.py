#!/usr/bin/env python3
"""Decode attention through PyTorch's scaled_dot_product_attention (fp16), the baseline for
`kvlens bench attention`: one query per head against `context` cached rows, 32 heads x 128,
batch 1 and 16. Times are medians of CUDA-event timings after warm-up; small working sets are
rotated among copies so repeated calls are not served from L2. Bytes = K + V + q + out.

Usage (on the GPU host): python3 tests/sdpa_bench.py --json OUT/sdpa.json
"""

import argparse
import json

import torch
import torch.nn.functional as F


def bench(B, n, H, D, reps):
    dev = torch.device("cuda")
    one = 2 * B * H * n * D * 2
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    sets = max(1, min(8, -(-4 * l2 // one)))
    kv = [(torch.randn(B, H, n, D, device=dev, dtype=torch.float16),
           torch.randn(B, H, n, D, device=dev, dtype=torch.float16)) for _ in range(sets)]
    q = torch.randn(B, H, 1, D, device=dev, dtype=torch.float16)
    for i in range(3):
        F.scaled_dot_product_attention(q, *kv[i % sets])
    ms = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        F.scaled_dot_product_attention(q, *kv[i % sets])
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    ms.sort()
    t = ms[len(ms) // 2]
    byts = one + 2 * B * H * D * 2
    return {"batch": B, "context": n, "ms": t, "bytes": byts, "gbs": byts / (t * 1e-3) / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    rows = []
    for B in (1, 16):
        for n in (4096, 16384, 65536):
            r = bench(B, n, 32, 128, a.reps)
            rows.append(r)
            print(f"sdpa fp16  batch {B:3d}  context {n:6d}  {r['ms']:9.4f} ms  {r['gbs']:8.1f} GB/s", flush=True)
            torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
