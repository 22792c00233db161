#!/usr/bin/env bash
# The model families on the GPU host: for each of LLaVA-NeXT-Mistral-7B, InternVL3-8B, Qwen2-VL-7B, Qwen2.5-VL-7B and
# Llama-3.1-8B (tests/make_family7b.py: random fp16 weights in the published shapes, HF
# transformers timed on them), kvlens bench on the same checkpoint, image and prompt; a table
# last: prompt and visual tokens, prefill, decode tokens/s and its share of the weight roofline,
# and HF's cached loop beside it.
#   KVLENS_GPU_BUILD=build-gpu KVLENS_GPU_OUT=$OUT tests/gpu_families.sh [family ...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVLENS_GPU_BUILD:-build-gpu}
out=${KVLENS_GPU_OUT:-/tmp/kvlens-families}
mkdir -p "$out"
families=("$@")
[ ${#families[@]} -eq 0 ] && families=(llava_next_mistral internvl3_8b qwen2vl_7b qwen25vl_7b llama3_8b)
for f in "${families[@]}"; do
  ckpt=/tmp/kvlens-$f
  python3 tests/make_family7b.py "$f" --out "$ckpt" --json "$out/$f.hf.json" > "$out/$f.hf.log" 2>&1 ||
    { echo "$f: make_family7b failed"; tail -5 "$out/$f.hf.log"; continue; }
  prompt=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['prompt'])" "$out/$f.hf.json")
  image=()
  [ -f "$ckpt/bench_image.png" ] && image=(--image "$ckpt/bench_image.png")
  "$build/kvlens" bench --backend cuda --model "$ckpt" "${image[@]}" --prompt "$prompt" --max-new-tokens 32 \
    --repeat 3 --json "$out/$f.kvlens.json" > "$out/$f.kvlens.log" 2>&1 ||
    { echo "$f: kvlens bench failed"; tail -5 "$out/$f.kvlens.log"; }
  rm -rf "$ckpt"
done
python3 - "$out" "${families[@]}" <<'PY'
import json, os, sys
out, fams = sys.argv[1], sys.argv[2:]
print("%-20s %7s %7s %10s %10s %9s %12s %12s" % ("family", "prompt", "visual", "prefill ms", "decode t/s", "roofline",
                                                 "HF loop t/s", "HF prefill"))
for f in fams:
    try:
        k = json.load(open(os.path.join(out, f + ".kvlens.json")))
        h = json.load(open(os.path.join(out, f + ".hf.json")))
    except (OSError, ValueError) as e:
        print("%-20s missing: %s" % (f, e))
        continue
    print("%-20s %7d %7d %10.1f %10.1f %8.1f%% %12.1f %12.1f" % (
        f, k["prompt_tokens"], k["visual_tokens"], k["prefill_ms"], k["decode_tokens_per_s"],
        100 * k["share_of_roofline"], h["hf"]["loop_tokens_per_s"], h["hf"]["prefill_ms"]))
PY
