#!/usr/bin/env bash
# Weight-bus GPU phases for one device call: each step under its own timeout, its log and result file under
# $OUT (a step that times out keeps what the steps before it wrote). Usage, on a 4-GPU machine:
#   KIND=nvidia-h200-x4 STEPS="tests one three" bash benchmarks/gpu/weight_bus.sh
set -u
OUT=${OUT:-/tmp/weight-bus-out}; KIND=${KIND:?name the device kind}; STEPS=${STEPS:-tests one two three}
mkdir -p "$OUT"
LOG=$OUT/steps.log
. "$(dirname "$0")/lib.sh"
BENCH="python benchmarks/weight_bus.py --device-kind $KIND --out-dir $OUT"
nvidia-smi topo -m >>"$LOG" 2>&1
for s in $STEPS; do
  case $s in
    tests) step tests "${T_TESTS:-200}" python -m pytest -q -m gpu -p no:cacheprovider \
             tests/integration/weight_bus/test_bus_nccl.py tests/integration/weight_bus/test_bus_cuda.py \
             tests/integration/trainer/test_publish_gather_cuda.py ;;
    one) step one "${T_ONE:-240}" $BENCH ;;
    two) step two "${T_TWO:-200}" $BENCH --engines 2 --engine-gpus 1,2 --models qwen2.5-1.5b-shape,qwen2.5-7b-shape --label 2engines ;;
    big) step big "${T_BIG:-120}" $BENCH --models qwen2.5-7b-shape --bucket-mb 2048 --repeats 3 --label 7b-2gib-buckets ;;
    three) step three "${T_THREE:-200}" $BENCH --engines 3 --engine-gpus 1,2,3 --models qwen2.5-1.5b-shape,qwen2.5-7b-shape --label 3engines ;;
  esac
done
grep -h "^weight_bus \|bus/raw\|^qwen\|passed\|failed\|rc=" "$LOG" | tail -40
