#!/usr/bin/env bash
# The default test suite against the oldest transformers that setup.cfg accepts (5.23.0: it names the model cache
# `past_key_values`, 5.24 renamed it `cache`), in its own environment .venv-oldest/ (CI runs it after the README's
# test command, which gets the newest accepted version).
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=5.23.0
bash scripts/setup.sh .venv-oldest "transformers==$OLDEST"
.venv-oldest/bin/python -c "import transformers, sys; v = transformers.__version__; print('transformers', v); sys.exit(v != '$OLDEST')"
BST_VENV=.venv-oldest exec bash scripts/test.sh "$@"
