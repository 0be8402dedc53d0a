"""Backend discovery through DNS (a Kubernetes headless Service, or any name with many A/AAAA).

A headless Service resolves to one address per *ready* pod, so re-resolving its name every
few seconds gives the gateway the live set of replicas without talking to the Kubernetes API.

Two pieces:

* `backend_urls()` — pure: addresses + port + scheme -> sorted, de-duplicated backend URLs
  (IPv6 addresses bracketed, zone ids escaped).
* `watch_dns()` — the I/O loop: the gateway's lifespan starts one task per model whose config
  has ``discovery:``; the task resolves the name every ``interval_s`` and calls ``on_change``
  with the new URL list whenever the set differs from the last one it delivered (including
  the first successful resolution). It runs until cancelled.

Failure semantics (why they are what they are): a failed resolution (timeout, NXDOMAIN,
resolver error) keeps the last good set, because a DNS hiccup must not empty the pool — the
pollers already eject backends that stop answering. A *successful* empty answer (possible
from a custom resolver) is a real, deliverable empty set. Note that a headless Service with
zero ready pods answers NXDOMAIN, which counts as a failure: the old backends stay listed
and are ejected by their pollers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``resolve(host, port) -> addresses``: one call per interval; may raise to signal failure."""

DEFAULT_RESOLVE_TIMEOUT_S = 5.0
"""Upper bound on one resolution (any resolver), so a stuck DNS server cannot stall the loop."""


def backend_urls(addresses: Iterable[str], port: int, scheme: str) -> list[str]:
    """Build backend base URLs (``scheme://host:port``) from resolved addresses.

    Pure. Duplicates are dropped (getaddrinfo returns one entry per socket type/protocol),
    the result is sorted so that equal sets compare equal, IPv6 literals are bracketed and a
    zone id (``fe80::1%eth0``) is percent-escaped as RFC 6874 requires. Hostnames pass
    through unchanged. Raises ``ValueError`` for a port outside 1-65535 or an empty scheme.
    """
    if not 1 <= port <= 65535:
        raise ValueError(f"discovery port must be in 1..65535, got {port}")
    if not scheme:
        raise ValueError("discovery scheme must not be empty")
    urls = {f"{scheme}://{_url_host(address)}:{port}" for address in addresses}
    return sorted(urls)


def _url_host(address: str) -> str:
    """The host part of a URL for one address: IPv6 in brackets, anything else as is."""
    literal, _, zone = address.partition("%")
    try:
        parsed = ipaddress.ip_address(literal)
    except ValueError:
        return address  # a hostname (only custom resolvers return those)
    if parsed.version == 6:
        return f"[{parsed.compressed}%25{zone}]" if zone else f"[{parsed.compressed}]"
    return parsed.compressed


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Default resolver: every TCP address ``host`` resolves to, via ``loop.getaddrinfo``.

    Raises ``OSError`` (``socket.gaierror``) when the name does not resolve. The caller
    (`watch_dns`) bounds the call with a timeout.
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(sockaddr[0]) for _family, _type, _proto, _canon, sockaddr in infos]


async def watch_dns(
    dns_name: str,
    port: int,
    scheme: str,
    interval_s: float,
    on_change: Callable[[list[str]], None],
    resolve: Resolver | None = None,
    *,
    resolve_timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S,
) -> None:
    """Resolve ``dns_name`` every ``interval_s`` and report backend URL set changes.

    Contract:

    * The first resolution happens immediately; later ones ``interval_s`` after the previous
      one finished.
    * ``on_change(urls)`` receives the full sorted URL list (see `backend_urls`) whenever it
      differs from the last list delivered, the first time included. It is called from the
      event loop and must not block.
    * A resolution that raises or exceeds ``resolve_timeout_s`` is logged and skipped; the
      last delivered set stays in force.
    * If ``on_change`` raises, the error is logged and the same set is offered again on the
      next round (the watcher itself never dies of it).
    * Runs until cancelled; cancellation propagates.

    ``resolve`` defaults to `resolve_addresses` (``loop.getaddrinfo``); tests pass a fake.
    """
    if interval_s <= 0:
        raise ValueError(f"discovery interval_s must be > 0, got {interval_s}")
    backend_urls([], port, scheme)  # validate port and scheme before the first round
    resolver: Resolver = resolve if resolve is not None else resolve_addresses
    delivered: list[str] | None = None
    while True:
        urls = await _resolve_once(resolver, dns_name, port, scheme, resolve_timeout_s)
        if urls is not None and urls != delivered:
            try:
                on_change(urls)
            except Exception:
                logger.exception("discovery %s: on_change failed for %s", dns_name, urls)
            else:
                logger.info("discovery %s: backends now %s", dns_name, urls)
                delivered = urls
        await asyncio.sleep(interval_s)


async def _resolve_once(
    resolver: Resolver, dns_name: str, port: int, scheme: str, timeout_s: float
) -> list[str] | None:
    """One bounded resolution; None (after logging why) when it failed."""
    try:
        async with asyncio.timeout(timeout_s):
            addresses = await resolver(dns_name, port)
    except TimeoutError:
        logger.warning(
            "discovery %s: resolution timed out after %.1f s; keeping last set",
            dns_name,
            timeout_s,
        )
        return None
    except Exception as exc:
        # gaierror (NXDOMAIN, no server) is the usual one; any resolver error means the same
        # thing here: no new information, so keep the last set. CancelledError is not an
        # Exception and still ends the watcher.
        logger.warning("discovery %s: resolution failed (%s); keeping last set", dns_name, exc)
        return None
    return backend_urls(addresses, port, scheme)
