#!/usr/bin/env bash
# One short lease of a GPU machine, prepared ahead (a lease is minutes long): the GPU tests, the CUDA
# accuracy bench estimated again on its kept measured peaks (the caching allocator's peaks are
# deterministic for the same torch, driver and GPU; the presets and advisor/training.py must not have
# changed since they were measured), and the largest batch under a cap, measured afresh. Everything
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
START=$SECONDS
timeout "${TEST_TIMEOUT_S:-300}" "$PY" -m pytest -p no:cacheprovider -m gpu tests/advisor/test_estimate_gpu.py \
    tests/probes/test_trial_gpu.py tests/probes/test_bench_gpu.py tests/advisor/test_hardware.py \
    tests/advisor/test_export.py >> "$log" 2>&1
echo "pytest rc $? in $((SECONDS - START)) s" >> "$log"

# The accuracy cases and the largest-batch search run side by side (the first mostly traces on the
# host's CPUs; each measurement is a process of its own with its own peaks), into separate files and
# separate data dirs (no run's filed peaks refine the other's estimates; the tests make their own).
cp bench/results/accuracy-cuda.json "$OUT/accuracy-cuda.json"
START=$SECONDS
ADVISOR_DATA_DIR=$(mktemp -d) "$PY" bench/estimate_accuracy_cuda.py --out "$OUT/accuracy-cuda.json" --resume --reestimate --jobs "${JOBS:-8}" \
    --skip maxbatch > "$OUT/accuracy.log" 2>&1 &
ADVISOR_DATA_DIR=$(mktemp -d) "$PY" bench/estimate_accuracy_cuda.py --out "$OUT/maxbatch-cuda.json" --skip accuracy > "$OUT/maxbatch.log" 2>&1 &
wait
echo "benches done in $((SECONDS - START)) s" >> "$log"
