#!/usr/bin/env bash
# The benchmarks and the GPU tier in one go, on a machine with a CUDA GPU and torch + triton:
#   benchmarks/run_gpu.sh OUTDIR ["bench suites"] ["pytest selection"] [pytest args...]
# e.g. benchmarks/run_gpu.sh out "forward,compile,decode,backward" "tests"
#
# Benchmarks first (suites in the order given; bench.json is rewritten after each suite), then the
# tests, both with one Triton cache (autotuning results included) that is packed into OUTDIR/tc.*
# (after the benchmarks, and again after the tests if it still fits FASTKDA_CACHE_MAX_MB, 60) and,
# given back through FASTKDA_CACHE_IN=<folder of tc.* parts>, makes every first call warm next
# time (fla-core's cold compilation and autotuning take 1.5-3 minutes per shape; the test tier
# compiles hundreds of kernel variants). Tests print one line each as they finish
# (OUTDIR/gpu_tests.log), so a run cut short still says what passed and what failed, and
# OUTDIR/failures.log says why, as each failure happens. Tests marked bigmem run after the others,
# one at a time.
# With fla-core installed, its kernels for the forward and backward suites' cases compile first, in
# one warm-up process per case (benchmarks/warm.py, keeping no autotuning results) while the tests
# run; the benchmarks then time both libraries on a quiet GPU from compiled kernels. Without
# fla-core (or FASTKDA_WARM=0) the benchmarks run first, then the tests. The warm-ups share the
# machine's cores with the tests (whose time limit counts from their start).
# Environment: FASTKDA_TEST_WORKERS (4), FASTKDA_TEST_TIMEOUT (all pytest runs, 300 s),
# FASTKDA_BENCH_TIMEOUT (300 s), FASTKDA_BENCH_ARGS (extra bench_ops.py args), FASTKDA_CACHE_IN,
# FASTKDA_CACHE_MAX_MB, FASTKDA_WARM (1), FASTKDA_WARM_CASES (comma-separated words: warm only
# the cases whose name holds one, as bench_ops.py --cases), FASTKDA_WARM_TIMEOUT (300 s),
# FASTKDA_TEST_SHARD (i/n: the i-th of n disjoint shards of the tests selected, tests/conftest.py).
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out" && out=$(cd "$out" && pwd)
suites=${2:-forward}
suites=${suites// /}
sel=${3:-tests}
shift 3 || shift $#
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
start=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - start )) s"; }

bench_cache=$(mktemp -d)
fits() {  # whether the packed Triton cache stays within FASTKDA_CACHE_MAX_MB
    [ "$(tar czf - -C "$bench_cache" . | wc -c)" -le $(( ${FASTKDA_CACHE_MAX_MB:-60} * 1000000 )) ]
}
pack() {  # the Triton cache into OUTDIR/tc.* (15 MB parts), replacing an earlier packing
    rm -f "$out"/tc.*
    tar czf - -C "$bench_cache" . | split -b 15m - "$out/tc."
    echo "packed Triton cache: $(du -ch "$out"/tc.* | tail -n 1 | cut -f1) in $(ls "$out"/tc.* | wc -l) parts"
}
if [ -n "${FASTKDA_CACHE_IN:-}" ] && ls "$FASTKDA_CACHE_IN"/tc.* >/dev/null 2>&1; then
    cat "$FASTKDA_CACHE_IN"/tc.* | tar xzf - -C "$bench_cache" && stamp "Triton cache restored"
fi
run_bench() {
    if [ -n "$suites" ] && [ "$suites" != "none" ]; then
        # shellcheck disable=SC2086
        TRITON_CACHE_DIR=$bench_cache timeout "${FASTKDA_BENCH_TIMEOUT:-300}" \
            python3 benchmarks/bench_ops.py --suite "$suites" --json "$out/bench.json" ${FASTKDA_BENCH_ARGS:-} 2>&1 \
            | grep --line-buffered -v -i warn | tee "$out/bench.log"
        stamp "benchmarks done"
        # after the tests (warm-up runs) the cache also holds their kernels: packed only if it fits
        if [ "${#warming[@]}" -eq 0 ] || fits; then pack; else echo "Triton cache not packed: over FASTKDA_CACHE_MAX_MB"; fi
    fi
}
run_tests() {
    if [ -n "$sel" ] && [ "$sel" != "none" ]; then
        workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${FASTKDA_TEST_WORKERS:-4}")
        deadline=$(( $(date +%s) + ${FASTKDA_TEST_TIMEOUT:-300} ))
        : >"$out/gpu_tests.log"
        # the tests in parallel workers, then those marked bigmem one at a time (they would crowd the GPU)
        for pass in "not bigmem|$workers" "bigmem|"; do
            left=$(( deadline - $(date +%s) ))
            if [ "$left" -le 0 ]; then stamp "no time left for the tests marked '${pass%%|*}'"; continue; fi
            # shellcheck disable=SC2086
            TRITON_CACHE_DIR=$bench_cache FASTKDA_FAILURE_LOG="$out/failures.log" timeout "$left" python3 -m pytest -p no:cacheprovider \
                -v -rfs -W ignore -m "${pass%%|*}" ${pass#*|} $sel "$@" 2>&1 \
                | grep --line-buffered -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error|error|assert" >>"$out/gpu_tests.log"
            stamp "tests (-m '${pass%%|*}') done (pytest exit ${PIPESTATUS[0]})"
        done
        # the tests' kernels too, unless that makes the packing too big to carry (then the benchmarks' stays)
        # (not while warm-up processes still write to the cache: the benchmarks after them pack it)
        if [ "${#warming[@]}" -eq 0 ] && fits; then pack; fi
        grep -c PASSED "$out/gpu_tests.log" | sed 's/^/passed: /'
        grep -E "FAILED|ERROR" "$out/gpu_tests.log" | head -n 40
        grep -E "passed|failed" "$out/gpu_tests.log" | grep -v PASSED | tail -n 4
    fi
}
warm_fla() {  # start one warm-up process per case of the forward and backward suites asked (pids: warming)
    python3 -c "import fla" 2>/dev/null || return 0
    local suite case
    for suite in forward backward; do
        case ",$suites," in *",$suite,"*) ;; *) continue ;; esac
        while read -r case; do
            # no autotuning results kept: TRITON_CACHE_AUTOTUNING=1 (exported above) would keep them
            # even with fla-core's FLA_CACHE_RESULTS=0, tuned on a GPU busy with the tests
            TRITON_CACHE_DIR=$bench_cache TRITON_CACHE_AUTOTUNING=0 FLA_CACHE_RESULTS=0 timeout "${FASTKDA_WARM_TIMEOUT:-300}" \
                python3 benchmarks/warm.py fla "$suite" "$case" >>"$out/warm.log" 2>&1 &
            warming+=("$!")
        done < <(python3 - "$suite" "${FASTKDA_WARM_CASES:-}" <<'PY'
import sys
sys.path.insert(0, "benchmarks")
import bench_ops
words = [w for w in sys.argv[2].split(",") if w]
for c in bench_ops.FORWARD if sys.argv[1] == "forward" else bench_ops.BACKWARD:
    if not words or any(w in c.name for w in words):
        print(c.name)
PY
)
    done
}
warming=()
if [ "${FASTKDA_WARM:-1}" = 1 ] && [ -n "$suites" ] && [ "$suites" != "none" ]; then
    warm_fla
fi
if [ "${#warming[@]}" -gt 0 ]; then
    stamp "warming fla-core's kernels in ${#warming[@]} processes (OUTDIR/warm.log) while the tests run"
    run_tests "$@"
    wait "${warming[@]}"
    stamp "warm-ups done"
    run_bench
else
    run_bench
    run_tests "$@"
fi
