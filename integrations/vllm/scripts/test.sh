#!/usr/bin/env bash
# Runs the vLLM plugin's tests (greedy parity with generate(), offline and through the server) in the plugin's
# venv (scripts/setup.sh). Usage: integrations/vllm/scripts/test.sh [venv-dir] [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
shift || true
if [ ! -x "$VENV/bin/python" ]; then
  echo "no vLLM venv at $VENV: run integrations/vllm/scripts/setup.sh first" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Run from the plugin's folder: the repository's own pytest configuration and conftest belong to the main venv.
cd "$ROOT/integrations/vllm"
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q tests "$@"
