#!/usr/bin/env bash
# Does BST work with the newest transformers on the package index? Installs it, unpinned, with this package's other
# requirements into a throw-away environment, runs the model, generation and transformers' common tests there, and
# writes a report of what broke. Never touches .venv; the exit status is 0 whatever broke (the report says it).
#   bash scripts/check_newest_transformers.sh [--if-newer] [REPORT]
# --if-newer (CI): do nothing unless the index has a release beyond setup.cfg's upper pin (a few seconds: one
# `pip index versions`). REPORT: default outputs/newest-transformers.md. BST_INDEX_VERSIONS=TEXT stands in for
# `pip index versions transformers`' output and BST_CHECK_DRY_RUN=1 stops after the decision (tests).
set -uo pipefail
cd "$(dirname "$0")/.."
if_newer=0
if [ "${1:-}" = --if-newer ]; then if_newer=1; shift; fi
report="${1:-outputs/newest-transformers.md}"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python  # any python with pip lists the index
listing="${BST_INDEX_VERSIONS:-$($py -m pip index versions transformers 2>/dev/null)}"
if [ -z "$listing" ]; then
    echo "check_newest_transformers: could not list transformers' versions on the index; nothing checked"
    exit 0
fi
if [ "$if_newer" = 1 ]; then
    version="$(printf '%s\n' "$listing" | python3 scripts/newest_transformers.py newer)"
    if [ -z "$version" ]; then
        echo "check_newest_transformers: no transformers release beyond setup.cfg's pin; nothing to check"
        exit 0
    fi
else
    version="$(printf '%s\n' "$listing" | python3 scripts/newest_transformers.py newest)"
fi
echo "check_newest_transformers: checking transformers $version"
[ "${BST_CHECK_DRY_RUN:-0}" = 1 ] && exit 0

venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
mapfile -t requirements < <(python3 scripts/newest_transformers.py requirements)
log="$(dirname "$venv")/pip.log"
# torch pinned as scripts/setup.sh pins it; the package itself without dependencies (its pin excludes $version).
if ! "$venv/bin/pip" install --progress-bar off torch==2.13.0 "transformers==$version" "${requirements[@]}" >"$log" 2>&1 \
    || ! "$venv/bin/pip" install --no-deps -e . >>"$log" 2>&1; then
    mkdir -p "$(dirname "$report")"
    { echo "# transformers $version: the install failed"; echo; echo '```'; tail -40 "$log"; echo '```'; } >"$report"
    echo "check_newest_transformers: the install failed; see $report"
    exit 0
fi
# The model, generation (generate, the cache API, assisted decoding) and transformers' common tests (fetched for
# $version by tests/hf_common/fetch.py), the default (non-slow) selection.
tests=(tests/models/bst/test_modeling_bst.py tests/models/bst/test_generation.py tests/models/bst/test_cache_api.py
    tests/models/bst/test_auto_classes.py tests/models/bst/test_forward_contract.py tests/models/bst/test_hf_common.py)
out="$(dirname "$venv")/pytest.txt"
cores="$(env -u OMP_NUM_THREADS nproc)"
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 \
    "$venv/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider -n "$(( cores < 4 ? cores : 4 ))" -rfE \
    --tb=line -W "always::FutureWarning" "${tests[@]}" >"$out" 2>&1
rc=$?
mkdir -p "$(dirname "$report")"
{
    echo "# BST with transformers $version (setup.cfg accepts $(grep -o 'transformers[^ ]*' setup.cfg | head -1))"
    echo
    echo "pytest exit status $rc (0: nothing broke); $(tail -1 "$out")"
    echo
    echo "## What broke"
    echo
    echo '```'
    grep -E '^(FAILED|ERROR) ' "$out" || echo "nothing"
    echo '```'
    echo
    echo "## Deprecations announced for BST's code paths (docs/development.md: transformers' announced removals)"
    echo
    echo '```'
    grep -E 'FutureWarning|DeprecationWarning' "$out" | grep -E 'past_key_values|cache_position|cache' | sort | uniq -c \
        | head -20 || true
    echo '```'
    echo
    echo "## The last lines of the run"
    echo
    echo '```'
    tail -60 "$out"
    echo '```'
} >"$report"
echo "check_newest_transformers: pytest exit status $rc; report: $report"
exit 0
