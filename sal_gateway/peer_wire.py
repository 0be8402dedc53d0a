"""The datagram gateways on separate hosts send each other (``peers``; `sal_gateway.peers`).

Pure encoding and decoding, no I/O. One datagram carries one gateway's current counts for
some of its backends, as absolute values (not deltas), so a lost or repeated datagram does
no lasting harm: the next one, or the sender's periodic full state, sets them right.

Layout, little-endian::

    header  magic b"SALP" | version u8 | reserved 3 bytes | sender u64 | group u64 | seq u64
            | rows u16
    row     key u64 | in flight u32 | routed prefill tokens u64 | routed KV tokens u64
            | adapters u8 | that many adapter keys u64
    tag     the first 16 bytes of HMAC-SHA256(secret, header + rows)

The adapters (version 2) are the LoRA adapters of the sender's requests to that backend that
no snapshot it polled includes yet, as `sal_gateway.shared_accounting.adapter_key` hashes, at
most `MAX_ADAPTERS`: each takes one of the backend's ``--max-loras`` slots
(`sal_core.lora_slots`). Version 1 rows have no adapter count. A datagram whose rows carry
no adapter (always, unless ``peers.share_adapters`` is on) is sent as version 1, of at most
`V1_ROWS` rows, exactly as the release before adapters sent it, so that mixed releases hear
each other during a rolling upgrade; `decode` reads both.

`sender` is a random id the gateway draws at start (a restarted gateway is a new sender);
`group` is the same for the workers of one host that share their accounting through memory
(``listen.workers``), which drop each other's datagrams (they count each other already), and
the sender's own id otherwise;
`seq` grows by one per datagram it sends, so a receiver drops one older than what it has
applied for that sender (reordered, or replayed by someone who captured it). `key` is the
backend's `sal_gateway.shared_accounting.backend_key` (its model and URL), which every
gateway computes alike from the same configuration.

With ``peers.share_prefix_blocks`` there is a second kind of datagram, magic ``SALB``
(`PeerBlocks`, `encode_blocks`): the block keys of a prompt the sender routed, the end of
that request, or only the sender's watermark of requests that have ended.

Anything that does not parse, carries a wrong tag or claims impossible numbers is rejected
with `PeerWireError` (its `reason` names the case for the metrics); nothing a datagram
holds is trusted before its tag checks out.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAGIC = b"SALP"
VERSION = 2
VERSIONS = (1, 2)
"""Versions `decode` reads (1: rows without adapters)."""
_HEADER = struct.Struct("<4sB3xQQQH")
_ROW_V1 = struct.Struct("<QIQQ")
_ROW = struct.Struct("<QIQQB")
_ADAPTER = struct.Struct("<Q")
TAG_BYTES = 16
MAX_ADAPTERS = 8
"""Adapters per row (`sal_gateway.shared_accounting.ADAPTER_WORDS`, the same bound)."""
MAX_DATAGRAM = 1440
"""Bytes per datagram, under a 1,500-byte Ethernet frame with IPv6 (40) or IPv4 (20) and UDP
(8) headers: fragmented datagrams are lost whole, and more often on overlay networks."""
ROOM = MAX_DATAGRAM - _HEADER.size - TAG_BYTES
"""Bytes of version 2 rows one datagram holds (`PeerRow.size` each)."""
V1_ROWS = 48
"""Rows of a version 1 datagram: 34-byte header + 48 x 28 + 16 = 1,394 bytes, the largest
datagram the release before adapters accepts."""
MAX_ROWS = V1_ROWS
"""Rows per datagram when none carries an adapter; `fits` says whether rows fit."""
MIN_SECRET_BYTES = 16
MAX_COUNT = 2**40
"""Larger token or request counts than any fleet holds: a datagram claiming one is refused."""


class PeerWireError(ValueError):
    """A datagram that is not a valid, authentic peer message.

    `reason`: ``"malformed"`` (wrong size, magic or version; impossible numbers) or
    ``"bad_tag"`` (not sent with our secret, or changed on the way)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PeerRow:
    """One backend's counts at the sender: requests in flight and the prefill and KV tokens
    it routed there that no ``/stats`` snapshot it has seen includes yet."""

    key: int
    in_flight: int
    routed_tokens: int
    routed_kv_tokens: int
    adapters: tuple[int, ...] = ()
    """Pending LoRA adapters there (`sal_gateway.shared_accounting.adapter_key`)."""

    def size(self) -> int:
        """Bytes the row takes in a datagram (its adapters cut to `MAX_ADAPTERS`)."""
        return _ROW.size + _ADAPTER.size * min(len(self.adapters), MAX_ADAPTERS)


def fits(rows: Sequence[PeerRow]) -> bool:
    """Whether `rows` fit in one datagram: at most `V1_ROWS` rows when none carries an
    adapter (version 1), else at most `MAX_DATAGRAM` bytes (version 2)."""
    if not any(row.adapters for row in rows):
        return len(rows) <= V1_ROWS
    return sum(row.size() for row in rows) <= ROOM


@dataclass(frozen=True, slots=True)
class PeerMessage:
    sender: int
    group: int
    seq: int
    rows: tuple[PeerRow, ...]


def encode(
    secret: bytes, sender: int, seq: int, rows: Sequence[PeerRow], group: int | None = None
) -> bytes:
    """One datagram of `rows` that `fits`, version 1 when no row carries an adapter
    (negative counts are sent as 0, a row's adapters beyond `MAX_ADAPTERS` not at all);
    `group` defaults to `sender`."""
    if not fits(rows):
        raise ValueError(f"{len(rows)} rows do not fit in one datagram of {MAX_DATAGRAM} bytes")
    group = sender if group is None else group
    version = VERSION if any(row.adapters for row in rows) else 1
    parts = [_HEADER.pack(MAGIC, version, sender, group, seq, len(rows))]
    for row in rows:
        counts = (
            row.key,
            min(max(0, row.in_flight), 2**32 - 1),
            min(max(0, row.routed_tokens), MAX_COUNT),
            min(max(0, row.routed_kv_tokens), MAX_COUNT),
        )
        if version == 1:
            parts.append(_ROW_V1.pack(*counts))
            continue
        adapters = row.adapters[:MAX_ADAPTERS]
        parts.append(_ROW.pack(*counts, len(adapters)))
        parts += [_ADAPTER.pack(key) for key in adapters]
    body = b"".join(parts)
    return body + hmac.new(secret, body, hashlib.sha256).digest()[:TAG_BYTES]


def _authentic_body(secret: bytes, datagram: bytes, header_bytes: int) -> bytes:
    """`datagram` without its tag, once its size allows a header of `header_bytes` and its
    tag checks out under `secret` (in constant time); else `PeerWireError`."""
    size = len(datagram)
    if size < header_bytes + TAG_BYTES or size > MAX_DATAGRAM:
        raise PeerWireError(f"datagram of {size} bytes", "malformed")
    body, tag = datagram[:-TAG_BYTES], datagram[-TAG_BYTES:]
    expected = hmac.new(secret, body, hashlib.sha256).digest()[:TAG_BYTES]
    if not hmac.compare_digest(tag, expected):
        raise PeerWireError("tag does not match the shared secret", "bad_tag")
    return body


def decode(secret: bytes, datagram: bytes) -> PeerMessage:
    """The message in `datagram`, or `PeerWireError`. The tag is checked (in constant time)
    before anything but the sizes is looked at."""
    body = _authentic_body(secret, datagram, _HEADER.size)
    magic, version, sender, group, seq, count = _HEADER.unpack_from(body)
    if magic != MAGIC or version not in VERSIONS:
        raise PeerWireError(f"magic {magic!r} version {version}", "malformed")
    rows = []
    offset = _HEADER.size
    for i in range(count):
        if version == 1:
            if offset + _ROW_V1.size > len(body):
                raise PeerWireError(f"{count} rows in {len(body)} bytes", "malformed")
            key, in_flight, tokens, kv = _ROW_V1.unpack_from(body, offset)
            offset += _ROW_V1.size
            adapters: tuple[int, ...] = ()
        else:
            if offset + _ROW.size > len(body):
                raise PeerWireError(f"{count} rows in {len(body)} bytes", "malformed")
            key, in_flight, tokens, kv, n = _ROW.unpack_from(body, offset)
            offset += _ROW.size
            end = offset + n * _ADAPTER.size
            if n > MAX_ADAPTERS or end > len(body):
                raise PeerWireError(f"row {i}: {n} adapters", "malformed")
            adapters = tuple(k for (k,) in _ADAPTER.iter_unpack(body[offset:end]))
            offset = end
        if tokens > MAX_COUNT or kv > MAX_COUNT:
            raise PeerWireError(f"row {i}: {tokens} tokens, {kv} KV tokens", "malformed")
        rows.append(PeerRow(key, in_flight, tokens, kv, adapters))
    if offset != len(body):
        raise PeerWireError(f"{count} rows in {len(body)} bytes", "malformed")
    return PeerMessage(sender, group, seq, tuple(rows))


# --- prompt blocks (``peers.share_prefix_blocks``) ---------------------------------------

BLOCKS_MAGIC = b"SALB"
"""First bytes of a prompt-blocks datagram (`encode_blocks`): a release that does not know
them counts such a datagram ``malformed`` after its tag checks out, and drops it."""
BLOCKS_VERSION = 1
ROUTED, ENDED, WATERMARK = 1, 2, 3
"""Kinds of prompt-blocks datagram: some blocks of a routed request's prompt; that request
ended; only the sender's watermark (sent with its heartbeat)."""
KINDS = (ROUTED, ENDED, WATERMARK)
_BLOCKS_HEADER = struct.Struct("<4sBB2xQQQQQQH")
_BLOCK_KEY = struct.Struct("<q")
BLOCK_KEYS_PER_DATAGRAM = (MAX_DATAGRAM - _BLOCKS_HEADER.size - TAG_BYTES) // _BLOCK_KEY.size
"""Block keys one datagram carries: 170 (58-byte header, 16-byte tag, 8 bytes a key)."""


@dataclass(frozen=True, slots=True)
class PeerBlocks:
    """A prompt-blocks datagram, version 1 of the layout ::

        header  magic b"SALB" | version u8 | kind u8 | reserved 2 bytes | sender u64
                | group u64 | seq u64 | request u64 | oldest u64 | backend key u64
                | keys u16
        keys    that many chained block keys i64 (`sal_core.prefix.chain_hashes`: Python's
                hash of integer tuples, the same in every process and host)
        tag     the first 16 bytes of HMAC-SHA256(secret, header + keys)

    `sender`, `group` and `seq` as in `PeerMessage` (one sequence for both kinds of
    datagram). `request` numbers the sender's routed requests (from 1, growing); `oldest`
    is the lowest number among its requests that have not ended (the next number when
    none): every request below it has ended, whatever datagram was lost. `kind` `ROUTED`:
    1 to `BLOCK_KEYS_PER_DATAGRAM` keys of `request`'s prompt, a run of consecutive keys
    (chained keys name their whole prefix, so each run means something alone), sent to
    backend `key` (`sal_gateway.shared_accounting.backend_key`); `ENDED`: `request` ended
    (no keys, `key` 0); `WATERMARK`: only `oldest` (`request`, `key` 0, no keys)."""

    kind: int
    sender: int
    group: int
    seq: int
    request: int
    oldest: int
    key: int = 0
    keys: tuple[int, ...] = ()


def is_blocks(datagram: bytes) -> bool:
    """Whether `datagram` claims to be a prompt-blocks datagram (`decode_blocks` checks)."""
    return datagram[:4] == BLOCKS_MAGIC


def encode_blocks(secret: bytes, message: PeerBlocks) -> bytes:
    """One datagram of `message` (`ValueError` when its keys do not suit its kind)."""
    _check_blocks(message.kind, len(message.keys), ValueError)
    body = _BLOCKS_HEADER.pack(
        BLOCKS_MAGIC, BLOCKS_VERSION, message.kind, message.sender, message.group, message.seq,
        message.request, message.oldest, message.key, len(message.keys),
    ) + struct.pack(f"<{len(message.keys)}q", *message.keys)  # fmt: skip
    return body + hmac.new(secret, body, hashlib.sha256).digest()[:TAG_BYTES]


def decode_blocks(secret: bytes, datagram: bytes) -> PeerBlocks:
    """The prompt-blocks message in `datagram`, or `PeerWireError` (tag checked first, as
    `decode` does)."""
    body = _authentic_body(secret, datagram, _BLOCKS_HEADER.size)
    magic, version, kind, sender, group, seq, request, oldest, key, count = (
        _BLOCKS_HEADER.unpack_from(body)
    )
    if magic != BLOCKS_MAGIC or version != BLOCKS_VERSION:
        raise PeerWireError(f"magic {magic!r} version {version}", "malformed")
    _check_blocks(kind, count, _malformed)
    if _BLOCKS_HEADER.size + count * _BLOCK_KEY.size != len(body):
        raise PeerWireError(f"{count} block keys in {len(body)} bytes", "malformed")
    keys = struct.unpack_from(f"<{count}q", body, _BLOCKS_HEADER.size)
    return PeerBlocks(kind, sender, group, seq, request, oldest, key, keys)


def _malformed(message: str) -> PeerWireError:
    return PeerWireError(message, "malformed")


def _check_blocks(kind: int, count: int, error: Callable[[str], Exception]) -> None:
    if kind not in KINDS:
        raise error(f"blocks datagram of kind {kind}")
    if kind == ROUTED and not 0 < count <= BLOCK_KEYS_PER_DATAGRAM:
        raise error(f"{count} block keys; one datagram holds 1 to {BLOCK_KEYS_PER_DATAGRAM}")
    if kind != ROUTED and count:
        raise error(f"{count} block keys in a datagram of kind {kind}")
