#!/usr/bin/env bash
# One short lease of a GPU machine, prepared ahead (a lease is minutes long): the GPU tests, the CUDA
# accuracy bench estimated again on its kept measured peaks (the caching allocator's peaks are
# deterministic for the same torch, driver and GPU; the presets and advisor/training.py must not have
# changed since they were measured) or, on another GPU or torch, measured afresh for ACC_BUDGET_S,
# and the largest batch under a cap, measured afresh. Each part has a timeout (TEST_TIMEOUT_S,
# BENCH_TIMEOUT_S) so that the call ends inside the lease. Everything
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
# The kept peaks hold only for the GPU and torch they were measured with; on another card or torch
# the accuracy cases are measured afresh, as many as ACC_BUDGET_S allows (a lease is short).
kept=$("$PY" -c "import json; m = json.load(open('bench/results/accuracy-cuda.json'))['meta']; print(m['device'], m['torch'])")
here=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0), torch.__version__)")
if [ "$kept" = "$here" ]; then
    cp bench/results/accuracy-cuda.json "$OUT/accuracy-cuda.json"
    acc_args="--resume --reestimate"
else
    echo "kept peaks are of $kept, this is $here: measuring afresh for ${ACC_BUDGET_S:-240} s" >> "$log"
    acc_args="--budget-s ${ACC_BUDGET_S:-240}"
fi

# The GPU tests first (their OOM test fills the card: beside it, a case ran out of memory on the H200),
# then the accuracy cases and the largest-batch search side by side (each measurement is a process of
# its own with its own peaks), into separate files and separate data dirs (no run's filed peaks refine
# the other's estimates; the tests make their own).
START=$SECONDS
timeout "${TEST_TIMEOUT_S:-300}" "$PY" -m pytest -p no:cacheprovider -m gpu tests/advisor/test_estimate_gpu.py \
    tests/probes/test_trial_gpu.py tests/probes/test_bench_gpu.py tests/advisor/test_hardware.py \
    tests/advisor/test_export.py > "$OUT/pytest.log" 2>&1
echo "pytest rc $? in $((SECONDS - START)) s" >> "$log"
START=$SECONDS
# shellcheck disable=SC2086
ADVISOR_DATA_DIR=$(mktemp -d) timeout "${BENCH_TIMEOUT_S:-480}" "$PY" bench/estimate_accuracy_cuda.py \
    --out "$OUT/accuracy-cuda.json" $acc_args --jobs "${JOBS:-8}" --skip maxbatch > "$OUT/accuracy.log" 2>&1 &
ADVISOR_DATA_DIR=$(mktemp -d) timeout "${BENCH_TIMEOUT_S:-480}" "$PY" bench/estimate_accuracy_cuda.py \
    --out "$OUT/maxbatch-cuda.json" --skip accuracy > "$OUT/maxbatch.log" 2>&1 &
wait
echo "benches done in $((SECONDS - START)) s" >> "$log"
