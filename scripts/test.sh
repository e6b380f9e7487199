#!/usr/bin/env bash
# The README's test command (also run by CI): set up if needed, then the default (non-slow) suite, offline.
# BST_VENV=DIR runs it in another environment, set up by the caller (scripts/test_oldest.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BST_VENV:-}" ]; then
    bash scripts/setup.sh
fi
. "${BST_VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Tests run in parallel worker processes (pytest-xdist; each test uses one torch thread): one per core, at most 4.
# BST_TEST_WORKERS=0 runs them in this process; "-n N" among the arguments overrides it too.
WORKERS="${BST_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}"
python -m pytest -q -m "not slow" -p no:cacheprovider -n "$WORKERS" "$@"
