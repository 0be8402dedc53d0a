#!/usr/bin/env python3
"""Generate ``compose.replicas.yaml``: one vLLM service per replica, each on its own GPU(s).

Why a generated file: compose's ``deploy.replicas`` copies a service verbatim, and a GPU
reservation of ``count: 1`` gives *every* copy the first GPU. Pinning replica i to GPUs
``[i*g, (i+1)*g)`` needs one service per replica, so this script writes them from the two
numbers in ``.env``::

    REPLICAS=2            # number of vLLM replicas
    GPUS_PER_REPLICA=1    # tensor-parallel size of each replica

Run it from anywhere after changing either number (``python3 deploy/render_replicas.py``);
everything else (model, scheduler, memory) stays ``${VAR}`` references that compose fills in
from ``.env`` at ``up`` time. The test suite checks that the committed file matches ``.env``.

Standard library only: the output is JSON (which is YAML), so the script runs on a bare host
Python.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINE_PORT = 8000
"""Port every replica serves on inside its container (the gateway's discovery port)."""
DISCOVERY_ALIAS = "vllm"
"""Network alias shared by all replicas; the gateway and Prometheus resolve it."""


def read_env(path: Path) -> dict[str, str]:
    """Parse a compose ``.env`` file: ``KEY=VALUE`` lines, ``#`` comments, optional quotes."""
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{path}:{number}: expected KEY=VALUE, got {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def _positive_int(env: dict[str, str], key: str) -> int:
    raw = env.get(key)
    if raw is None:
        raise ValueError(f".env: {key} is not set")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f".env: {key} must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f".env: {key} must be >= 1, got {value}")
    return value


def replica_service(index: int, gpus_per_replica: int) -> dict[str, object]:
    """The compose service of replica ``index`` (pure)."""
    first_gpu = index * gpus_per_replica
    device_ids = [str(gpu) for gpu in range(first_gpu, first_gpu + gpus_per_replica)]
    return {
        "image": "${ENGINE_IMAGE:-sal-engine:vllm-0.32.0}",
        "build": {"context": "..", "dockerfile": "deploy/engine.Dockerfile"},
        "restart": "unless-stopped",
        # vLLM's workers share tensors through /dev/shm; the host IPC namespace avoids the
        # 64 MiB default (vLLM's own recommendation for Docker).
        "ipc": "host",
        "command": [
            "${MODEL:?set MODEL in .env}",
            "--served-model-name",
            "${SERVED_MODEL_NAME:?set SERVED_MODEL_NAME in .env}",
            "--host",
            "0.0.0.0",
            "--port",
            str(ENGINE_PORT),
            "--tensor-parallel-size",
            str(gpus_per_replica),
            "--max-model-len",
            "${MAX_MODEL_LEN:-8192}",
            "--gpu-memory-utilization",
            "${GPU_MEMORY_UTILIZATION:-0.90}",
            # engine_patch's launcher options: larry_tail (the default: LARRY with the tail
            # guard) | larry (the paper's) | fcfs | stock (plain vLLM, no /stats).
            "--sal-scheduler",
            "${ENGINE_SCHEDULER:-larry_tail}",
            # Alpha travels in --additional-config (not --sal-alpha) so that switching
            # ENGINE_SCHEDULER needs no other change: each LARRY reads its own section, fcfs
            # neither.
            "--additional-config",
            '{"larry": {"alpha": ${LARRY_ALPHA:-1.0}}, '
            '"larry_tail": {"alpha": ${LARRY_ALPHA:-1.0}}}',
        ],
        "environment": {
            "HF_TOKEN": "${HF_TOKEN:-}",
            "VLLM_NO_USAGE_STATS": "1",
        },
        "volumes": ["hf-cache:/root/.cache/huggingface"],
        "networks": {"default": {"aliases": [DISCOVERY_ALIAS]}},
        "deploy": {
            "resources": {
                "reservations": {
                    "devices": [
                        {"driver": "nvidia", "device_ids": device_ids, "capabilities": ["gpu"]}
                    ]
                }
            }
        },
        "healthcheck": {
            "test": [
                "CMD",
                "python3",
                "-c",
                "import sys, urllib.request as u; "
                f"sys.exit(u.urlopen('http://127.0.0.1:{ENGINE_PORT}/health', timeout=4)"
                ".status != 200)",
            ],
            "interval": "15s",
            "timeout": "5s",
            "retries": 3,
            # Weights download and CUDA graph capture take minutes on the first start.
            "start_period": "900s",
        },
    }


def render(replicas: int, gpus_per_replica: int) -> dict[str, object]:
    """The whole ``compose.replicas.yaml`` document (pure).

    Services ``vllm-0`` ... ``vllm-{replicas-1}``, and a ``gateway`` fragment that makes the
    gateway start once ``vllm-0`` is healthy: by then the model, and with it the tokenizer the
    gateway reads, is in the shared cache. The other replicas join through DNS discovery when
    they become reachable, so one broken replica does not keep the gateway down, and updating
    a replica does not restart the gateway.
    """
    if replicas < 1 or gpus_per_replica < 1:
        raise ValueError("replicas and gpus_per_replica must be >= 1")
    services: dict[str, object] = {
        f"vllm-{i}": replica_service(i, gpus_per_replica) for i in range(replicas)
    }
    services["gateway"] = {"depends_on": {"vllm-0": {"condition": "service_healthy"}}}
    return {"services": services}


HEADER = """\
# GENERATED by render_replicas.py from .env (REPLICAS={replicas}, GPUS_PER_REPLICA={gpus}).
# Do not edit: change .env and run `python3 deploy/render_replicas.py`.
# JSON is valid YAML; it keeps this script free of third-party imports.
"""


def dump(document: dict[str, object], replicas: int, gpus: int) -> str:
    """Serialize a rendered document with its header (stable output for equal inputs)."""
    return HEADER.format(replicas=replicas, gpus=gpus) + json.dumps(document, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-file", type=Path, default=HERE / ".env")
    parser.add_argument("--output", type=Path, default=HERE / "compose.replicas.yaml")
    args = parser.parse_args(argv)
    try:
        env = read_env(args.env_file)
        replicas = _positive_int(env, "REPLICAS")
        gpus = _positive_int(env, "GPUS_PER_REPLICA")
    except (OSError, ValueError) as exc:
        print(f"render_replicas: {exc}", file=sys.stderr)
        return 2
    args.output.write_text(dump(render(replicas, gpus), replicas, gpus))
    print(f"wrote {args.output} ({replicas} replicas x {gpus} GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
