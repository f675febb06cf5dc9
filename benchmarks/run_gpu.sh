#!/usr/bin/env bash
# The GPU tier and the benchmarks in one go, on a machine with a CUDA GPU and torch + triton:
#   benchmarks/run_gpu.sh OUTDIR "pytest selection" "bench suites" [pytest args...]
# e.g. benchmarks/run_gpu.sh out "tests" "forward,backward,decode"
set -uo pipefail
out=${1:?output directory}
sel=${2:-tests}
suites=${3:-forward}
shift 3 || shift $#
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${FASTKDA_TEST_WORKERS:-8}")
# shellcheck disable=SC2086
timeout "${FASTKDA_TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider $workers $sel "$@" >"$out/gpu_tests.log" 2>&1
echo "pytest exit $?"; tail -n 30 "$out/gpu_tests.log"
if [ -n "$suites" ] && [ "$suites" != "none" ]; then
    timeout "${FASTKDA_BENCH_TIMEOUT:-300}" python3 benchmarks/bench_ops.py --suite "$suites" --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
fi
