#!/usr/bin/env bash
# Re-measure every committed figure that depends on the toy zoo, after a zoo model or the
# task suite changed.  Run from the repository root:
#
#     bash benchmarks/regenerate.sh            # 35-45 minutes on two CPU cores
#
# Two lanes run side by side, one CPU thread each, so that the timings inside each lane are
# steady.  Lane A recalibrates the built-in Spiffy graphs first, because the report decodes
# with them.  Each step's log goes to $LOGS (default /tmp/dloom-regenerate).  Afterwards,
# update the figures quoted in prose (README, docs/strategies*.md, docs/benchmarks/*.md,
# docs/zoo.md) from the JSON files this wrote; tests/test_docs.py checks the generated
# headline tables against benchmarks/results/report.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
logs=${LOGS:-/tmp/dloom-regenerate}
mkdir -p "$logs"
results=benchmarks/results

step() {  # step NAME COMMAND...: run one command, its output in $logs/NAME.log
    local name=$1
    shift
    echo "[$(date +%H:%M:%S)] start $name"
    "$@" >"$logs/$name.log" 2>&1 || { echo "FAILED: $name (see $logs/$name.log)"; return 1; }
    echo "[$(date +%H:%M:%S)] done  $name"
}

lane_a() {
    step graphs bash plugins/dloom_plugins/spiffy/graphs/make_graphs.sh
    step report python -m benchmarks.report -n 140 --micro
    step spiffy python -m benchmarks.bench_spiffy -n 70 --calibration-n 70 --budgets 3,5,8,10 --pruned 3,5 \
        --out "$results/spiffy_n70.json"
}

lane_b() {
    step zoo-dllm-quota sh -c "dloom eval --model toy-dllm --strategy quota -n 500 --json > $results/zoo_dllm_quota_n500.json"
    step zoo-dllm-threshold sh -c "dloom eval --model toy-dllm --strategy threshold --param tau=0.9 -n 500 --json \
        > $results/zoo_dllm_threshold_n500.json"
    step zoo-ar sh -c "dloom eval --strategy failfast --target toy-ar -n 500 --json > $results/zoo_ar_n500.json"
    step zoo-ar-small sh -c "dloom eval --strategy failfast --target toy-ar-small -n 500 --json \
        > $results/zoo_ar_small_n500.json"
    step sweep python -m benchmarks.sweep_commit_rules --model toy-dllm -n 500 --json "$results/commit_rules_n500.json" \
        --plot docs/assets/commit_rules.png --table docs/benchmarks/commit_rules.md
    step failfast python -m benchmarks.bench_failfast -n 70 --repeats 2
    step cache-b32 python -m benchmarks.bench_cache -n 350 --repeats 1 --lengths short --block-length 32 \
        --refresh 4 --refresh 8 --refresh 16 --threads 1 --json "$results/cache_quota_b32_refresh_n350.json"
    step cache-b8 python -m benchmarks.bench_cache -n 350 --repeats 1 --lengths short --block-length 8 \
        --refresh 2 --refresh 4 --threads 1 --json "$results/cache_quota_b8_refresh_n350.json"
    step cache-threshold python -m benchmarks.bench_cache -n 350 --repeats 1 --lengths short --block-length 32 \
        --strategy threshold --param tau=0.9 --refresh 2 --threads 1 \
        --json "$results/cache_threshold_b32_refresh_n350.json"
    step cache-speed python -m benchmarks.bench_cache -n 70 --repeats 3 --block-length 8 --threads 1 \
        --json "$results/cache_quota_b8_speed_n70.json"
}

lane_a & a=$!
lane_b & b=$!
status=0
wait $a || status=1
wait $b || status=1
exit $status
