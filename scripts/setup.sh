#!/usr/bin/env bash
# Creates a virtual environment (default .venv) if missing and installs the package with its test/train extras, plus
# any REQUIREMENT given (scripts/test_oldest.sh: .venv-oldest with the oldest accepted transformers):
#   bash scripts/setup.sh [VENV [REQUIREMENT ...]]
# Idempotent: once an install has succeeded, later calls skip pip (~15 s) until setup.cfg, pyproject.toml, this script,
# the requirements or the checkout's path change (BST_SETUP_FORCE=1 reinstalls anyway; the code itself is installed
# editable, so edits need no reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
requirements=("${@:2}")
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
. "$venv/bin/activate"
stamp="$venv/.bst-setup-stamp"
want="$(cat setup.cfg pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $PWD ${requirements[*]}"
if [ "${BST_SETUP_FORCE:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
rm -f "$stamp"
# torch first and pinned: a looser spec would pull a multi-GB CUDA build.
python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[test,train]" "${requirements[@]}"
echo "$want" > "$stamp"
