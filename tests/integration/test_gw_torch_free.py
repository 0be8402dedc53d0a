"""The gateway's processes run without PyTorch, and count tokens exactly as with it.

What a user would notice if it broke: installed beside vLLM (one environment for both, or
this repository's test environment, which has torch), the gateway and each body worker
imported torch through transformers, ~340 MiB resident apiece and seconds more to start,
for tokenizers that never use it. Or, the other way: a tokenizer loaded without torch that
counts differently, so SAL routes on wrong sizes and the prefix index hashes wrong blocks.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway_support import free_port, gateway_config, run_gateway_process

_COUNT = """
import json, sys
if sys.argv[2] == "torch-free":
    from sal_gateway.torch_free import keep_torch_out
    assert keep_torch_out()
from sal_gateway.request_body import Endpoint, parse_body
from sal_gateway.tokenizer import load_model_tokenizer
counter = load_model_tokenizer(sys.argv[1], None)
texts = ["hello world", "Ünïcödé — 漢字 🙂 tabs\\tand\\nnewlines", "x " * 3000, ""]
ids = [counter.encode_ids(t, add_special_tokens=True) for t in texts]
chat = parse_body(json.dumps(
    {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hi there, how are you?"}]}
).encode(), Endpoint.CHAT)
blocks = counter.count_sync(chat, block_size=16)
print(json.dumps({"ids": ids, "chat": list(blocks.per_prompt),
                  "keys": list(blocks.block_keys or ()), "torch": "torch" in sys.modules
                  and sys.modules["torch"] is not None}))
"""


def _counts(model_dir: Path, mode: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _COUNT, str(model_dir), mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_is_installed_here_so_these_tests_mean_something() -> None:
    # scripts/test.sh installs vLLM for CPU, and with it torch: the situation being tested.
    assert importlib.util.find_spec("torch") is not None


def test_without_torch_the_tokenizer_counts_the_same(tiny_model_dir: Path) -> None:
    with_torch = _counts(tiny_model_dir, "default")
    without = _counts(tiny_model_dir, "torch-free")
    assert with_torch["torch"] is True  # transformers did import it when allowed
    assert without["torch"] is False
    assert without["ids"] == with_torch["ids"]
    assert without["chat"] == with_torch["chat"]
    assert without["keys"] == with_torch["keys"]
    assert without["keys"]


def _maps_torch(pid: int) -> bool:
    """Whether process `pid` has PyTorch's shared library mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
    return "libtorch" in maps


def _children(pid: int) -> list[int]:
    task = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in task.read_text().split()]


@pytest.mark.slow
def test_the_gateway_and_its_body_workers_never_load_torch(tiny_model_dir: Path) -> None:
    port = free_port(18900, 18990)
    config = gateway_config(port, ["http://127.0.0.1:9"], tokenizer=tiny_model_dir)
    config["limits"] = {"body_workers": 2}
    with run_gateway_process(config, wait_ready=False) as (url, proc):
        # A prompt over the model's context: counted by a body worker, refused with a 400.
        body = {"model": "tiny", "prompt": "hello " * 20_000, "max_tokens": 1}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert "maximum context length" in resp.json()["error"]["message"]
        deadline = time.monotonic() + 30
        while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) >= 2, workers
        for pid in (proc.pid, *workers):
            assert not _maps_torch(pid), (pid, Path(f"/proc/{pid}/cmdline").read_bytes())
