"""Session-wide fixtures shared by every test tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_patch import tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama model directory (config + locally trained tokenizer, no weights)."""
    return tiny_model.build(tmp_path_factory.mktemp("tiny-llama"))


REPO = Path(__file__).resolve().parents[1]
"""The root of the checkout under test."""
DATA_DIR = REPO / "data"
"""The workload traces committed with the repository (``data/README.md``: sources, licences).
Tests read this checkout's own copy, never ``SAL_DATA_DIR`` (that override is for installed
copies of the commands, `engine_sim.data`)."""
