"""The child process that renders client-supplied chat templates (``python -m`` this module).

A request template is code from the network: Jinja's sandbox stops it from touching the host,
but not from looping for hours (``{% for a in range(10**9) %}``) or filling memory. So it is
rendered here, in a process the gateway can kill (`template_pool`), never in the gateway
itself: a thread cannot be stopped and would hold the GIL the event loop needs.

Protocol on stdin/stdout, one job at a time:

* start-up: the pool writes one init line (unused here, ``{}``); the child imports Jinja
  (through transformers, for the same rendering as `PromptCounter`), caps its address
  space (``RLIMIT_AS``), lowers its CPU priority, then writes ``{"ready": true}\\n``;
* job: a JSON header line ``{"len": N, "special": {...}}`` followed by N bytes, the client's
  raw request body (so the gateway does no per-job encoding work on its event loop);
* answer: ``{"ok": true, "len": N}\\n`` + N bytes of rendered UTF-8 (surrogates passed
  through), or ``{"error": "message"}\\n``.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import IO, Any

MEMORY_HEADROOM_BYTES = 1024 * 1024 * 1024
"""Address space the child may add after its imports (a render that needs more fails)."""
MAX_RENDERED_CHARS = 16 * 1024 * 1024
"""A longer rendered prompt is refused (no real context is that long)."""
_TEMPLATE_PARAMS = frozenset(
    {
        "chat_template",
        "tools",
        "documents",
        "conversations",
        "add_generation_prompt",
        "continue_final_message",
        "return_assistant_tokens_mask",
    }
)


def _address_space_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def render(body: dict[str, Any], special: dict[str, Any]) -> str:
    """Render the request's own template over its messages, as `PromptCounter` renders the
    model's template (same conversion of the messages, same defaults)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from sal_gateway.chat_fields import request_chat_template
    from sal_gateway.tokenizer import conversation

    template = request_chat_template(body)
    extra = body.get("chat_template_kwargs") or {}
    kwargs = {k: v for k, v in extra.items() if k not in _TEMPLATE_PARAMS}
    # Annotated `-> str` upstream, but returns (rendered conversations, generation indices).
    result: Any = render_jinja_template(
        conversations=[conversation(body["messages"])],
        tools=body.get("tools"),
        documents=body.get("documents"),
        chat_template=template,
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        **{**special, **kwargs},
    )
    text = str(result[0][0])
    if len(text) > MAX_RENDERED_CHARS:
        raise ValueError(f"the rendered prompt exceeds {MAX_RENDERED_CHARS} characters")
    return text


def _answer(out: IO[bytes], header: dict[str, Any], payload: bytes = b"") -> None:
    out.write(json.dumps(header).encode() + b"\n" + payload)
    out.flush()


def serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """Answer jobs until stdin closes."""
    while line := inp.readline():
        header = json.loads(line)
        raw = inp.read(int(header["len"]))
        try:
            text = render(json.loads(raw), header.get("special") or {})
        except MemoryError:
            _answer(out, {"error": "the template exceeded the renderer's memory limit"})
        except Exception as exc:  # the template's own error: the client's fault, reported
            _answer(out, {"error": f"{type(exc).__name__}: {str(exc)[:500]}"})
        else:
            data = text.encode("utf-8", "surrogatepass")
            _answer(out, {"ok": True, "len": len(data)}, data)


def main() -> None:
    # Start-up (a second of imports) and runaway templates alike must not take CPU from the
    # gateway's event loop: the parent sets this process's niceness (`worker_proc`).
    from sal_gateway.torch_free import keep_torch_out

    keep_torch_out()  # Jinja only: no torch under the address-space cap
    import transformers.utils.chat_template_utils  # noqa: F401  (import before the cap)

    limit = _address_space_bytes() + MEMORY_HEADROOM_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.stdin.buffer.readline()  # the pool's init line (`worker_proc`): nothing to configure
    _answer(sys.stdout.buffer, {"ready": True})
    serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main()
