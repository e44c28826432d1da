#!/usr/bin/env bash
# Scale-out GPU phases for one device call: each step under its own timeout, its log and result files under
# $OUT (a step that times out keeps what the steps before it wrote; async_vs_sync phases append to one
# result file per shape). Usage, on a 2-GPU machine (trainer on GPU 0, one engine on GPU 1):
#   KIND=nvidia-h200-x2 STEPS="memory sync-0.5b async-0.5b bounds-0.5b" bash benchmarks/gpu/scale_out.sh
# Steps: memory (the trainer memory plan's GPU test), {sync,async,bounds,genonly}-{0.5b,1.5b} (async_vs_sync
# phases; genonly: the generator-only bound alone, which one GPU runs with AVS_EXTRA="--engine-gpu 0";
# AVS_EXTRA adds options, e.g. "--max-new-tokens 512", and LABEL a suffix to the result file's label),
# scale-{generators,trainers,ab,colocated} (scale_run phases on 4 GPUs: 1+1 -> 2+1 -> 3+1, 2+1 -> 2+2, async vs
# sync at 2+2, colocated sync jobs at COLO_RANKS GPUs (default 1,2,4), appending to one file labelled "scale").
set -u
OUT=${OUT:-/tmp/scale-out-out}; KIND=${KIND:?name the device kind}; STEPS=${STEPS:-memory sync-0.5b async-0.5b bounds-0.5b}
ASYNC=${ASYNC:-2}  # the headline staleness (benchmarks/async_vs_sync/job.py HEADLINE_STALENESS)
RUN_STEPS=${RUN_STEPS:-20}; WARMUP=${WARMUP:-3}
mkdir -p "$OUT"
# each phase is its own process: the model is built once per shape and taken from here by the next ones
export SLIPSTREAM_BENCH_MODEL_CACHE=${SLIPSTREAM_BENCH_MODEL_CACHE:-/tmp/slipstream-bench-models}
LOG=$OUT/steps.log
. "$(dirname "$0")/lib.sh"
AVS=(python -m benchmarks.async_vs_sync --device cuda --device-kind "$KIND" --no-learning --steps "$RUN_STEPS"
     --warmup "$WARMUP" --out-dir "$OUT" ${AVS_EXTRA:-})
nvidia-smi --query-gpu=name,memory.total --format=csv >>"$LOG" 2>&1
for s in $STEPS; do
  case $s in
    memory) step memory "${T_MEMORY:-240}" python -m pytest -q -s -m gpu -p no:cacheprovider tests/integration/trainer/test_memory_plan_cuda.py ;;
    sync-*|async-*|bounds-*|genonly-*)
      shape=${s#*-}
      case $s in
        sync-*) phase=(--phase staleness --staleness 0) ;;
        async-*) phase=(--phase staleness --staleness "$ASYNC") ;;
        bounds-*) phase=(--phase bounds) ;;
        genonly-*) phase=(--phase generator-only) ;;
      esac
      step "$s" "${T_PHASE:-280}" "${AVS[@]}" --model-shape "qwen2.5-$shape-shape" --label "$shape${LABEL:+-$LABEL}" "${phase[@]}" --append ;;
    scale-*)
      step "$s" "${T_PHASE:-280}" python benchmarks/scale_run.py --device cuda --device-kind "$KIND" \
        --steps "${SCALE_STEPS:-10}" --warmup "${SCALE_WARMUP:-2}" --out-dir "$OUT" --phase "${s#scale-}" \
        --label scale --append --colocated-ranks "${COLO_RANKS:-1,2,4}" ;;
  esac
done
grep -h "^async_vs_sync \|samples/s\|GiB usable\|peak \|passed\|failed\|rc=\|ERROR" "$LOG" | tail -40
