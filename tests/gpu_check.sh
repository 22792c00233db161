#!/usr/bin/env bash
# On a GPU host, in one call: build kvlens with CUDA, run every test (the GPU ones included),
# make a LLaVA-1.5-7B-shaped random fp16 checkpoint, benchmark (the embedded model, the 7B
# shape against HF transformers, decode attention against PyTorch SDPA, CalibQuant's Fig. 3
# throughput, both embedded models' CPU caption time at 1–16 threads against HF transformers on the host's
# CPU) and print a short table last. Logs and JSON go to $KVLENS_GPU_OUT (./gpu_out).
#
#   tests/gpu_check.sh            everything
#   tests/gpu_check.sh build test only some stages (build, test, bench, throughput, threads, summary;
#                                 and, not in the default list, sanitize: compute-sanitizer's
#                                 memcheck, synccheck and racecheck over the decode kernel tests, the
#                                 quantizing append's, the quantize-and-pack and ZipCache's gap kernels';
#                                 kernels: ncu's device time of each kernel over a short decode of the
#                                 7B shape)
#   KVLENS_7B_METHODS="m1 m2"     the methods the bench stage times on the 7B shape
#   KVLENS_7B_LONG="m1 m2"        those it also times over 128 new tokens (the summary's "…@128" rows)
#   KVLENS_7B_KERNELS="m1 m2"     the methods (and `full`) the kernels stage profiles
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${KVLENS_GPU_OUT:-$PWD/gpu_out}
BUILD=${KVLENS_GPU_BUILD:-build-gpu}
CK=${KVLENS_7B_DIR:-/tmp/kvlens-llava7b}
STAGES=${*:-build test bench throughput threads summary}
METHODS_7B=${KVLENS_7B_METHODS:-uniform:bits=4 hadamard_int4 kivi calibquant:bits=1 zipcache zipcache:gap=8 turboquant turboquant:qjl=on}
LONG_7B=${KVLENS_7B_LONG:-full zipcache:gap=8}
KERNELS_7B=${KVLENS_7B_KERNELS:-full zipcache:gap=8}
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
step() { echo "== $(date +%T) $*" | tee -a "$OUT/steps.log"; }
run() {  # run NAME SECONDS CMD...: output to $OUT/NAME.txt, status to steps.log
  local name=$1 limit=$2; shift 2
  step "$name: $*"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "   $name exit $rc" | tee -a "$OUT/steps.log"
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
nvcc --version | tail -2 >> "$OUT/gpu.txt" 2>&1

if has build; then
  run cmake 120 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKVLENS_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 &&
    run build 600 cmake --build "$BUILD" -j"$(nproc)" || { tail -40 "$OUT/build.txt"; exit 1; }
fi
if has test; then
  run ctest 400 ctest --test-dir "$BUILD" -j8 --output-on-failure --timeout 300
fi
if has bench; then
  run bench_embedded 120 "$BUILD/kvlens" bench --backend cuda --repeat 5 --json "$OUT/bench_embedded.json"
  run bench_attention 180 "$BUILD/kvlens" bench attention --json "$OUT/bench_attention.json"
  run bench_attention_b2b 180 "$BUILD/kvlens" bench attention --back-to-back --json "$OUT/bench_attention_b2b.json"
  run bench_prefill 120 "$BUILD/kvlens" bench prefill --json "$OUT/bench_prefill.json"
  run sdpa 120 python3 tests/sdpa_bench.py --json "$OUT/sdpa.json"
  run sdpa_b2b 120 python3 tests/sdpa_bench.py --back-to-back --json "$OUT/sdpa_b2b.json"
  if [ ! -f "$CK/config.json" ] || [ ! -f "$OUT/hf_bench.json" ]; then
    run make_llava7b 300 python3 tests/make_llava7b.py --out "$CK" --json "$OUT/hf_bench.json"
  fi
  PROMPT=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['prompt'])" "$OUT/hf_bench.json" 2>/dev/null)
  run bench_7b 200 "$BUILD/kvlens" bench --backend cuda --model "$CK" --prompt "${PROMPT:-Describe the image.}" \
    --repeat 3 --json "$OUT/bench_7b.json"
  run bench_7b_unchained 200 "$BUILD/kvlens" bench --backend cuda --model "$CK" --prompt "${PROMPT:-Describe the image.}" \
    --repeat 3 --unchained --json "$OUT/bench_7b_unchained.json"
  # Methods on the 7B shape, each decoding as it would in `run` without diagnostics: the share of
  # the weight roofline and the compression time, beside the full cache's (bench_7b).
  for m in $METHODS_7B; do
    run "bench_7b_method_${m//[:=,]/_}" 200 "$BUILD/kvlens" bench --backend cuda --model "$CK" \
      --prompt "${PROMPT:-Describe the image.}" --repeat 3 --method "$m" --json "$OUT/bench_7b_method_${m//[:=,]/_}.json"
  done
  # Long decodes, where a method's later work while decoding (ZipCache's gaps) weighs in; the full
  # cache's beside them.
  for m in $LONG_7B; do
    run "bench_7b_method_${m//[:=,]/_}@128" 200 "$BUILD/kvlens" bench --backend cuda --model "$CK" \
      --prompt "${PROMPT:-Describe the image.}" --repeat 1 --max-new-tokens 128 --method "$m" \
      --json "$OUT/bench_7b_method_${m//[:=,]/_}@128.json"
  done
  run bench_7b_profile 200 "$BUILD/kvlens" bench --backend cuda --model "$CK" --prompt "${PROMPT:-Describe the image.}" \
    --repeat 1 --max-new-tokens 8 --profile
  run bench_embedded_profile 120 "$BUILD/kvlens" bench --backend cuda --repeat 1 --max-new-tokens 8 --profile
fi
if has sanitize; then
  for tool in memcheck synccheck racecheck; do
    run "sanitize_$tool" 600 compute-sanitizer --tool "$tool" --error-exitcode 9 "$BUILD/test_decode_kernel"
    run "sanitize_quant_tail_$tool" 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$BUILD/test_decode_quant_tail"
    # the quantize-and-pack kernels (KIVI's pieces, range groups, rotated rows)
    run "sanitize_quant_pack_$tool" 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$BUILD/test_decode_ops" \
      --gtest_filter='DecodeOps.KiviPiecesKernel:DecodeOps.QuantizeAndPackKernels'
    # a KV sync's gathers in one launch
    run "sanitize_sync_gather_$tool" 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$BUILD/test_sync_gather"
    # ZipCache's gap scored, ranked, planned and quantized on the device; probes' states kept
    run "sanitize_zip_gap_$tool" 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$BUILD/test_zip_gap_ops"
  done
fi
if has kernels; then
  # Each kernel's device time over a bench of the 7B shape (its vision, prefills, warm-up and
  # timed decodes of 20 new tokens), per method: ncu serializes the launches, flushes the caches
  # and holds base clocks (longer than in a run, but split by kernel; `--by-grid` keeps a
  # prompt's launches apart from a decode's). The bench stage's checkpoint and prompt, or a
  # checkpoint of its own without HF's timing.
  PJ="$OUT/hf_bench.json"
  if [ ! -f "$CK/config.json" ] || [ ! -f "$PJ" ]; then
    PJ="$OUT/llava7b_kernels.json"
    run make_llava7b_kernels 300 python3 tests/make_llava7b.py --out "$CK" --json "$PJ" --no-hf-bench
  fi
  PROMPT=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['prompt'])" "$PJ" 2>/dev/null)
  for m in $KERNELS_7B; do
    n=${m//[:=,]/_}
    marg=(); [ "$m" != full ] && marg=(--method "$m")
    run "kernels_7b_$n" 300 ncu --csv --print-units base --metrics gpu__time_duration.sum "$BUILD/kvlens" bench \
      --backend cuda --model "$CK" --prompt "${PROMPT:-Describe the image.}" ${marg[@]+"${marg[@]}"} \
      --max-new-tokens 20 --repeat 1 &&
      python3 tests/ncu_kernels.py "$OUT/kernels_7b_$n.txt" --by-grid --json "$OUT/kernels_7b_$n.json" \
        > "$OUT/kernels_7b_$n.table.txt"
  done
fi
if has throughput; then
  run bench_throughput 300 "$BUILD/kvlens" bench throughput --json "$OUT/bench_throughput.json"
fi
if has threads; then
  # Both embedded models, each figure the median of its rounds (the host's speed drifts).
  run cpu_threads 300 python3 tests/cpu_threads_bench.py --kvlens "$BUILD/kvlens" --rounds 3 \
    --json "$OUT/cpu_threads.json"
  run cpu_threads_14m 400 python3 tests/cpu_threads_bench.py --kvlens "$BUILD/kvlens" --rounds 2 --repeat 5 \
    --model assets/models/kvlens-scenes-14m --image assets/images/rich_000.png --json "$OUT/cpu_threads_14m.json"
fi
if has summary; then
  python3 tests/gpu_summary.py "$OUT"
fi
