#!/usr/bin/env bash
# Regenerates every table of docs/findings.md: runs build/kvlens on the embedded model over a
# held-out scene set, then prints the tables (docs/findings_tables.py) to OUT/tables.md.
#
#   docs/findings.sh [OUT]        (OUT defaults to out/findings; build/kvlens must be built)
#
# MODEL=DIR runs another checkpoint than the 4-layer kvlens-scenes-6m; SCENES=2 holds out rich scenes
# (kvlens scenes --generator-version 2) in place of the classic ones, and leaves out the runs
# that ask every image "how many shapes are there?" (a rich scene's count question names its
# group). The tables take the layer count, KV heads and head size from the model's config.json.
#
# LIMIT=N caps every run and evaluation at N images (a quicker, coarser pass, e.g. on a deep model).
#
# Reports already in OUT are kept, so an interrupted run resumes; a fresh OUT regenerates all.
# About half an hour with JOBS=2 on two cores. JOBS=N runs N images at a time (default 1).
set -euo pipefail
cd "$(dirname "$0")/.."
K=${KVLENS:-build/kvlens}
OUT=${1:-out/findings}
JOBS=${JOBS:-1}
SCENES=${SCENES:-1}
LIMIT=${LIMIT:-0}
cap() { if [ "$LIMIT" -gt 0 ] && [ "$1" -gt "$LIMIT" ]; then echo "$LIMIT"; else echo "$1"; fi; }
# (the 4-layer model unless MODEL names another: the default, kvlens-scenes-14m, has its own tables)
MARGS=(--model "${MODEL:-assets/models/kvlens-scenes-6m}")
H=$OUT/heldout
[ -x "$K" ] || { echo "findings.sh: $K is not built (cmake --build build --target kvlens)" >&2; exit 2; }
mkdir -p "$OUT"
[ -f "$H/annotations.json" ] || "$K" scenes --n 500 --seed 1000001 --generator-version "$SCENES" --out "$H" > /dev/null

# run_images DIR N ARGS...: `kvlens run --image <held-out image i> ARGS --report DIR/i.json` for
# the first N images, skipping reports that exist. DIR.specs lists the --method specs in order
# (the tables find each method of a report by its position).
run_images() {
  local dir=$OUT/$1 n
  n=$(cap "$2")
  shift 2
  mkdir -p "$dir"
  local a prev=""
  : > "$dir.specs"
  for a in "$@"; do
    [ "$prev" = "--method" ] && printf '%s\n' "$a" >> "$dir.specs"
    prev=$a
  done
  for i in $(seq 0 $((n - 1))); do
    local id
    id=$(printf %06d "$i")
    [ -f "$dir/$id.json" ] && continue
    printf '%s\0' "$id"
  done | xargs -0 -r -P "$JOBS" -I{} "$K" run "${MARGS[@]}" --image "$H/images/{}.png" "$@" --report "$dir/{}.json" > /dev/null
}

# eval_once NAME ARGS...: `kvlens eval --dataset H ARGS --no-meteor --json OUT/NAME.json` unless it exists.
eval_once() {
  local name=$1
  shift
  [ -f "$OUT/$name.json" ] || "$K" eval "${MARGS[@]}" --dataset "$H" "$@" --no-meteor --json "$OUT/$name.json" > /dev/null
}

m() { for s in "$@"; do printf -- '--method\0%s\0' "$s"; done; }
methods() { local -n arr=$1; mapfile -d '' arr < <(m "${@:2}"); }

# §1 Calibration: 1-bit CalibQuant over a τ grid, official shrink, 2 bits (20 images).
S1=(calibquant:bits=1,calibrate=off)
for a in 0 1 2 3; do for b in 0 1 2 3; do S1+=("calibquant:bits=1,tau1=$a,tau2=$b"); done; done
for b in 4 5 6 8; do S1+=("calibquant:bits=1,tau1=0,tau2=$b"); done
S1+=(calibquant:preset=official calibquant:preset=official,calibrate=off calibquant:bits=2 calibquant:bits=2,calibrate=off)
methods A "${S1[@]}"
run_images s1 20 --max-new-tokens 32 --diag-steps 4 "${A[@]}"

# §2 CacheHitRate: budget 0.1 with windows 32 (the §4 runs) and 8, budget 0.2 (50 images).
run_images s2_b02 50 --max-new-tokens 40 --hit-budget 0.2 --method full
run_images s2_w8 50 --max-new-tokens 40 --hit-window 8 --method full

# §3 ZipCache: saliency, probes, bits, range granularity (50 images); streaming (16 diag steps).
S3=()
for bits in "" low_bits=1 low_bits=1,saliency_ratio=0.1; do
  for v in "" saliency=accumulated probe=all probe=all,saliency=accumulated; do
    [ "$bits" = "low_bits=1,saliency_ratio=0.1" ] && case $v in probe*) continue ;; esac
    spec=$bits${bits:+${v:+,}}$v
    S3+=("zipcache${spec:+:$spec}")
  done
done
for g in ranges=segment value_token_range=head ranges=segment,value_token_range=head preset=official saliency_heads=shared; do
  S3+=("zipcache:$g" "zipcache:low_bits=1,$g")
done
methods A "${S3[@]}"
run_images s3 50 --max-new-tokens 40 "${A[@]}"
methods A zipcache zipcache:gap=2 zipcache:gap=4 zipcache:gap=8 zipcache:low_bits=1 zipcache:low_bits=1,gap=4
run_images s3_stream 50 --max-new-tokens 40 --diag-steps 16 "${A[@]}"

# §4 Bytes against caption agreement (50 images), the VL-Cache budget × recent-window grid on
# the caption and the counting question, and LOOK-M's merges as printed and as coded.
S4=(full:storage=fp32 full uniform uniform:bits=2 kivi kivi:bits=4 calibquant:bits=1 calibquant:preset=official
    calibquant:bits=2 calibquant:bits=2,calibrate=off zipcache zipcache:saliency=accumulated turboquant
    turboquant:bits=2 hadamard_int4 vlcache vlcache:budget=0.2 h2o h2o:budget=0.2 snapkv streamingllm pyramidkv
    lookm lookm:preset=official stack stack:budget=0.2)
methods A "${S4[@]}"
run_images s4 50 --max-new-tokens 40 "${A[@]}"
VL=()
for b in 0.1 0.2 0.3; do
  for r in 0 0.1 0.25 0.5; do VL+=("vlcache:budget=$b,recent_ratio=$r"); done
  VL+=("vlcache:budget=$b,recent_ratio=0.1,budget_mode=uniform" "h2o:budget=$b,recent_ratio=0.1" "lookm:alpha1=0,alpha2=$b,merge=none")
done
methods A "${VL[@]}"
run_images s4_vl_caption 50 --max-new-tokens 40 "${A[@]}"
[ "$SCENES" = 1 ] && run_images s4_vl_count 50 --max-new-tokens 10 --prompt "how many shapes are there?" "${A[@]}"
LM=()
for merge in none average pivotal weighted; do LM+=("lookm:merge=$merge" "lookm:merge=$merge,preset=official"); done
methods A "${LM[@]}"
run_images s4_lookm 50 --max-new-tokens 40 "${A[@]}"

# Caption exact match (100 images) and VQA (30 images) under the main methods.
eval_once eval_captions --n "$(cap 100)" --no-vqa --method calibquant:bits=1 \
  --method uniform --method kivi --method calibquant:preset=official --method calibquant:bits=2 \
  --method zipcache --method zipcache:saliency=accumulated --method zipcache:preset=official \
  --method zipcache:ranges=segment,value_token_range=head --method zipcache:gap=4 --method turboquant \
  --method hadamard_int4 --method vlcache --method h2o --method lookm --method lookm:preset=official \
  --method stack --method full:storage=fp32
eval_once eval_vqa --n "$(cap 30)" --method calibquant:bits=1 --method calibquant:bits=2 --method zipcache \
  --method vlcache --method vlcache:recent_ratio=0.5 --method h2o --method lookm --method stack

# §5 Sparsity at p = 0.001 and 0.1 (20 images; p = 0.01 comes from the §4 runs).
run_images s5_p0001 20 --max-new-tokens 12 --sparsity-p 0.001 --method full
run_images s5_p01 20 --max-new-tokens 12 --sparsity-p 0.1 --method full

python3 docs/findings_tables.py "$OUT" > "$OUT/tables.md"
echo "tables: $OUT/tables.md"
