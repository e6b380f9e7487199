#!/usr/bin/env bash
# The default test suite against the oldest transformers that setup.cfg accepts (5.23.0: it names the model cache
# `past_key_values`, 5.24 renamed it `cache`), in its own environment .venv-oldest/ (CI runs it after the README's
# test command, which gets the newest accepted version).
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=5.23.0
if [ ! -x .venv-oldest/bin/python ]; then
    python3 -m venv .venv-oldest
fi
. .venv-oldest/bin/activate
python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[test,train]" "transformers==$OLDEST"
python -c "import transformers, sys; v = transformers.__version__; print('transformers', v); sys.exit(v != '$OLDEST')"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Tests run in parallel worker processes (pytest-xdist; each test uses one torch thread): one per core, at most 4.
# BST_TEST_WORKERS=0 runs them in this process; "-n N" among the arguments overrides it too.
WORKERS="${BST_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}"
python -m pytest -q -m "not slow" -p no:cacheprovider -n "$WORKERS" "$@"
