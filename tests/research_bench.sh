#!/usr/bin/env bash
# On a GPU host, in one call: the research path at LLaVA-1.5-7B's shape (tests/make_llava7b.py's
# random fp16 checkpoint, 616-token prompt). `kvlens bench` gives the bench path and the research
# path's prefill with capture and its memory; `kvlens run` per method (every diagnostic, 32 new
# tokens) gives the wall time, the report's timings and the peak host memory, and `kvlens bench
# --method M` the method's decode on the bench path (the table's "of bench": the research path's
# decode tokens/s as a share of it). With
# KVLENS_BASE_BUILD=DIR the same runs with that build's kvlens too (a before/after in one call).
# Then `kvlens bench session` times the app's loop on the same methods (with each build).
# Logs and JSON go to $KVLENS_GPU_OUT (./gpu_out); a short table is printed last.
#
#   tests/research_bench.sh [METHOD ...]      default: snapkv calibquant:bits=1 lookm
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${KVLENS_GPU_OUT:-$PWD/gpu_out}
BUILD=${KVLENS_GPU_BUILD:-build-gpu}
CK=${KVLENS_7B_DIR:-/tmp/kvlens-llava7b}
IMG=${KVLENS_IMAGE:-$PWD/assets/images/scene_000.png}
METHODS=${*:-snapkv calibquant:bits=1 lookm}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/research_gpu.txt" 2>&1

if [ ! -x "$BUILD/kvlens" ]; then
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKVLENS_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DKVLENS_TESTS=OFF -DKVLENS_GUI=OFF > "$OUT/research_cmake.txt" 2>&1 &&
    cmake --build "$BUILD" -j"$(nproc)" --target kvlens > "$OUT/research_build.txt" 2>&1 ||
    { tail -30 "$OUT/research_build.txt"; exit 1; }
fi
if [ ! -f "$CK/config.json" ]; then
  python3 tests/make_llava7b.py --out "$CK" --json "$OUT/llava7b.json" --no-hf-bench > "$OUT/make_llava7b.txt" 2>&1 ||
    { tail -30 "$OUT/make_llava7b.txt"; exit 1; }
fi
PROMPT=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['prompt'])" "$OUT/llava7b.json" 2>/dev/null)
PROMPT=${PROMPT:-Describe the image.}

# Runs a command, then writes its wall time (s) and the peak resident memory of the process (kB).
measure() {
  local tag=$1; shift
  python3 - "$OUT/$tag" "$@" <<'PY'
import resource, subprocess, sys, time
out = sys.argv[1]
t = time.time()
with open(out + ".txt", "w") as f:
    rc = subprocess.run(sys.argv[2:], stdout=f, stderr=subprocess.STDOUT).returncode
wall = time.time() - t
with open(out + ".time", "w") as f:
    f.write("%d %.3f %d\n" % (rc, wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
PY
}

for bin in "$BUILD/kvlens" ${KVLENS_BASE_BUILD:+"$KVLENS_BASE_BUILD/kvlens"}; do
  tag=$(basename "$(dirname "$bin")")
  measure "bench_$tag" "$bin" bench --backend cuda --model "$CK" --image "$IMG" --prompt "$PROMPT" --repeat 3 --json "$OUT/bench_$tag.json"
  for m in $METHODS; do
    safe=$(echo "$m" | tr -c 'A-Za-z0-9_\n' '_')
    measure "run_${tag}_$safe" "$bin" run --backend cuda --model "$CK" --image "$IMG" --prompt "$PROMPT" --max-new-tokens 32 \
      --method "$m" --report "$OUT/run_${tag}_$safe.json"
    # The method on the bench path (this build only): its decode against the research path's.
    if [ "$bin" = "$BUILD/kvlens" ]; then
      "$bin" bench --backend cuda --model "$CK" --image "$IMG" --prompt "$PROMPT" --method "$m" --repeat 3 \
        --json "$OUT/bench_${tag}_$safe.json" > "$OUT/bench_${tag}_$safe.txt" 2>&1
    fi
  done
done

# The app's loop at this shape: the same methods as one session, each method's first number
# parameter edited once (kvlens bench session), with this build and, when given, the base build
# (a base too old for the session command leaves its note); the tables are printed last.
python3 - "$OUT/session.json" "$PROMPT" $METHODS <<'PY'
import json, sys
json.dump({"kvlens_session": 1, "name": "research bench", "prompt": sys.argv[2], "max_new_tokens": 32,
           "methods": sys.argv[3:]}, open(sys.argv[1], "w"))
PY
for bin in "$BUILD/kvlens" ${KVLENS_BASE_BUILD:+"$KVLENS_BASE_BUILD/kvlens"}; do
  tag=$(basename "$(dirname "$bin")")
  "$bin" bench session --backend cuda --model "$CK" --image "$IMG" --session "$OUT/session.json" \
    --json "$OUT/bench_session_$tag.json" > "$OUT/bench_session_$tag.txt" 2>&1 ||
    echo "bench session exit $?" >> "$OUT/bench_session_$tag.txt"
done

python3 - "$OUT" "$BUILD" "${KVLENS_BASE_BUILD:-}" $METHODS <<'PY'
import json, os, sys
out, builds, methods = sys.argv[1], [b for b in sys.argv[2:4] if b], sys.argv[4:]
def load(p):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return None
print("\nresearch path at the 7B shape, %s" % open(os.path.join(out, "research_gpu.txt")).read().strip())
for b in builds:
    tag = os.path.basename(b.rstrip("/"))
    j = load(os.path.join(out, "bench_%s.json" % tag)) or {}
    print("%-12s bench: vision+prefill %.1f ms, decode %.1f tokens/s; prefill with capture %s ms, capture %s MB"
          % (tag, j.get("vision_ms", 0) + j.get("prefill_ms", 0), j.get("decode_tokens_per_s", 0),
             "%.1f" % j["prefill_with_capture_ms"] if "prefill_with_capture_ms" in j else "-",
             "%.0f" % (j.get("capture_backend_bytes", 0) / 1e6) if "capture_backend_bytes" in j else "-"))
    print("%-12s %-22s %8s %10s %10s %10s %10s %9s %9s" % ("", "method", "wall s", "prefill ms", "full dec ms", "compress",
                                                          "decode ms", "peak GB", "of bench"))
    for m in methods:
        safe = "".join(c if c.isalnum() or c == "_" else "_" for c in m)
        base = os.path.join(out, "run_%s_%s" % (tag, safe))
        rc, wall, rss = open(base + ".time").read().split()
        r = load(base + ".json") or {}
        t = r.get("timings_ms", {})
        mr = (r.get("methods") or [{}])[0]
        mt = mr.get("timings_ms", {})
        # The method's decode on the research path (its forwards after the prefill's token) as a
        # share of the same method's tokens/s on the bench path.
        mb = load(os.path.join(out, "bench_%s_%s.json" % (tag, safe))) or {}
        forwards = max(len(mr.get("generated_ids", [])) - 1, 0)
        share = "-"
        if mb.get("decode_tokens_per_s") and mt.get("decode") and forwards:
            share = "%.0f %%" % (100.0 * forwards / (mt["decode"] / 1000.0) / mb["decode_tokens_per_s"])
        print("%-12s %-22s %8.2f %10.1f %10.1f %10.1f %10.1f %9.2f %9s%s" % (
            "", m, float(wall), t.get("prefill", 0), t.get("decode", 0), mt.get("compress", 0), mt.get("decode", 0),
            int(rss) / 1e6, share, "" if rc == "0" else "  (exit %s)" % rc))

# Before/after: each method's two reports compared without their timings (and the build's own
# fields): the ids, kept sets, bytes and every diagnostic, numbers within 1e-9 relative.
def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k != "timings_ms" and not k.endswith("_ms")}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x
def diff(a, b, path=""):
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        if type(a) != type(b):
            return ["%s: %r against %r" % (path, type(a).__name__, type(b).__name__)]
    if isinstance(a, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += diff(a[k], b[k], path + "/" + k) if k in a and k in b else ["%s/%s: only in one" % (path, k)]
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return ["%s: %d entries against %d" % (path, len(a), len(b))]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, "%s[%d]" % (path, i))]
    if isinstance(a, float) or isinstance(b, float):
        return [] if abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b)) else ["%s: %r against %r" % (path, a, b)]
    return [] if a == b else ["%s: %r against %r" % (path, a, b)]
if len(builds) == 2:
    tags = [os.path.basename(b.rstrip("/")) for b in builds]
    print("\nreports of %s against %s, timings left out:" % tuple(tags))
    for m in methods:
        safe = "".join(c if c.isalnum() or c == "_" else "_" for c in m)
        a, b = (load(os.path.join(out, "run_%s_%s.json" % (t, safe))) for t in tags)
        if a is None or b is None:
            print("  %-22s a report is missing" % m)
            continue
        for r in (a, b):
            r.pop("model", None)
        d = diff(strip(a), strip(b))
        print("  %-22s %s" % (m, "the same" if not d else "%d differences, first: %s" % (len(d), "; ".join(d[:3]))))
        if d:  # how far the method's mean diagnostics moved
            ma, mb = (a.get("methods") or [{}])[0], (b.get("methods") or [{}])[0]
            for k in ("mean_softmax_mse", "mean_softmax_kl", "mean_attn_output_rel_error"):
                x, y = ma.get(k, 0.0), mb.get(k, 0.0)
                print("  %-22s   %-28s %.6g against %.6g (relative %.2g)" % ("", k, x, y, abs(x - y) / max(abs(y), 1e-300)))
PY
for b in "$BUILD" ${KVLENS_BASE_BUILD:+"$KVLENS_BASE_BUILD"}; do
  tag=$(basename "$b")
  echo
  echo "the app's loop (kvlens bench session, $tag):"
  cat "$OUT/bench_session_$tag.txt"
done
