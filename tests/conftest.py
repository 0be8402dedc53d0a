"""Session-wide fixtures shared by every test tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_patch import tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama model directory (config + locally trained tokenizer, no weights)."""
    return tiny_model.build(tmp_path_factory.mktemp("tiny-llama"))


LONG_CONTEXT = 16384
"""`long_model_dir`'s context, in tokens."""


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 16k-token context: room for a blocker request that decodes
    for as long as a test on a starved box needs to queue prompts behind it (the test
    aborts it then). 4,000 tokens, the default context's worth, were seen finishing first."""
    return tiny_model.build(tmp_path_factory.mktemp("tiny-llama-16k"), max_model_len=LONG_CONTEXT)


REPO = Path(__file__).resolve().parents[1]
"""The root of the checkout under test."""
DATA_DIR = REPO / "data"
"""The workload traces committed with the repository (``data/README.md``: sources, licences).
Tests read this checkout's own copy, never ``SAL_DATA_DIR`` (that override is for installed
copies of the commands, `engine_sim.data`)."""


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a Qwen3, with a tokenizer vLLM's decisions API accepts."""
    return tiny_model.build(tmp_path_factory.mktemp("tiny-qwen3"), architecture="qwen3")


def _installed_vllm_release() -> tuple[int, ...]:
    from engine_patch.versions import installed_vllm_version

    return tuple(int(p) for p in installed_vllm_version().split("+")[0].split(".")[:3])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip) the tests of vLLM 0.33 features when an earlier vLLM is installed:
    `scripts/test.sh` runs them in its vLLM 0.33.0 pass (`scripts/vllm_overlay.py`)."""
    if not any(item.get_closest_marker("vllm033") for item in items):
        return
    if _installed_vllm_release() >= (0, 33, 0):
        return
    keep = [item for item in items if not item.get_closest_marker("vllm033")]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
