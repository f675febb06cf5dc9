#!/usr/bin/env bash
# The benchmarks and the GPU tier in one go, on a machine with a CUDA GPU and torch + triton:
#   benchmarks/run_gpu.sh OUTDIR ["bench suites"] ["pytest selection"] [pytest args...]
# e.g. benchmarks/run_gpu.sh out "forward,decode,backward" "tests"
#
# Benchmarks first (suites in the order given; bench.json is rewritten after each suite), with a
# Triton cache of their own that is packed into OUTDIR/tc.* (autotuning results included) and,
# given back through FASTKDA_CACHE_IN=<folder of tc.* parts>, makes every first call warm next
# time (fla-core's cold compilation and autotuning take 1.5-3 minutes per shape). Then the tests,
# one line per test as it finishes (OUTDIR/gpu_tests.log), so a run cut short still says what
# passed and what failed, and OUTDIR/failures.log why, as each failure happens.
# Environment: FASTKDA_TEST_WORKERS (4), FASTKDA_TEST_TIMEOUT (whole
# pytest run, 300 s), FASTKDA_BENCH_TIMEOUT (300 s), FASTKDA_BENCH_ARGS (extra bench_ops.py args).
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out" && out=$(cd "$out" && pwd)
suites=${2:-forward}
sel=${3:-tests}
shift 3 || shift $#
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
start=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - start )) s"; }

bench_cache=$(mktemp -d)
if [ -n "${FASTKDA_CACHE_IN:-}" ] && ls "$FASTKDA_CACHE_IN"/tc.* >/dev/null 2>&1; then
    cat "$FASTKDA_CACHE_IN"/tc.* | tar xzf - -C "$bench_cache" && stamp "Triton cache restored"
fi
if [ -n "$suites" ] && [ "$suites" != "none" ]; then
    # shellcheck disable=SC2086
    TRITON_CACHE_DIR=$bench_cache timeout "${FASTKDA_BENCH_TIMEOUT:-300}" \
        python3 benchmarks/bench_ops.py --suite "$suites" --json "$out/bench.json" ${FASTKDA_BENCH_ARGS:-} 2>&1 \
        | grep --line-buffered -v -i warn | tee "$out/bench.log"
    stamp "benchmarks done"
    tar czf - -C "$bench_cache" . | split -b 15m - "$out/tc."
    echo "packed Triton cache: $(du -ch "$out"/tc.* | tail -n 1 | cut -f1) in $(ls "$out"/tc.* | wc -l) parts"
fi
if [ -n "$sel" ] && [ "$sel" != "none" ]; then
    workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${FASTKDA_TEST_WORKERS:-4}")
    deadline=$(( $(date +%s) + ${FASTKDA_TEST_TIMEOUT:-300} ))
    : >"$out/gpu_tests.log"
    # the tests in parallel workers, then those marked bigmem one at a time (they would crowd the GPU)
    for pass in "not bigmem|$workers" "bigmem|"; do
        # shellcheck disable=SC2086
        FASTKDA_FAILURE_LOG="$out/failures.log" timeout $(( deadline - $(date +%s) )) python3 -m pytest -p no:cacheprovider \
            -v -rfs -W ignore -m "${pass%%|*}" ${pass#*|} $sel "$@" 2>&1 \
            | grep --line-buffered -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error|error|assert" >>"$out/gpu_tests.log"
        stamp "tests (-m '${pass%%|*}') done (pytest exit ${PIPESTATUS[0]})"
    done
    grep -c PASSED "$out/gpu_tests.log" | sed 's/^/passed: /'
    grep -E "FAILED|ERROR" "$out/gpu_tests.log" | head -n 40
    grep -E "passed|failed" "$out/gpu_tests.log" | grep -v PASSED | tail -n 4
fi
