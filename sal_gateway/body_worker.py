"""The child process that decodes, validates and counts large request bodies (``python -m``).

The gateway's event loop only handles small bodies itself (`admission`); a larger one is
handed here as raw bytes by `body_pool`, so JSON decoding, validation, chat-template
rendering (the model's own template) and tokenization, whose cost grows with the request,
never hold the gateway's GIL. Only a small summary goes back: the fields routing needs and
the prompt token counts. The body the gateway forwards stays the bytes the client sent.

Protocol (`worker_proc`): the init line is ``{"models": [{"name", "tokenizer",
"max_model_len"}, ...]}``; the child loads those tokenizers (offline, as the gateway does),
lowers its CPU priority (the loop's small work comes first on a busy machine), then writes
``{"ready": true}``. Jobs:

* ``{"op": "admit", "endpoint": "/v1/completions", "max_n": 16, "block_sizes": {model: 16},
  "aliases": {served_name: model},
  "len": N}`` + the raw body: answers ``{"ok": true, "summary": {...}}`` (`admit_job`; with a
  block size for the request's model, the count carries the prompt's block keys: about 8
  bytes of JSON per 16 tokens, far less than the ids), plus, for a streaming body that
  is not plain UTF-8 ``{...}`` text, ``"len"`` and the body re-encoded as UTF-8 JSON (the
  gateway splices ``stream_options`` into it, as it does into any body);
* ``{"op": "count", "model": m, "add_special_tokens": b, "len": N}`` + UTF-8 text
  (surrogates passed through): ``{"ok": true, "tokens": n}``.

A client's fault answers ``{"error": {"message": ..., "param": ...}}``. After a job that
left the process large (over `RETIRE_ABOVE_BYTES` resident), the answer carries
``"retire": true`` and the pool replaces the child: memory stays bounded whatever was sent.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
from typing import IO, Any

RETIRE_ABOVE_BYTES = 1024 * 1024 * 1024
"""A child resident above this after a job (and after returning free memory) is replaced."""
_TRIM_AFTER_BYTES = 1024 * 1024
_READ_AFTER_ADMISSION = ("model", "stream_options", "add_special_tokens")
"""What the gateway reads of a body after admission (`usage`, `admission`)."""


def admit_job(
    raw: bytes,
    endpoint_path: str,
    max_n: int,
    counters: dict[str, Any],
    default_model: str | None = None,
    block_sizes: dict[str, int] | None = None,
    aliases: dict[str, str] | None = None,
) -> tuple[dict[str, Any], bytes]:
    """Decode, validate and (unless a request template must be rendered first) count one
    body (with its block keys when `block_sizes` names the request's model); a model named
    in `aliases` (a name served besides a configured model) is counted as that model. Returns the
    summary and, for a streaming body that cannot take a spliced ``stream_options``, the
    body re-encoded as UTF-8 JSON (else ``b""``). `BadRequest` propagates (the caller
    answers it)."""
    from sal_gateway.api_body import parse_api_body
    from sal_gateway.endpoints import ENDPOINTS
    from sal_gateway.request_body import Endpoint, parse_body
    from sal_gateway.usage import splices

    generation = {e.value: e for e in Endpoint}
    if endpoint_path in generation:
        inbound = parse_body(raw, generation[endpoint_path], max_n=max_n)
    else:
        api = next(e for e in ENDPOINTS if e.path == endpoint_path)
        inbound = parse_api_body(raw, api, default_model=default_model)
    body = inbound.body
    summary: dict[str, Any] = {
        "endpoint": inbound.endpoint.value,
        "path": inbound.path,
        "count_options": inbound.count_options,
        "counted": inbound.counted,
        "ask_stream_usage": inbound.ask_stream_usage,
        "truncate_to": inbound.truncate_to,
        "model": inbound.model,
        "stream": inbound.stream,
        "max_tokens": inbound.max_tokens,
        "fan_out": inbound.fan_out,
        "chat_template": inbound.chat_template,
        "body": {k: body[k] for k in _READ_AFTER_ADMISSION if k in body},
        "count": None,
    }
    model = (aliases or {}).get(inbound.model, inbound.model)
    counter = counters.get(model)
    if counter is not None and (inbound.chat_template is None or not counter.has_tokenizer):
        block_size = (block_sizes or {}).get(model)
        count = counter.count_sync(inbound, block_size)
        summary["count"] = {
            "per_prompt": list(count.per_prompt),
            "estimated": count.estimated,
            "block_keys": list(count.block_keys),
        }
    reencoded = b""
    if inbound.stream and not splices(raw, body):
        reencoded = json.dumps(body).encode()
    return summary, reencoded


def _job(
    header: dict[str, Any], payload: bytes, counters: dict[str, Any]
) -> tuple[dict[str, Any], bytes]:
    from sal_gateway.errors import BadRequest

    try:
        if header.get("op") == "count":
            counter = counters[header["model"]]
            text = payload.decode("utf-8", "surrogatepass")
            n = counter.encode_len(text, bool(header.get("add_special_tokens")))
            return {"ok": True, "tokens": n}, b""
        summary, data = admit_job(
            payload,
            header["endpoint"],
            int(header["max_n"]),
            counters,
            header.get("default_model"),
            _block_sizes(header.get("block_sizes")),
            _aliases(header.get("aliases")),
        )
    except BadRequest as exc:
        return {"error": {"message": exc.message, "param": exc.param}}, b""
    except MemoryError:
        return {"error": {"message": "the request is too large to process", "param": None}}, b""
    answer: dict[str, Any] = {"ok": True, "summary": summary}
    if data:
        answer["len"] = len(data)
    return answer, data


def _block_sizes(value: object) -> dict[str, int]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, int) and v > 0}


def _aliases(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, str)}


def _resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    """Hand freed heap back to the OS (glibc keeps it otherwise)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def serve(inp: IO[bytes], out: IO[bytes], counters: dict[str, Any]) -> None:
    """Answer jobs until stdin closes."""
    while line := inp.readline():
        header = json.loads(line)
        payload = inp.read(int(header["len"]))
        answer, data = _job(header, payload, counters)
        del payload
        if len(data) + int(header["len"]) > _TRIM_AFTER_BYTES:
            _trim()
            if _resident_bytes() > RETIRE_ABOVE_BYTES:
                answer["retire"] = True
        out.write(json.dumps(answer).encode() + b"\n" + data)
        out.flush()


def main() -> None:
    # One core per child: the gateway sizes the pool to the machine.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Niceness: set by the parent (`worker_proc.WORKER_NICENESS`), once, as an absolute value.
    from sal_gateway.torch_free import keep_torch_out

    keep_torch_out()  # before transformers: tokenizers only (no ~340 MiB of torch)
    init = json.loads(sys.stdin.buffer.readline())
    from sal_gateway.tokenizer import load_model_tokenizer

    counters = {
        m["name"]: load_model_tokenizer(m["tokenizer"], m["max_model_len"]) for m in init["models"]
    }
    out = sys.stdout.buffer
    out.write(json.dumps({"ready": True}).encode() + b"\n")
    out.flush()
    serve(sys.stdin.buffer, out, counters)


if __name__ == "__main__":
    main()
