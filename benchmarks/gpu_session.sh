#!/usr/bin/env bash
# Everything a session with a GPU machine should run, in order of value, in one call
# (a lent machine is billed from its start; ~2 min for steps 1-2, the suite after).
# Logs go to $OUT when it is set (the device tool's folder), else to ./gpu_logs.
#
# The machine's image holds torch, pytest, hypothesis and scikit-learn but not optree:
# carry its wheel in .whl/ (pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl optree), which this
# script installs into /tmp/site. Its pytest-benchmark plugin warns under xdist, which
# the suite's filterwarnings=error turns into an INTERNALERROR: -p no:benchmark.
set -u
export PYTHONUNBUFFERED=1
out=${OUT:-gpu_logs}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 3
fi
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count(), 'GPU(s)')"
python3 -c "import mirrored" || exit 4
echo "=== 1. gpu_check (figures for the README)"
timeout "${GPU_CHECK_SECONDS:-300}" python3 benchmarks/gpu_check.py --breakdown 2>&1 | tee "$out/gpu_check.log"
echo "=== 2. the CUDA tests"
timeout "${CUDA_TESTS_SECONDS:-200}" python3 -m pytest -q -p no:cacheprovider -p no:benchmark -rfE \
    tests/test_cuda.py tests/test_gpu_check.py tests/test_distributed_dataset.py \
    tests/test_devices.py tests/test_cross_device_ops.py tests/test_gradients.py \
    > "$out/cuda_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$out/cuda_tests.log" | tail -20
echo "=== 3. the whole suite (names of failures with -rfE)"
timeout "${SUITE_SECONDS:-480}" python3 -m pytest -q -p no:cacheprovider -p no:benchmark -rfE \
    -n "${SUITE_WORKERS:-12}" --dist loadfile --maxfail=50 tests src/mirrored \
    > "$out/full_suite.log" 2>&1
echo "rc=$?"
grep -E "passed|failed|^FAILED|^ERROR" "$out/full_suite.log" | tail -60
