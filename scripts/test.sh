#!/usr/bin/env bash
# The README's test command (also run by CI): set up if needed, then the default (non-slow) suite, offline.
# BST_VENV=DIR runs it in another environment, set up by the caller (scripts/test_oldest.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BST_VENV:-}" ]; then
    bash scripts/setup.sh
fi
. "${BST_VENV:-.venv}/bin/activate"
# Tests run in parallel worker processes (pytest-xdist): one per core, at most 4. BST_TEST_WORKERS=0 runs them in this
# process; "-n N" among the arguments overrides it too. (The cores counted before OMP_NUM_THREADS is set: nproc reads it.)
CORES="$(env -u OMP_NUM_THREADS nproc)"
WORKERS="${BST_TEST_WORKERS:-$(( CORES < 4 ? CORES : 4 ))}"
# One thread per test process, the processes tests start (training runs, torchrun, benchmarks' dry runs) included: the
# models are tiny, and a second OpenMP thread per process only contends with the other workers for the cores.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
python -m pytest -q -m "not slow" -p no:cacheprovider -n "$WORKERS" "$@"
