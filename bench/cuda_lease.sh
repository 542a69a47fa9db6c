#!/usr/bin/env bash
# One short lease of a GPU machine, prepared ahead (a lease is minutes long): the CUDA accuracy bench
# estimated again on the measured peaks kept from this GPU and torch (the caching allocator's peaks are
# deterministic for the same torch, driver and GPU; the presets and advisor/training.py must not have
# changed since they were measured), the cases not kept measured for ACC_BUDGET_S; the largest batch
# under a cap, measured afresh; optionally real allocator events of PEAK_CASES; then the GPU tests
# (GPU_TESTS: which files). Each part has a timeout (TEST_TIMEOUT_S, BENCH_TIMEOUT_S) so that the call
# ends inside the lease. Everything
# lands under $OUT (default: bench/results/cuda-lease); nothing in bench/results is overwritten.
#
#   OUT=/somewhere bash bench/cuda_lease.sh
#
# Where the machine's Python lacks our dependencies (an image that cannot install packages), carry
# them as wheels in .whl/ (cp312 manylinux builds of pydantic, pydantic-core, pydantic-settings,
# sqlalchemy, greenlet, alembic, mako, optuna, colorlog, python-dotenv, annotated-types,
# typing-inspection, typing-extensions): they are installed under /tmp/site first. torch is the machine's own.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/cuda-lease}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
log="$OUT/gpu-tests.log"
{
    date -u; nvidia-smi -L; nproc
    "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
} > "$log" 2>&1
# The kept peaks hold only for the GPU and torch they were measured with: of the accuracy-cuda*.json in
# bench/results measured on this card and torch, the one with the most measured cases is estimated again on
# its peaks, and its cases not reached then are measured now; without one, the cases are measured afresh.
# Either way for at most ACC_BUDGET_S.
kept=$("$PY" - <<'PYEOF'
import glob, json, torch
here = (torch.cuda.get_device_name(0), torch.__version__)
runs = [(sum(1 for c in run["cases"] if c.get("reserved_bytes")), f) for f in sorted(glob.glob("bench/results/accuracy-cuda*.json"))
        for run in [json.load(open(f))] if (run["meta"]["device"], run["meta"]["torch"]) == here]
print(max(runs)[1] if runs else "")
PYEOF
)
if [ -n "$kept" ]; then
    cp "$kept" "$OUT/accuracy-cuda.json"
    echo "kept peaks of this card and torch: $kept (estimated again; its unreached cases measured)" >> "$log"
    acc_args="--resume --reestimate"
else
    echo "no kept peaks of this card and torch: measuring afresh" >> "$log"
    acc_args=""
fi

# The accuracy cases, the largest-batch search and (PEAK_CASES, space-separated workload:precision:optimizer:batch
# specs) bench/research/cuda_peak_blocks.py's real allocator events beside our traced sequence, side by side (each
# measurement is a process of its own with its own peaks), into separate files and separate data dirs (no
# run's filed peaks refine the other's estimates). Then the GPU tests: their OOM test fills the card (beside
# it, a case ran out of memory on the H200).
START=$SECONDS
# shellcheck disable=SC2086
ADVISOR_DATA_DIR=$(mktemp -d) timeout "${BENCH_TIMEOUT_S:-480}" "$PY" bench/estimate_accuracy_cuda.py \
    --out "$OUT/accuracy-cuda.json" $acc_args --budget-s "${ACC_BUDGET_S:-240}" --jobs "${JOBS:-8}" --skip maxbatch \
    > "$OUT/accuracy.log" 2>&1 &
ADVISOR_DATA_DIR=$(mktemp -d) timeout "${BENCH_TIMEOUT_S:-480}" "$PY" bench/estimate_accuracy_cuda.py \
    --out "$OUT/maxbatch-cuda.json" --skip accuracy > "$OUT/maxbatch.log" 2>&1 &
if [ -n "${PEAK_CASES:-}" ]; then
    peak_args=()
    for c in $PEAK_CASES; do peak_args+=(--case "$c"); done
    ADVISOR_DATA_DIR=$(mktemp -d) timeout "${BENCH_TIMEOUT_S:-480}" "$PY" bench/research/cuda_peak_blocks.py \
        --events "$OUT/events" --out "$OUT/peaks.jsonl" "${peak_args[@]}" > "$OUT/peaks.log" 2>&1 &
fi
wait
# a run hands back a limited number of files: the events travel as one archive
if [ -d "$OUT/events" ]; then
    tar czf "$OUT/events.tgz" -C "$OUT" events && rm -rf "$OUT/events"
fi
echo "benches done in $((SECONDS - START)) s" >> "$log"
START=$SECONDS
# shellcheck disable=SC2086
timeout "${TEST_TIMEOUT_S:-300}" "$PY" -m pytest -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/advisor/test_estimate_gpu.py \
    tests/probes/test_trial_gpu.py tests/probes/test_bench_gpu.py tests/advisor/test_hardware.py \
    tests/advisor/test_export.py} > "$OUT/pytest.log" 2>&1
echo "pytest rc $? in $((SECONDS - START)) s" >> "$log"
