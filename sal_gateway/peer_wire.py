"""The datagram gateways on separate hosts send each other (``peers``; `sal_gateway.peers`).

Pure encoding and decoding, no I/O. One datagram carries one gateway's current counts for
some of its backends, as absolute values (not deltas), so a lost or repeated datagram does
no lasting harm: the next one, or the sender's periodic full state, sets them right.

Layout, little-endian::

    header  magic b"SALP" | version u8 | reserved 3 bytes | sender u64 | group u64 | seq u64
            | rows u16
    row     key u64 | in flight u32 | routed prefill tokens u64 | routed KV tokens u64
    tag     the first 16 bytes of HMAC-SHA256(secret, header + rows)

`sender` is a random id the gateway draws at start (a restarted gateway is a new sender);
`group` is the same for the workers of one host that share their accounting through memory
(``listen.workers``), which drop each other's datagrams (they count each other already), and
the sender's own id otherwise;
`seq` grows by one per datagram it sends, so a receiver drops one older than what it has
applied for that sender (reordered, or replayed by someone who captured it). `key` is the
backend's `sal_gateway.shared_accounting.backend_key` (its model and URL), which every
gateway computes alike from the same configuration.

Anything that does not parse, carries a wrong tag or claims impossible numbers is rejected
with `PeerWireError` (its `reason` names the case for the metrics); nothing a datagram
holds is trusted before its tag checks out.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"SALP"
VERSION = 1
_HEADER = struct.Struct("<4sB3xQQQH")
_ROW = struct.Struct("<QIQQ")
TAG_BYTES = 16
MAX_ROWS = 48
"""Rows per datagram: 34-byte header + 48 x 28 + 16 = 1,394 bytes, under a 1,500-byte
Ethernet frame with IP and UDP headers (fragmented datagrams are lost whole, and more
often, on overlay networks)."""
MAX_DATAGRAM = _HEADER.size + MAX_ROWS * _ROW.size + TAG_BYTES
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


@dataclass(frozen=True, slots=True)
class PeerMessage:
    sender: int
    group: int
    seq: int
    rows: tuple[PeerRow, ...]


def encode(
    secret: bytes, sender: int, seq: int, rows: Sequence[PeerRow], group: int | None = None
) -> bytes:
    """One datagram of at most `MAX_ROWS` rows (negative counts are sent as 0); `group`
    defaults to `sender`."""
    if len(rows) > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows per datagram, got {len(rows)}")
    group = sender if group is None else group
    parts = [_HEADER.pack(MAGIC, VERSION, sender, group, seq, len(rows))]
    for row in rows:
        parts.append(
            _ROW.pack(
                row.key,
                min(max(0, row.in_flight), 2**32 - 1),
                min(max(0, row.routed_tokens), MAX_COUNT),
                min(max(0, row.routed_kv_tokens), MAX_COUNT),
            )
        )
    body = b"".join(parts)
    return body + hmac.new(secret, body, hashlib.sha256).digest()[:TAG_BYTES]


def decode(secret: bytes, datagram: bytes) -> PeerMessage:
    """The message in `datagram`, or `PeerWireError`. The tag is checked (in constant time)
    before anything but the sizes is looked at."""
    size = len(datagram)
    if size < _HEADER.size + TAG_BYTES or size > MAX_DATAGRAM:
        raise PeerWireError(f"datagram of {size} bytes", "malformed")
    body, tag = datagram[:-TAG_BYTES], datagram[-TAG_BYTES:]
    expected = hmac.new(secret, body, hashlib.sha256).digest()[:TAG_BYTES]
    if not hmac.compare_digest(tag, expected):
        raise PeerWireError("tag does not match the shared secret", "bad_tag")
    magic, version, sender, group, seq, count = _HEADER.unpack_from(body)
    if magic != MAGIC or version != VERSION:
        raise PeerWireError(f"magic {magic!r} version {version}", "malformed")
    if len(body) != _HEADER.size + count * _ROW.size:
        raise PeerWireError(f"{count} rows in {len(body)} bytes", "malformed")
    rows = []
    for i in range(count):
        key, in_flight, tokens, kv = _ROW.unpack_from(body, _HEADER.size + i * _ROW.size)
        if tokens > MAX_COUNT or kv > MAX_COUNT:
            raise PeerWireError(f"row {i}: {tokens} tokens, {kv} KV tokens", "malformed")
        rows.append(PeerRow(key, in_flight, tokens, kv))
    return PeerMessage(sender, group, seq, tuple(rows))
