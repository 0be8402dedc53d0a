"""Session-wide fixtures shared by every test tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine_patch import tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama model directory (config + locally trained tokenizer, no weights)."""
    return tiny_model.build(tmp_path_factory.mktemp("tiny-llama"))


_REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SAL_SHARED_DATA", _REPO.parent / "shared" / "data"))
"""The workload traces (``../shared/data`` beside the checkout; ``SAL_SHARED_DATA`` overrides).
Never copied into the repository (licences: see the README)."""
