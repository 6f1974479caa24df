#!/usr/bin/env bash
# The README's two commands: `bash tools/run.sh demo` (the main job) and `bash tools/run.sh test`.
# Both create ./.venv on first use and install everything the project needs into it.
set -euo pipefail
cd "$(dirname "$0")/.."

# torch 2.13.0 is the CPU build that CI's machines hold on local disk; override on a GPU box,
# e.g. TORCH_SPEC="torch" for the CUDA build, or SPANATTN_PYTHON=python3 to use an existing env.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PY=${SPANATTN_PYTHON:-.venv/bin/python}

setup() {
  if [ -n "${SPANATTN_PYTHON:-}" ]; then return; fi
  if [ ! -x .venv/bin/python ] || [ ! -f .venv/.spanattn-ready ]; then
    echo "[spanattn] creating .venv and installing dependencies (first run only)..."
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "$TORCH_SPEC"
    .venv/bin/python -m pip install -q -e ".[test]"
    touch .venv/.spanattn-ready
  fi
}

case "${1:-}" in
  demo)
    setup
    shift
    exec "$PY" -m spanattn.cli demo "$@"
    ;;
  test)
    setup
    shift
    "$PY" -m ruff check spanattn tests benchmarks examples tools
    # one test worker per core (pytest-xdist, from the test extra): 5.5 instead of 8.5 minutes on
    # two cores; SPANATTN_TEST_WORKERS=0 runs them in this process (an older .venv without it too)
    workers=()
    if "$PY" -c "import xdist" 2>/dev/null && [ "${SPANATTN_TEST_WORKERS:-auto}" != 0 ]; then
      workers=(-n "${SPANATTN_TEST_WORKERS:-auto}")
    fi
    # exit 5 = no tests collected: a broken collection must not pass silently
    exec "$PY" -m pytest "${workers[@]}" "$@"
    ;;
  *)
    echo "usage: bash tools/run.sh demo|test [args...]" >&2
    exit 2
    ;;
esac
