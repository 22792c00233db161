#!/usr/bin/env python3
"""Per-kernel device time from ncu's CSV (`ncu --csv --print-units base --metrics
gpu__time_duration.sum ...`): each kernel's launches, median and total µs, largest total first.
tests/gpu_check.sh's `kernels` stage writes one CSV a method and reads them back with this.

  python3 tests/ncu_kernels.py FILE.csv [--top N] [--by-grid] [--json OUT.json]
  python3 tests/ncu_kernels.py --self-test   (a made-up CSV read back: exit 1 on a wrong figure)
"""

import argparse
import csv
import json
import os
import re
import statistics
import sys
import tempfile


def kernel_times(path, by_grid=False):
    """{kernel: [µs, ...]} in launch order, from the CSV's rows of gpu__time_duration.sum; with
    by_grid each grid size of a kernel apart (a prompt's launches from a decode's, say)."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # (ncu's own ==PROF== lines are not CSV)
    rows = csv.reader(lines)
    header = next(rows, None)
    if not header or "Kernel Name" not in header or "Metric Value" not in header:
        raise SystemExit(f"{path}: no ncu CSV header with 'Kernel Name' and 'Metric Value'")
    name_at, metric_at, unit_at, value_at = (header.index(k) for k in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value"))
    grid_at = header.index("Grid Size") if "Grid Size" in header else None
    scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "nsecond": 1e-3}
    times = {}
    for r in rows:
        if len(r) <= value_at or r[metric_at] != "gpu__time_duration.sum":
            continue
        unit = r[unit_at].strip()
        if unit not in scale:
            raise SystemExit(f"{path}: unit {unit!r} of gpu__time_duration.sum (expected one of {sorted(scale)})")
        name = re.sub(r"^<?unnamed>::|\(anonymous namespace\)::", "", r[name_at].replace("void ", "", 1).strip())
        name = re.sub(r"\(.*", "", name).strip()
        if by_grid and grid_at is not None:
            name += " " + r[grid_at].replace(" ", "")
        times.setdefault(name, []).append(float(r[value_at].replace(",", "")) * scale[unit])
    return times


def self_test():
    """A CSV as ncu writes it (its ==PROF== lines, thousands separators, ns and us units, an
    anonymous namespace, a template's arguments, another metric) read back."""
    head = '"ID","Kernel Name","Grid Size","Metric Name","Metric Unit","Metric Value"\n'
    rows = [
        ("0", "(anonymous namespace)::zip_pack_kernel(ZipQuantArgs)", "(64, 1, 1)", "gpu__time_duration.sum", "ns", "18,688"),
        ("1", "<unnamed>::zip_pack_kernel(ZipQuantArgs)", "(512, 1, 1)", "gpu__time_duration.sum", "ns", "1,312"),
        ("2", "void decode_mix_kernel<16, 0, 2>(DecodeParams)", "(11, 32, 1)", "gpu__time_duration.sum", "us", "23.5"),
        ("3", "void decode_mix_kernel<16, 0, 2>(DecodeParams)", "(11, 32, 1)", "gpu__time_duration.sum", "ns", "22,500"),
        ("4", "void decode_mix_kernel<16, 0, 2>(DecodeParams)", "(11, 32, 1)", "dram__bytes.sum", "byte", "9,000"),
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
        f.write("==PROF== Connected to process 1\n" + head)
        for r in rows:
            f.write(",".join(f'"{x}"' for x in r) + "\n")
        path = f.name
    try:
        got, by_grid = kernel_times(path), kernel_times(path, by_grid=True)
    finally:
        os.unlink(path)
    want = {"zip_pack_kernel": [18.688, 1.312], "decode_mix_kernel<16, 0, 2>": [23.5, 22.5]}
    want_grid = {"zip_pack_kernel (64,1,1)": [18.688], "zip_pack_kernel (512,1,1)": [1.312],
                 "decode_mix_kernel<16, 0, 2> (11,32,1)": [23.5, 22.5]}
    ok = True
    for what, g, w in (("by kernel", got, want), ("by grid", by_grid, want_grid)):
        if g.keys() != w.keys() or any(abs(a - b) > 1e-9 for k in w for a, b in zip(g[k], w[k])) or \
                any(len(g[k]) != len(w[k]) for k in w):
            print(f"self-test {what}: got {g}, want {w}")
            ok = False
    print("self-test", "passed" if ok else "FAILED")
    return 0 if ok else 1


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20, help="kernels shown (largest total first)")
    ap.add_argument("--by-grid", action="store_true", help="each grid size of a kernel on a row of its own")
    ap.add_argument("--json", help="also write {kernel: {launches, median_us, total_us}} here")
    a = ap.parse_args()
    times = kernel_times(a.csv, a.by_grid)
    rows = sorted(((k, len(v), statistics.median(v), sum(v)) for k, v in times.items()), key=lambda x: -x[3])
    total = sum(r[3] for r in rows)
    print(f"{a.csv}: {sum(r[1] for r in rows)} launches, {total:.1f} µs")
    print(f"{'kernel':<48}{'launches':>9}{'median µs':>11}{'total µs':>11}{'share':>8}")
    for k, n, med, tot in rows[: a.top]:
        print(f"{k[:47]:<48}{n:>9}{med:>11.2f}{tot:>11.1f}{100 * tot / total if total else 0:>7.1f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: {"launches": n, "median_us": med, "total_us": tot} for k, n, med, tot in rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
