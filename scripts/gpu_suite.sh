#!/usr/bin/env bash
# The GPU machine in one call: GPU tests in parallel groups, compute-sanitizer memcheck, the benchmark
# drivers; everything under $OUT as one archive (gpu-suite.tgz) plus the rows measured (results.jsonl);
# a short table last.
#
#   bash scripts/gpu_suite.sh                 # tests, then memcheck, then benchmarks while time is left
#   bash scripts/gpu_suite.sh tests           # tests + memcheck only
#   bash scripts/gpu_suite.sh bench           # benchmarks only (one driver at a time: timings must not overlap)
#   bash scripts/gpu_suite.sh --dry-run       # on a CPU: collect the GPU tests, run every driver on tiny shapes
#
# Carry (see scripts/peers_env.sh): .whl (FlashMLA), .peers (FlashInfer); for another Triton release set
# TRITON_BUNDLE=.carry/triton-3.8.0.tar.xz.  Time: the benchmarks run within BUDGET seconds from the start
# (default 570); each test group gets GROUP_TIMEOUT and memcheck MEMCHECK_TIMEOUT (default GROUP_TIMEOUT; both
# 420 without a BUDGET).  BUDGET given by the caller bounds those too (a machine with a per-command limit: set
# BUDGET below it and the archive is still written): a step then gets its own limit, if one was given, or what is
# left of BUDGET less RESERVE (default 20 s) for the archive, whichever is less, and a step with less than 30 s
# left is skipped (the summary says so).  The reliability group's random-case test runs 10,000 cases by default,
# more than one 600 s command holds (test_property_gpu.py): in such a call set RELIAB_GPU_CASES (e.g. 3000 with
# RELIAB_GPU_PROCS=6, about 250 s) and merge the summaries of several calls.  The archive holds the logs, the
# rows, the reliability summaries ($OUT/reliability) and the sanitizer's logs.  PYTEST_N spreads each group over
# pytest-xdist workers (PYTEST_N_<group> for one group; default: a share of the cores per group, see
# default_workers; 0: one process); TEST_GROUPS picks groups, ";" between
# phases that run one after the other (default: sm90 and movement, then attention, system and other, then
# reliability alone); MEMCHECK=0 leaves memcheck out.  BENCH picks drivers (default
# "decode small_batch prefill movement host_overhead"); BENCH_FORMATS narrows their formats; BENCH_ARGS (every
# driver) and BENCH_ARGS_<driver> add arguments; SPARSEMLA_COMMIT=<sha> names the commit in the rows when the
# copy of the tree has no git history.  Afterwards, on your machine:
#   cat <files_at>/results.jsonl >> benchmarks/results/h200.jsonl && python3 benchmarks/render.py  (h100.jsonl: H100)
set -u
MODE=all; DRY=0
for arg in "$@"; do
    case "$arg" in
        tests|bench|all) MODE=$arg ;;
        --dry-run) DRY=1 ;;
        *) echo "usage: $0 [tests|bench|all] [--dry-run]"; exit 2 ;;
    esac
done
# exported: the GPU tests write their summaries under $OUT/reliability
export OUT=${OUT:-./gpu-out}; mkdir -p "$OUT/logs"
START=$(date +%s)
BUDGET_GIVEN=${BUDGET:+1}
BUDGET=${BUDGET:-570}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# seconds a test step may run: its own limit, or with a BUDGET given the budget left less the archive's reserve
# if that is less; "skip" below 30 s
step_limit() {
    local own=$1 l
    l=$(( $(left) - ${RESERVE:-20} ))
    { [ "$DRY" = 1 ] || [ -z "$BUDGET_GIVEN" ]; } && l=$own
    if [ "$l" -lt 30 ]; then echo skip; elif [ "$l" -lt "$own" ]; then echo "$l"; else echo "$own"; fi
}
# a step's own limit when the caller gives none: 420 s, or with a BUDGET given the whole budget (step_limit then
# bounds it by what is left: a reliability group alone in one call was cut at 420 s of a 555 s budget)
own_default() {
    if [ -n "$BUDGET_GIVEN" ]; then echo "$BUDGET"; else echo 420; fi
}
if [ "$DRY" = 1 ]; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
else
    # sourced here, not in a pipeline (a pipeline would source it in a subshell and lose its exports)
    source scripts/peers_env.sh > "$OUT/logs/env.txt" 2>&1
    cat "$OUT/logs/env.txt"
fi
RESULTS="$OUT/results.jsonl"
SUMMARY="$OUT/logs/summary.tsv"
: > "$SUMMARY"

note() {  # name rc seconds log
    local line counts
    line=$(grep -E "[0-9]+ (passed|failed|error)|[0-9]+ tests? collected|ERROR SUMMARY|rows ->|rows \(" "$4" 2>/dev/null | tail -1)
    printf "%s\t%s\t%s\t%s\n" "$1" "$2" "$3" "${line:-(no summary line)}" >> "$SUMMARY"
}
skipped() {  # name why
    printf "%s\tskipped\t0\t%s\n" "$1" "$2" >> "$SUMMARY"
}

# ---- GPU tests: groups in parallel (kernel compiles dominate; the GPU work is small) ---------------------
existing() { for f in "$@"; do [ -f "$f" ] && echo "$f"; done; }
group_files() {
    case $1 in
        attention)   existing tests/gpu/test_sparse_attention_gpu.py ;;
        sm90)        ls tests/gpu/test_ws_*_gpu.py tests/gpu/test_fp8*_gpu.py tests/gpu/test_sm90*_gpu.py 2>/dev/null ;;
        movement)    existing tests/gpu/test_movement_gpu.py ;;
        system)      ls tests/gpu/test_runner_gpu.py tests/gpu/test_host_entry_gpu.py tests/gpu/test_layer_gpu.py \
                        tests/gpu/test_cli_gpu.py \
                        tests/gpu/test_vllm*_gpu.py 2>/dev/null ;;
        reliability) ls tests/gpu/test_property_gpu.py tests/gpu/test_graph_long_gpu.py \
                        tests/gpu/test_large_cache_gpu.py 2>/dev/null ;;
    esac
}
ALL_GROUPS="attention sm90 movement system reliability"
# Groups separated by ";" run as phases, one after the other; the groups of a phase run side by side.  By
# default the sm_90 group (the most compiles) first with the movement group, then the rest; the reliability
# group's tests hold tens of GB of GPU memory each: by default it runs alone, after the others; memcheck runs last.
TEST_GROUPS=${TEST_GROUPS:-"sm90 movement; attention system other; reliability"}  # MEMCHECK=0 skips memcheck
# pytest-xdist workers per group when neither PYTEST_N_<group> nor PYTEST_N says (0: one process): the compiles
# are what takes the time, so the sm_90 group, which runs first beside the short movement group, gets most of
# the cores (16 cores: sm90 12 in 118 s and movement 2 in 41 s cold; attention 8 in 46 s)
default_workers() {
    [ "$HAVE_XDIST" = 1 ] || { echo 0; return; }
    local c; c=$(nproc)
    at_least_1() { echo $(( $1 > 1 ? $1 : 1 )); }
    case $1 in
        sm90) at_least_1 $(( c * 3 / 4 )) ;;
        movement) at_least_1 $(( c / 8 )) ;;
        attention|system) at_least_1 $(( c / 2 )) ;;
        reliability) at_least_1 $(( c / 4 < 3 ? c / 4 : 3 )) ;;
        *) echo 0 ;;
    esac
}
HAVE_XDIST=0
python3 -c "import xdist" 2>/dev/null && HAVE_XDIST=1
run_group() {  # one group's pytest run, in the background; its pid appended to PIDS
    local g=$1 files log="$OUT/logs/t_$1.log"
    if [ $g = other ]; then files=$OTHER; else files=$(group_files $g); fi
    [ -n "$files" ] || return 0
    local lim
    lim=$(step_limit "${GROUP_TIMEOUT:-$(own_default)}")
    if [ "$lim" = skip ]; then
        skipped "t_$g" "no time left in BUDGET"; return 0
    fi
    (
        t0=$(date +%s)
        if [ "$DRY" = 1 ]; then
            python3 -m pytest -q -m gpu --collect-only $files > "$log" 2>&1
        else
            # PYTEST_N=<workers>: each group spread over that many pytest-xdist workers (compiles in parallel);
            # PYTEST_N_<group> overrides it for one group
            nvar="PYTEST_N_$g"
            n=${!nvar:-${PYTEST_N:-$(default_workers $g)}}
            [ "$n" = 0 ] && n=
            # under setsid (its own process group): at the time limit every process of the group goes and is waited for,
            # pytest-xdist's workers included (still tearing down tens of GB of GPU memory, they made the next
            # phase's allocations fail)
            setsid timeout "$lim" python3 -m pytest -q -m gpu -rs --durations=15 ${n:+-n $n} \
                $files > "$log" 2>&1 &
            sid=$!
            wait $sid
        fi
        rc=$?
        if [ "$DRY" = 0 ]; then
            pkill -9 -s "$sid" 2>/dev/null
            for _ in $(seq 60); do pgrep -s "$sid" > /dev/null || break; sleep 0.5; done
        fi
        note "t_$g" $rc $(( $(date +%s) - t0 )) "$log"
    ) &
    PIDS+=($!)
}
run_tests() {
    local listed phases phase
    listed=$(for g in $ALL_GROUPS; do group_files $g; done)
    OTHER=$(ls tests/gpu/test_*_gpu.py 2>/dev/null | grep -vxF "$listed" || true)
    IFS=';' read -ra phases <<< "$TEST_GROUPS"
    for phase in "${phases[@]}"; do
        PIDS=()
        for g in $phase; do run_group "$g"; done
        [ ${#PIDS[@]} -gt 0 ] && wait "${PIDS[@]}"
    done
    # memcheck after the tests, not beside them: its four runs take GPU memory and time the tests then lack (one
    # run with memcheck beside the groups: 50 of the attention group's tests failed to allocate; none without)
    if [ "${MEMCHECK:-1}" = 1 ]; then
        local t0=$(date +%s) log="$OUT/logs/memcheck.log" rc lim
        lim=$(step_limit "${MEMCHECK_TIMEOUT:-${GROUP_TIMEOUT:-$(own_default)}}")
        if [ "$DRY" = 1 ]; then
            echo "dry run: memcheck left out (needs a GPU and compute-sanitizer)" > "$log"; rc=0
        elif [ "$lim" = skip ]; then
            skipped memcheck "no time left in BUDGET"; return 0
        else
            # four processes for sanitize_kernels.py, the rest beside them (one process: 222 s for that driver
            # alone, and the step's limit cut the other two runs; four: all six runs in 118 s)
            OUT="$OUT/sanitize" SANITIZE_SHARDS=${SANITIZE_SHARDS:-4} timeout "$lim" bash scripts/sanitize.sh memcheck \
                > "$log" 2>&1; rc=$?
        fi
        note memcheck $rc $(( $(date +%s) - t0 )) "$log"
    fi
}

# ---- benchmarks: one driver at a time, each within the time left --------------------------------------
run_bench() {
    local drivers=${BENCH:-"decode small_batch prefill movement host_overhead"}
    for d in $drivers; do
        local extra=() log="$OUT/logs/b_$d.log" t0 lim
        if [ "$DRY" = 1 ]; then
            extra=(--dry-run)
            case $d in
                decode) extra+=(--formats bf16,fp8_ds_mla --heads 16) ;;
                small_batch) extra+=(--formats fp8 --batches 1 --heads 16) ;;
                prefill) extra+=(--formats fp8_ds_mla --heads 16) ;;
                movement) extra+=(--formats fp8 --only gather,convert) ;;
            esac
        elif [ -n "${BENCH_FORMATS:-}" ] && [ "$d" != host_overhead ]; then
            extra=(--formats "$BENCH_FORMATS")
        fi
        # BENCH_ARGS: more arguments for every driver (e.g. --no-peers); BENCH_ARGS_<driver>: for one driver
        local own="BENCH_ARGS_$d"
        [ "$DRY" = 1 ] || extra+=(${BENCH_ARGS:-} ${!own:-})
        lim=$(left)
        if [ "$DRY" = 0 ] && [ "$lim" -lt 30 ]; then
            skipped "b_$d" "no time left"; continue
        fi
        t0=$(date +%s)
        timeout $(( lim > 30 ? lim - 10 : 20 )) python3 "benchmarks/$d.py" --results "$RESULTS" "${extra[@]}" \
            > "$log" 2>&1
        note "b_$d" $? $(( $(date +%s) - t0 )) "$log"
    done
}

[ "$MODE" = bench ] || run_tests
[ "$MODE" = tests ] || run_bench

python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0], 'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')" > "$OUT/logs/versions.txt" 2>&1
{ [ -n "${SPARSEMLA_COMMIT:-}" ] && echo "$SPARSEMLA_COMMIT"; } > "$OUT/logs/commit.txt" || git rev-parse HEAD > "$OUT/logs/commit.txt" 2>/dev/null || true
# the reliability tests' JSON summaries and the sanitizer's logs too: a call brings back at most 8 files, and a
# property run alone writes one summary per process
tar czf "$OUT/gpu-suite.tgz" -C "$OUT" logs $( [ -f "$RESULTS" ] && echo results.jsonl ) \
    $(cd "$OUT" && for d in reliability sanitize; do [ -d "$d" ] && echo "$d"; done)
echo
echo "== $(cat "$OUT/logs/versions.txt"); $(( $(date +%s) - START )) s"
printf "%-16s %-8s %6s  %s\n" step rc seconds summary
sort "$SUMMARY" | while IFS=$'\t' read -r name rc secs line; do
    printf "%-16s %-8s %6s  %s\n" "$name" "$rc" "$secs" "$line"
done
if [ -f "$RESULTS" ]; then echo "rows measured: $(wc -l < "$RESULTS") in $RESULTS"; fi
