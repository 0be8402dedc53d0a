"""Validation of the request bodies of the endpoints beyond completions and chat (pure).

`parse_api_body()` is to the endpoints of `endpoints.ENDPOINTS` what
`request_body.parse_body()` is to completions and chat: it decodes the raw bytes, checks what
the gateway reads (``model``, ``stream``, and whatever it counts), and returns an
`InboundRequest` whose body is forwarded untouched. Malformed input is a `BadRequest` naming the
field; everything the gateway does not read is the backend's business.

How each `Counting` becomes a countable request (the rules of vLLM 0.32's renderers):

* `Counting.RESPONSES`: ``instructions`` becomes a system message, ``input`` as text a user
  message; message items (``{"role", "content"}``, content as text or ``input_text`` /
  ``output_text`` parts) become chat messages; function tools become chat tools; rendered with
  ``add_generation_prompt`` unless the last item is an unfinished assistant message (then
  ``continue_final_message``), and tokenized with ``add_special_tokens`` (vLLM's default for
  this endpoint). Anything else (tool calls and outputs, reasoning items, images, built-in
  tools, ``previous_response_id`` whose history lives in one replica) is not counted.
* `Counting.INPUT`: ``input`` as text, texts or token IDs is counted as completions are
  (``add_special_tokens`` default true); ``messages`` (or ``input`` holding one conversation)
  as chat with ``add_generation_prompt`` default **false** (vLLM's pooling default); batched
  conversations and plugin ``data`` are not counted.
* `Counting.NONE`: only ``model`` and ``stream`` are checked.

A request without ``model`` goes to `default_model` (the only configured model, as vLLM
serves its only model then), else it is refused naming ``model``.
"""

from __future__ import annotations

from typing import Any

from sal_gateway.chat_fields import check_bool_fields, check_chat_fields, check_messages
from sal_gateway.chat_fields import request_chat_template as _request_template
from sal_gateway.endpoints import ApiEndpoint, Counting
from sal_gateway.errors import BadRequest
from sal_gateway.request_body import Endpoint, InboundRequest, PromptInput, decode_json, shown

_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def parse_api_body(
    raw: bytes, endpoint: ApiEndpoint, *, default_model: str | None
) -> InboundRequest:
    """Decode and validate one request body for `endpoint`; `BadRequest` names the first bad
    field. Linear in ``len(raw)``: large bodies come here in a
    `body_worker` process, not on the loop."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = _model(body, default_model)
    stream = _stream(body) if endpoint.streams else False
    base: dict[str, Any] = {
        "body": body,
        "model": model,
        "stream": stream,
        "max_tokens": None,
        "path": endpoint.path,
        "ask_stream_usage": False,
    }
    if endpoint.counting is Counting.RESPONSES:
        return _responses(body, base)
    if endpoint.counting is Counting.INPUT:
        return _pooling_input(body, base)
    return InboundRequest(endpoint=Endpoint.COMPLETIONS, counted=False, **base)


def _model(body: dict[str, Any], default_model: str | None) -> str:
    model = body.get("model")
    if model is None and default_model is not None:
        return default_model
    if not isinstance(model, str) or not model:
        raise BadRequest(
            "`model` is required (the gateway serves several models) and must be a non-empty "
            "string",
            param="model",
        )
    return model


def _stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream")
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise BadRequest(f"`stream` must be a boolean, got {shown(stream)}", param="stream")
    return stream


def _non_negative(body: dict[str, Any], name: str, minimum: int = 0) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(
            f"`{name}` must be an integer >= {minimum}, got {shown(value)}", param=name
        )
    return value


# --- the Responses API -------------------------------------------------------------------


def _responses(body: dict[str, Any], base: dict[str, Any]) -> InboundRequest:
    max_tokens = _non_negative(body, "max_output_tokens")
    base["max_tokens"] = max_tokens
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("`instructions` must be a string", param="instructions")
    value = body.get("input")
    if isinstance(value, str):
        items: list[Any] = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value:
        items = value
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise BadRequest(f"`input[{i}]` must be an object", param="input")
    else:
        raise BadRequest("`input` must be a string or a non-empty list of items", param="input")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("`chat_template_kwargs` must be an object", param="chat_template_kwargs")
    messages = [_responses_message(item) for item in items]
    tools = _responses_tools(body.get("tools"))
    if (
        any(m is None for m in messages)
        or tools is None
        or body.get("previous_response_id") is not None
    ):
        return InboundRequest(endpoint=Endpoint.COMPLETIONS, counted=False, **base)
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    last = items[-1]
    continue_final = last.get("role") == "assistant" and last.get("status") in (
        "in_progress",
        "incomplete",
    )
    options: dict[str, Any] = {
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
        "add_special_tokens": True,
        "chat_template_kwargs": dict(kwargs or {}),
        "tools": tools or None,
    }
    return InboundRequest(
        endpoint=Endpoint.CHAT,
        messages=tuple(m for m in messages if m is not None),
        count_options=options,
        **base,
    )


def _responses_message(item: dict[str, Any]) -> dict[str, Any] | None:
    """A message item as the chat message vLLM makes of it; None when it is not plain text."""
    role = item.get("role")
    if not isinstance(role, str) or item.get("type", "message") != "message":
        return None
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or not content:
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            return None
        text = part.get("text")
        if not isinstance(text, str):
            raise BadRequest("`input[].content[].text` must be a string", param="input")
        texts.append(text)
    if role == "assistant":  # vLLM keeps an assistant message's first part only
        return {"role": role, "content": texts[0]}
    return {"role": role, "content": [{"type": "text", "text": t} for t in texts]}


def _responses_tools(value: object) -> list[dict[str, Any]] | None:
    """Function tools in chat form ([] for none); None when a tool is of another kind."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest("`tools` must be a list of objects", param="tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise BadRequest(f"`tools[{i}]` must be an object", param="tools")
        if tool.get("type") != "function":
            return None
        if not isinstance(tool.get("name"), str):
            raise BadRequest(f"`tools[{i}].name` must be a string", param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        tools.append({"type": "function", "function": function})
    return tools


# --- pooling input -------------------------------------------------------------------------


def _pooling_input(body: dict[str, Any], base: dict[str, Any]) -> InboundRequest:
    base["truncate_to"] = _non_negative(body, "truncate_prompt_tokens", minimum=-1)
    if "messages" in body:
        return _pooling_chat(body, body["messages"], "messages", base)
    value = body.get("input")
    if _is_conversation(value):
        return _pooling_chat(body, value, "input", base)
    if isinstance(value, list) and value and all(_is_conversation(v) for v in value):
        return InboundRequest(endpoint=Endpoint.COMPLETIONS, counted=False, **base)
    if value is None and "data" in body:  # an IO-processor plugin's own input
        return InboundRequest(endpoint=Endpoint.COMPLETIONS, counted=False, **base)
    check_bool_fields(body, ("add_special_tokens",))
    options = {"add_special_tokens": body.get("add_special_tokens", True) is not False}
    return InboundRequest(
        endpoint=Endpoint.COMPLETIONS,
        prompts=_inputs(value),
        count_options=options,
        **base,
    )


def _is_conversation(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )


def _pooling_chat(
    body: dict[str, Any], value: object, field: str, base: dict[str, Any]
) -> InboundRequest:
    try:
        messages = check_messages(value)
    except BadRequest as exc:
        raise BadRequest(exc.message.replace("`messages", f"`{field}"), param=field) from None
    check_chat_fields(body)
    options = {
        "add_generation_prompt": bool(body.get("add_generation_prompt", False)),
        "continue_final_message": bool(body.get("continue_final_message", False)),
        "add_special_tokens": bool(body.get("add_special_tokens", False)),
        "chat_template_kwargs": body.get("chat_template_kwargs") or {},
        "tools": body.get("tools"),
    }
    return InboundRequest(
        endpoint=Endpoint.CHAT,
        messages=messages,
        count_options=options,
        chat_template=_request_template(body),
        **base,
    )


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _inputs(value: object) -> tuple[PromptInput, ...]:
    """Every ``input`` form vLLM's pooling endpoints accept: str, [str], [int], [[int]]."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value:
        if _is_ids(value):
            return (list(value),)
        if all(isinstance(p, str) for p in value):
            return tuple(value)
        if all(_is_ids(p) and p for p in value):
            return tuple(list(p) for p in value)
    raise BadRequest(
        "`input` must be a string, a list of strings, a list of token IDs, a list of lists of "
        "token IDs (non-empty) or a list of chat messages",
        param="input",
    )
