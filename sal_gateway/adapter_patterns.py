"""Which configured model may serve a LoRA adapter no replica lists yet (pure).

vLLM's LoRA resolver plugins (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` plus a resolver:
the filesystem one reads ``VLLM_LORA_RESOLVER_CACHE_DIR/<name>``, others a model hub) load
an adapter the first time a request names it, so until then no replica's ``/v1/models``
lists it. ``models[].resolvable_adapters`` says which names a model's replicas can load so;
`resolvable_owner` picks the model for a name, and the admission path sends the request to
that model's pool instead of answering 404.

A name a resolver would turn into a path outside its directory never matches, whatever the
patterns: the gateway does not forward such names to replicas whose resolver might follow
them. Called once per request for a name that is no configured model; no I/O.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

MAX_NAME_CHARS = 256
"""Longest name a pattern may match (an adapter's directory or hub id)."""


def safe_adapter_name(name: str) -> bool:
    """Whether `name` may be handed to a replica's LoRA resolver: 1 to `MAX_NAME_CHARS`
    printable characters without whitespace or a backslash, no leading ``/`` and no ``..``
    path segment (``org/adapter`` hub ids pass; ``../x`` and ``/etc/x`` do not)."""
    if not 0 < len(name) <= MAX_NAME_CHARS or name.startswith("/"):
        return False
    if any(not c.isprintable() or c.isspace() or c == "\\" for c in name):
        return False
    return ".." not in name.split("/")


def resolvable_owner(patterns: Iterable[tuple[str, tuple[str, ...]]], name: str) -> str | None:
    """The first model (in `patterns`' order: ``(model, its resolvable_adapters)``) with a
    pattern matching `name` (``fnmatch.fnmatchcase``), or None (also for an unsafe name)."""
    if not safe_adapter_name(name):
        return None
    for model, globs in patterns:
        if any(fnmatch.fnmatchcase(name, glob) for glob in globs):
            return model
    return None
