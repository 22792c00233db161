#!/usr/bin/env python3
"""Decode attention through PyTorch's scaled_dot_product_attention (fp16), the baseline for
`kvlens bench attention`: one query per head against `context` cached rows, 32 heads x 128,
batch 1 and 16. Time per call as `kvlens bench attention` takes it: by default the median of
`reps` calls each timed alone by CUDA events around it, behind a short spin kernel that holds
the stream while the call is enqueued (so Python's dispatch is not timed; --host-paced leaves the
stream idle instead); with --back-to-back, `reps` calls in a
row, replayed from one CUDA graph so Python's dispatch does not pace them (median of 5 runs,
divided by reps). Small working sets are rotated among copies so repeated calls are not served
from L2. Bytes = K + V + q + out.

Usage (on the GPU host): python3 tests/sdpa_bench.py --json OUT/sdpa.json
"""

import argparse
import json

import torch
import torch.nn.functional as F


def bench(B, n, H, D, reps, back_to_back, host_paced):
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
    if not back_to_back:
        khz = getattr(torch.cuda.get_device_properties(dev), "clock_rate", 2_000_000)  # SM clock, kHz
        hold = int(khz * 2)  # cycles in 2 ms
        for i in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if not host_paced:
                torch.cuda._sleep(hold)
            a.record()
            F.scaled_dot_product_attention(q, *kv[i % sets])
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
    else:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up on the capture stream
            for i in range(3):
                F.scaled_dot_product_attention(q, *kv[i % sets])
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(reps):
                F.scaled_dot_product_attention(q, *kv[i % sets])
        g.replay()
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b) / reps)
        del g
    ms.sort()
    t = ms[len(ms) // 2]
    byts = one + 2 * B * H * D * 2
    return {"batch": B, "context": n, "ms": t, "bytes": byts, "gbs": byts / (t * 1e-3) / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--back-to-back", action="store_true", help="time calls in a row (replayed from a CUDA graph)")
    ap.add_argument("--host-paced", action="store_true",
                    help="time each call alone on an idle stream (Python's dispatch and the launch included)")
    a = ap.parse_args()
    rows = []
    for B in (1, 16):
        for n in (4096, 16384, 65536):
            r = bench(B, n, 32, 128, a.reps, a.back_to_back, a.host_paced)
            rows.append(r)
            print(f"sdpa fp16  batch {B:3d}  context {n:6d}  {r['ms']:9.4f} ms  {r['gbs']:8.1f} GB/s", flush=True)
            torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "timing": "back_to_back" if a.back_to_back else "isolated_host_paced" if a.host_paced else "isolated", "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
