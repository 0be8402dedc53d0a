"""vLLM's KV-cache events, decoded and mapped onto the gateway's block keys (pure, no I/O).

vLLM 0.32 publishes (``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557"}'``, `vllm/distributed/kv_events.py`) one ZMQ multipart
message per engine step: ``(topic, seq as 8 bytes big-endian, payload)``, the payload a
msgpack ``KVEventBatch`` encoded by msgspec: an array ``[ts, events, data_parallel_rank]``
whose events are maps tagged by ``"type"``:

* ``BlockStored``: ``block_hashes`` (vLLM's keys, bytes or 64-bit ints), ``parent_block_hash``
  (None: the prompt's first block), ``token_ids`` (the blocks' tokens, in order),
  ``block_size``, ``lora_id`` / ``lora_name``, ``medium``, ``extra_keys``, ``group_idx``;
* ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
* ``AllBlocksCleared``.

The gateway never recomputes vLLM's hashes (sha256 of a pickle, or whatever
``--prefix-caching-hash-algo`` says, seeded per deployment): a stored event carries its
parent and its tokens, so `BlockKeyMap` chains `sal_core.prefix.chain_hashes` keys along the
same parent links and remembers each vLLM hash's key, and a removal is translated back
through that map. Blocks the gateway's keys cannot describe are *foreign* and ignored: another
block size, medium (CPU offload tiers) or KV-cache group, LoRA adapters, extra keys
(multimodal inputs, ``cache_salt``). A stored block whose parent the map does not know (the
subscriber joined late, or an event was lost) cannot be keyed and is dropped as
``unknown_parent``.

Everything a publisher (or anyone who can reach the socket) sends is untrusted: a message
that does not decode, or decodes to something else, is counted and dropped, never raised.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sal_core.prefix import ROOT_HASH, chain_hashes

MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
"""Largest event message accepted (an 8k-token prompt's BlockStored is ~40 kB)."""
MAX_MAPPED_BLOCKS = 262_144
"""vLLM hashes remembered per backend (LRU beyond): about 4 M tokens of KV at 16 per block,
more than any single replica holds; bounds memory if removals are lost."""
GPU_MEDIA = frozenset({None, "GPU"})


class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[bytes | int]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_BATCH = msgspec.msgpack.Decoder(_Batch)
_EVENT = msgspec.msgpack.Decoder(_Stored | _Removed | _Cleared)


@dataclass(slots=True)
class Ops:
    """What one message asks of the prefix index, in order, and what was dropped."""

    stored: list[list[int]] = field(default_factory=list)
    """Per BlockStored event: the gateway keys of its blocks."""
    removed: list[int] = field(default_factory=list)
    cleared: bool = False
    """The cache was cleared (before `stored` and `removed`, which follow it)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Reason -> events (or messages) dropped."""

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    @property
    def empty(self) -> bool:
        return not (self.stored or self.removed or self.cleared)


def seq_of(frame: bytes) -> int | None:
    """The sequence number frame of a message (8 bytes big-endian), None when malformed."""
    return int.from_bytes(frame, "big", signed=True) if len(frame) == 8 else None


class BlockKeyMap:
    """One backend's vLLM block hash -> gateway key map (see the module docstring). Used by
    that backend's subscriber only (one thread)."""

    def __init__(self, max_blocks: int = MAX_MAPPED_BLOCKS) -> None:
        self._keys: OrderedDict[bytes | int, int] = OrderedDict()
        self._max = max_blocks

    def __len__(self) -> int:
        return len(self._keys)

    def decode(self, payload: bytes, block_size: int | None) -> Ops:
        """Decode one message payload and translate it (`block_size`: the model's, None
        while unknown: every stored block is then foreign)."""
        ops = Ops()
        if len(payload) > MAX_PAYLOAD_BYTES:
            ops.drop("oversized")
            return ops
        try:
            batch = _BATCH.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            ops.drop("garbled")
            return ops
        for raw in batch.events:
            try:
                event = _EVENT.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                ops.drop("garbled")
                continue
            if isinstance(event, _Stored):
                self._stored(event, block_size, ops)
            elif isinstance(event, _Removed):
                self._removed(event, ops)
            else:
                self._keys.clear()
                ops.stored.clear()
                ops.removed.clear()
                ops.cleared = True
        return ops

    def clear(self) -> None:
        self._keys.clear()

    def _stored(self, event: _Stored, block_size: int | None, ops: Ops) -> None:
        n = len(event.block_hashes)
        if n == 0 or event.block_size <= 0 or len(event.token_ids) != n * event.block_size:
            ops.drop("garbled")
            return
        if (
            event.block_size != block_size
            or event.medium not in GPU_MEDIA
            or event.group_idx not in (None, 0)
            or event.lora_id is not None
            or event.lora_name is not None
            or (event.extra_keys is not None and any(k is not None for k in event.extra_keys))
        ):
            ops.drop("foreign")
            return
        parent = event.parent_block_hash
        if parent is None:
            parent_key: int | None = ROOT_HASH
        else:
            parent_key = self._keys.get(parent)
        if parent_key is None:
            ops.drop("unknown_parent")
            return
        keys = chain_hashes(event.token_ids, event.block_size, parent_key)
        mapped = self._keys
        for vllm_hash, key in zip(event.block_hashes, keys, strict=True):
            mapped[vllm_hash] = key
            mapped.move_to_end(vllm_hash)
        while len(mapped) > self._max:
            mapped.popitem(last=False)
        ops.stored.append(keys)

    def _removed(self, event: _Removed, ops: Ops) -> None:
        if event.medium not in GPU_MEDIA or event.group_idx not in (None, 0):
            ops.drop("foreign")
            return
        for vllm_hash in event.block_hashes:
            key = self._keys.pop(vllm_hash, None)
            if key is not None:
                ops.removed.append(key)
