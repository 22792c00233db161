#!/usr/bin/env bash
# Trains kvlens's embedded default model on the GPU machine, end to end inside one 10-minute call:
# builds the kvlens CLI, generates the training and held-out scene sets, trains, saves, evaluates.
#
#   bash assets/models/kvlens-scenes-6m/train_embedded.sh            (from the repo root; .deps/ carried for the build)
#
# Results go to $OUT (the device machine's return folder; out/train_embedded when unset), at most
# 8 files, each <= 16 MiB, copied flat:
#   $OUT/model/model.safetensors      fp16 weights
#   $OUT/model/model_files.tar        every other file of the model folder (config, tokenizer,
#                                     preprocessor, train_info.json, eval.json)
#   $OUT/eval.json  $OUT/train_info.json  $OUT/hf_outputs.json  $OUT/train.log
# Unpack:  mkdir -p M && cp $OUT/model/model.safetensors M/ && tar -xf $OUT/model/model_files.tar -C M
#
# Knobs (environment): N_TRAIN, TRAIN_SEED, N_HELDOUT, HELDOUT_SEED, STEPS, BATCH, LR, SEED,
# MINUTES (training-loop cap), BUDGET_S (whole script, seconds), RESERVE_S (kept for eval + save
# + copy), EVAL_N, KVLENS (prebuilt binary: skips the build), WORK (scratch), DEVICE, PYTHON,
# EXTRA_ARGS (more train_embedded.py flags, e.g. "--compile"); PRESET (scenes-6m, or scenes-deep:
# LLaVA-1.5's geometry, 12 layers) and SCENES (the scene generator version: 1 classic, 2 rich);
# GPUS (processes, one a GPU; default every GPU nvidia-smi lists): more than one trains data-
# parallel under torchrun, --batch split between them.
set -euo pipefail

N_TRAIN=${N_TRAIN:-20000}
TRAIN_SEED=${TRAIN_SEED:-1}
N_HELDOUT=${N_HELDOUT:-500}
HELDOUT_SEED=${HELDOUT_SEED:-1000001}
STEPS=${STEPS:-100000}
BATCH=${BATCH:-192}
LR=${LR:-1e-3}
SEED=${SEED:-0}
MINUTES=${MINUTES:-6}
BUDGET_S=${BUDGET_S:-570}
RESERVE_S=${RESERVE_S:-90}
EVAL_N=${EVAL_N:-500}
WORK=${WORK:-/tmp/kvlens_train}
EXTRA_ARGS=${EXTRA_ARGS:-}
PRESET=${PRESET:-scenes-6m}
SCENES=${SCENES:-1}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-out/train_embedded}
if [[ -z "${GPUS:-}" ]]; then
  GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  ((GPUS >= 1)) || GPUS=1
fi
PY=${PYTHON:-python3}

T_START=$(date +%s)
mkdir -p "$OUT" "$WORK"
LOG="$OUT/train.log"
: >"$LOG"

say() { echo "[train_embedded +$(($(date +%s) - T_START))s] $*"; }

run() {
  say "host $(hostname), $(nproc) cores"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  fi

  # 1. kvlens CLI
  local kv=${KVLENS:-}
  if [[ -z "$kv" ]]; then
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKVLENS_TESTS=OFF >/dev/null
    cmake --build build-gpu -j16 --target kvlens
    kv=build-gpu/kvlens
  fi
  say "kvlens: $kv"

  # 2. scene sets (both at once)
  local train_dir=$WORK/scenes_train heldout_dir=$WORK/scenes_heldout
  rm -rf "$train_dir" "$heldout_dir"
  "$kv" scenes --n "$N_TRAIN" --seed "$TRAIN_SEED" --generator-version "$SCENES" --out "$train_dir" &
  local p1=$!
  "$kv" scenes --n "$N_HELDOUT" --seed "$HELDOUT_SEED" --generator-version "$SCENES" --out "$heldout_dir" &
  local p2=$!
  wait "$p1"
  wait "$p2"
  say "scenes (generator version $SCENES): $N_TRAIN train (seed $TRAIN_SEED), $N_HELDOUT held out (seed $HELDOUT_SEED)"

  # 3. train + save + evaluate; the training loop ends by the deadline that leaves RESERVE_S
  local deadline=$((T_START + BUDGET_S - RESERVE_S))
  say "training deadline in $((deadline - $(date +%s)))s (cap ${MINUTES} min)"
  local model_dir=$WORK/model
  rm -rf "$model_dir"
  local rc=0
  # shellcheck disable=SC2086
  local launch=("$PY")
  ((GPUS <= 1)) || launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$GPUS")
  say "training processes: $GPUS"
  PYTHONUNBUFFERED=1 "${launch[@]}" assets/models/kvlens-scenes-6m/train_embedded.py \
    --train "$train_dir" --heldout "$heldout_dir" --out "$model_dir" \
    --steps "$STEPS" --batch "$BATCH" --lr "$LR" --seed "$SEED" \
    --minutes "$MINUTES" --deadline "$deadline" --device "$DEVICE" --eval-n "$EVAL_N" --preset "$PRESET" \
    --workers 16 --hf-outputs "$WORK/hf_outputs.json" $EXTRA_ARGS || rc=$?

  # 4. results, flat (also whatever exists after a failure in evaluation)
  mkdir -p "$OUT/model"
  if [[ -f "$model_dir/model.safetensors" ]]; then
    cp "$model_dir/model.safetensors" "$OUT/model/"
    (cd "$model_dir" && tar -cf - --exclude=model.safetensors .) >"$OUT/model/model_files.tar"
  fi
  for f in "$model_dir/eval.json" "$model_dir/train_info.json" "$WORK/hf_outputs.json"; do
    [[ -f "$f" ]] && cp "$f" "$OUT/"
  done
  if ((rc != 0)); then
    say "FAILED: train_embedded.py exited with $rc"
    return "$rc"
  fi
  local big
  big=$(find "$OUT" -type f -size +16M)
  [[ -z "$big" ]] || say "WARNING: over 16 MiB, will not come back: $big"
  say "done; files in $OUT:"
  find "$OUT" -type f -printf '%10s  %p\n' | sort -k2
}

run 2>&1 | tee -a "$LOG"
