#!/usr/bin/env bash
# compute-sanitizer over every kernel of the library, on the GPU machine.
#
#   bash scripts/sanitize.sh [TOOL ...]        TOOL: memcheck racecheck synccheck (default: all three), initcheck
#
# Drivers:
#   memcheck              tests/gpu/sanitize_kernels.py (when present), tests/helpers/reliab_sanitize.py and the vLLM
#                         contract's short run (tests/gpu/test_vllm_contract_gpu.py -k sanitizer: eager calls against
#                         CUDA-graph replay, every format at 16 and 128 heads)
#   racecheck, synccheck  tests/helpers/reliab_sanitize.py
# reliab_sanitize.py runs its --tiny set (every kernel, the FP8-QK variants and the combine after each, one
# small call per variant) unless SANITIZE_FULL=1 (more shapes, widths and modes: several times longer).
# Every run has PYTORCH_NO_CUDA_MEMORY_CACHING=1 (PyTorch's caching allocator hides out-of-bounds accesses
# inside its segments).  Logs go to $OUT/sanitize/ (default ./out/sanitize/): <tool>-<driver>.log holds the
# sanitizer's report, <tool>-<driver>.out the driver's own output.  The last lines printed are a table of
# errors per tool and driver; the exit status is 1 when any run found an error, failed or timed out.
#
# Environment: COMPUTE_SANITIZER (the binary; default: on PATH, else the newest /usr/local/cuda*/bin),
# PYTHON (default python3), SANITIZE_TIMEOUT (seconds per run, default 900), SANITIZE_SHARDS (> 1: memcheck's
# sanitize_kernels.py as four processes side by side, one per group of formats, with reliab_sanitize.py and the
# vLLM contract beside them; racecheck / synccheck / initcheck: reliab_sanitize.py as four such processes),
# SANITIZE_FULL, SANITIZE_ARGS
# (extra driver arguments, e.g. "--formats fp8_ds_mla,bf16 --sections attention").
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-./out}/sanitize"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
TIMEOUT="${SANITIZE_TIMEOUT:-900}"
EXTRA="${SANITIZE_ARGS:-}"
[ "${SANITIZE_FULL:-0}" = 1 ] || EXTRA="--tiny $EXTRA"
CS="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}"
if [ -z "$CS" ]; then
    CS="$(ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | sort -V | tail -1)"
fi
if [ -z "$CS" ] || [ ! -x "$CS" ]; then
    echo "sanitize.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
    exit 2
fi
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TOOLS=("$@")
[ ${#TOOLS[@]} -eq 0 ] && TOOLS=(memcheck racecheck synccheck)

ROWS=()
STATUS=0
TOTAL=0

# run TOOL NAME COMMAND...: one sanitizer run, its row of the table
run() {
    local tool=$1 name=$2
    shift 2
    local log="$OUT_DIR/$tool-$name.log" out="$OUT_DIR/$tool-$name.out"
    local extra=()
    [ "$tool" = racecheck ] && extra=(--racecheck-report all)
    local t0=$SECONDS
    timeout "$TIMEOUT" "$CS" --tool "$tool" ${extra[@]+"${extra[@]}"} --error-exitcode 9 --print-limit 10000 \
        --log-file "$log" "$@" >"$out" 2>&1
    local rc=$? secs=$((SECONDS - t0))
    local errors warnings
    errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$log" 2>/dev/null | tail -1 | grep -Eo '[0-9]+' || true)
    if [ "$tool" = racecheck ]; then
        # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
        local rs
        rs=$(grep -E 'RACECHECK SUMMARY' "$log" 2>/dev/null | tail -1)
        [ -z "$errors" ] && errors=$(echo "$rs" | grep -Eo '[0-9]+ errors' | grep -Eo '[0-9]+' || true)
        warnings=$(echo "$rs" | grep -Eo '[0-9]+ warnings' | grep -Eo '[0-9]+' || true)
    fi
    # Triton >= 3.8 loads a kernel with more than 48 KB of shared memory by first trying
    # cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_SHARED_MEMORY_MODE, ...), which returns CUDA_ERROR_INVALID_VALUE on this
    # driver, and then the older call that works: the sanitizer counts the refused probe as an API error, once per
    # kernel loaded.  Those are counted apart ("probes") and are not errors of the library's kernels.
    local probes
    probes=$(grep -Ec 'CUDA_ERROR_INVALID_VALUE .*on CUDA API call to cuFuncSetAttribute' "$log" 2>/dev/null || true)
    if [ -n "$errors" ] && [ "${probes:-0}" -gt 0 ]; then errors=$((errors - probes)); fi
    local failed
    failed=$(grep -Eo 'driver: [0-9]+ failed calls' "$out" | grep -Eo '[0-9]+' | head -1 || true)
    local verdict=ok
    if [ $rc -eq 124 ]; then verdict=timeout; fi
    if [ -z "$errors" ]; then errors="?"; [ "$verdict" = ok ] && verdict="no-summary"; fi
    if [ "$errors" != "?" ] && [ "$errors" -gt 0 ]; then verdict=errors; fi
    # exit 9 is the sanitizer's "errors found", which the probes alone also cause
    if [ $rc -ne 0 ] && [ "$verdict" = ok ] && ! { [ $rc -eq 9 ] && [ "$errors" = 0 ]; }; then verdict="exit-$rc"; fi
    [ "$verdict" = ok ] || STATUS=1
    TOTAL=$((TOTAL + ${errors//\?/0}))
    ROWS+=("$(printf '%-10s %-18s %6s %6s %8s %9s %6ss  %s' "$tool" "$name" "$errors" "${probes:-0}" \
        "${warnings:--}" "${failed:--}" "$secs" "$verdict")")
    echo "${ROWS[-1]}"
}

# vllm_contract TOOL: the vLLM contract's eager-against-graph short run under TOOL
vllm_contract() {
    [ -f tests/gpu/test_vllm_contract_gpu.py ] || return 0
    run "$1" vllm_contract "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_vllm_contract_gpu.py -k sanitizer
}

# reliab TOOL [NAME FORMATS]: tests/helpers/reliab_sanitize.py under TOOL (every tool runs it), over FORMATS only
# when given
reliab() {
    if [ $# -gt 1 ]; then
        # shellcheck disable=SC2086
        run "$1" "$2" "$PY" tests/helpers/reliab_sanitize.py $EXTRA --formats "$3"
    else
        # shellcheck disable=SC2086
        run "$1" reliab_sanitize "$PY" tests/helpers/reliab_sanitize.py $EXTRA
    fi
}

# the formats in four groups, for SANITIZE_SHARDS > 1 (one process per group)
FORMAT_GROUPS=(bf16,bf16-nope fp8,fp8-nope fp8_ds_mla,fp8_ds_mla-nope nvfp4_ds_mla,nvfp4_ds_mla-nope)
# side NAME FUNCTION ARGS...: a run in the background (the runs are compile- and instrumentation-bound, one CPU
# core each); its table row goes to $OUT_DIR/row-NAME until `collect`
side() {
    local name=$1
    shift
    ( "$@" > "$OUT_DIR/row-$name" ) &
}
# collect: after `wait`, the rows of the runs `side` started, into the table and the totals
collect() {
    local f row
    for f in "$OUT_DIR"/row-*; do
        [ -s "$f" ] || continue
        row=$(tail -1 "$f"); echo "$row"; ROWS+=("$row")
        set -- $row
        [ "$3" = "?" ] || TOTAL=$((TOTAL + $3))
        [ "${!#}" = ok ] || STATUS=1
        rm -f "$f"
    done
}

for tool in "${TOOLS[@]}"; do
    case "$tool" in
        memcheck)
            if [ -f tests/gpu/sanitize_kernels.py ] && [ "${SANITIZE_SHARDS:-1}" -gt 1 ]; then
                # sanitize_kernels.py one group of formats a process; reliab_sanitize.py (all formats) and the vLLM
                # contract beside them (each about as long as the longest group)
                for g in "${FORMAT_GROUPS[@]}"; do
                    side "sk_${g%%,*}" run memcheck "sk_${g%%,*}" "$PY" tests/gpu/sanitize_kernels.py --formats "$g"
                done
                side reliab_sanitize reliab memcheck
                side vllm_contract vllm_contract memcheck
                wait
                collect
            else
                if [ -f tests/gpu/sanitize_kernels.py ]; then
                    run memcheck sanitize_kernels "$PY" tests/gpu/sanitize_kernels.py
                fi
                reliab memcheck
                vllm_contract memcheck
            fi
            ;;
        racecheck|synccheck|initcheck)
            if [ "${SANITIZE_SHARDS:-1}" -gt 1 ] && [[ " $EXTRA " != *" --formats "* ]]; then
                # reliab_sanitize.py one group of formats a process (every section in each: the ones that do not
                # depend on the format run four times, the short ones)
                for g in "${FORMAT_GROUPS[@]}"; do
                    side "rs_${g%%,*}" reliab "$tool" "rs_${g%%,*}" "$g"
                done
                wait
                collect
            else
                reliab "$tool"
            fi
            ;;
        *)
            echo "sanitize.sh: unknown tool $tool" >&2
            STATUS=1
            ;;
    esac
done

echo
echo "compute-sanitizer summary (logs in $OUT_DIR)"
printf '%-10s %-18s %6s %6s %8s %9s %7s  %s\n' tool driver errors probes warnings py-fails time verdict
for r in "${ROWS[@]}"; do echo "$r"; done
# what reliab_sanitize.py ran, per run (a run over some formats lists the other formats' kernels as not run)
grep -H -E '^(kernels (run|not run)|attention kernels)' "$OUT_DIR"/*-reliab_sanitize.out "$OUT_DIR"/*-rs_*.out 2>/dev/null |
    sed "s|^$OUT_DIR/||" | sort -u | cut -c1-2000
verdict=$([ $STATUS = 0 ] && echo clean || echo "NOT clean")
echo "sanitize.sh ERROR SUMMARY: $TOTAL errors in ${#ROWS[@]} runs ($verdict)"
exit $STATUS
