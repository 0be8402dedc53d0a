"""Where the workload traces live: the repository's ``data/`` folder (``data/README.md``).

The traces are committed files of the repository, not package data: a clone, run from its
root or installed editable (``pip install -e .``), finds them beside the packages, because the
folder is located from this file's own path (``<clone>/engine_sim/data.py`` ->
``<clone>/data``). A wheel installed elsewhere does not carry them (6 MB of CSV and JSONL
that only the benchmarks and tests read); there, ``SAL_DATA_DIR`` names a folder that holds
the same files, or each command takes its paths as options (``--trace``, ``--data-dir``).
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "SAL_DATA_DIR"
"""Environment variable that overrides the data folder (for an installed, non-editable copy)."""

AZURE_CHAT = "AzureLLMInferenceTrace_conv.csv"
"""Azure LLM inference trace 2023, conversation service (the paper's SW-Chat)."""
AZURE_CODE = "AzureLLMInferenceTrace_code.csv"
"""Azure LLM inference trace 2023, coding service (SW-Code; bursty timestamps)."""
MOONCAKE_CONVERSATION = "mooncake/conversation_trace.jsonl"
"""Mooncake FAST'25 conversation trace (prefix block hashes; 512-token blocks)."""
MOONCAKE_SYNTHETIC = "mooncake/synthetic_trace.jsonl"
"""Mooncake FAST'25 synthetic trace (Poisson arrivals, multi-turn prefix structure)."""
SHAREGPT_STATS = "sharegpt/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
"""Prompt/output token counts of ShareGPT conversations (no text, no timestamps)."""

_CHECKOUT_DATA = Path(__file__).resolve().parents[1] / "data"


def data_dir() -> Path:
    """The folder holding the traces: ``$SAL_DATA_DIR`` if set, else the checkout's ``data/``.

    Does not check that the folder exists: a command checks the files it needs and reports a
    missing one with `missing_message()`.
    """
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override) if override else _CHECKOUT_DATA


def missing_message(path: Path, option: str) -> str:
    """What a command prints when a trace it needs is not at `path` (`option` names the
    command-line option that takes another path)."""
    return (
        f"{path} not found: the traces ship in the repository's data/ folder; run from a "
        f"clone (or an editable install of one), set {DATA_DIR_ENV} to a folder holding them, "
        f"or pass {option}"
    )
