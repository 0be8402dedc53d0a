"""Keep PyTorch out of the gateway's processes: it needs a model's tokenizer, never its weights.

transformers imports torch whenever torch is installed (``AutoTokenizer`` reaches its model
registry, which imports the generation code), although tokenizers (the Rust ``tokenizers``
library) and chat templates (Jinja) never use it. In the gateway's own image torch is not
installed; installed beside vLLM (one environment for both, or this repository's test
environment) it made the gateway process and each of its body workers about 340 MiB larger
and 3-4 s slower to load a tokenizer (measured with the tests' tiny Llama tokenizer).

`keep_torch_out` marks torch as absent in the calling process (``sys.modules["torch"] =
None``: ``import torch`` raises ImportError and ``importlib.util.find_spec("torch")`` answers
None, which is how transformers decides), so transformers takes the same torch-free path as
in the image. The token ids are the same either way
(`tests/integration/test_gw_torch_free.py`).
Call it first thing in a process's entry point, never on import: a process that imports
this module for other reasons (the test suite, vLLM's own) keeps its torch.
"""

from __future__ import annotations

import os
import sys

_ADVISORY = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def keep_torch_out() -> bool:
    """Make torch unimportable in this process; False (and nothing changed) when torch was
    already imported. Also silences transformers' one-line "PyTorch was not found" advice
    (unless the environment set `TRANSFORMERS_NO_ADVISORY_WARNINGS` itself)."""
    if sys.modules.get("torch") is not None:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    os.environ.setdefault(_ADVISORY, "1")
    return True
