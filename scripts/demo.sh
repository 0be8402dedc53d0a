#!/usr/bin/env bash
# The main job on an embedded default (README quick start, first command).
#
# Creates .venv if missing, installs the gateway (no vLLM, no GPU needed) and runs
# `sal-gateway demo`: the SAL gateway on http://127.0.0.1:8080 in front of 4 emulated vLLM
# replicas, drives a short built-in load through it, prints a summary and keeps serving until
# Ctrl-C. Arguments go to `sal-gateway demo` (e.g. --policy p2c --requests 0 --port 9000).
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
# Reinstall when the `demo` command is not registered (a venv from an older checkout): the
# gateway's CLI finds it through the package's entry points (group sal_gateway.commands).
registered='from importlib.metadata import entry_points as e; import engine_sim.demo
raise SystemExit(not e(group="sal_gateway.commands", name="demo"))'
if [[ ! -x .venv/bin/sal-gateway ]] || ! .venv/bin/python -c "$registered" 2>/dev/null; then
  echo "== installing the gateway into .venv"
  .venv/bin/python -m pip install --quiet -e .
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [[ $# -eq 0 ]]; then
  set -- --requests 120
fi
exec .venv/bin/sal-gateway demo "$@"
