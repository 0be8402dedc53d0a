"""Serve `sal_gateway.testing.FakeBackend` in a process of its own, for the benchmarks.

``python -m bench.fake_backend_server --port P [--model tiny]`` runs the fake vLLM server
(OpenAI API with ``usage``, ``/stats``, ``/metrics``) with uvicorn on uvloop + httptools on
127.0.0.1. With the default zero delays every response is as fast as the fake can produce
it, so what the benchmark measures on top of it is the gateway's own cost; with
``--first-byte-delay-s`` / ``--chunk-delay-s`` it paces its tokens like a real replica.
"""

from __future__ import annotations

import argparse

import uvicorn

from sal_gateway.testing import FakeBackend, FakeBehaviour


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fast fake vLLM backend for benchmarks")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--first-byte-delay-s", type=float, default=0.0)
    parser.add_argument("--chunk-delay-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    behaviour = FakeBehaviour(
        first_byte_delay_s=args.first_byte_delay_s, chunk_delay_s=args.chunk_delay_s
    )
    backend = FakeBackend(
        name=f"fake-{args.port}", model=args.model, behaviour=behaviour, keep_received=0
    )
    uvicorn.run(
        backend,
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        log_level="warning",
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
