"""Validation of the chat-specific request fields the gateway hands to a chat template (pure).

Everything here reaches Jinja (`tokenizer.PromptCounter` renders the template to count tokens),
so a wrong type must become a 400 naming the field before rendering, never a 500 from deep
inside a template. The checks follow what vLLM 0.32's pydantic models accept
(``ChatCompletionRequest``): they are no stricter than vLLM, so a request vLLM serves passes.
`parse_body()` calls `check_chat_fields()` once per chat request.
"""

from __future__ import annotations

from typing import Any

from sal_gateway.errors import BadRequest

_BOOL_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "echo")


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _is_object(value: object) -> bool:
    return isinstance(value, dict)


def check_bool_fields(body: dict[str, Any], names: tuple[str, ...] = _BOOL_FIELDS) -> None:
    """Each of `names` present in `body` is a boolean (or null)."""
    for name in names:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise BadRequest(f"`{name}` must be a boolean, got {_type_name(value)}", param=name)


def _content_part(where: str, part: object) -> None:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise BadRequest(f"`{where}` must be an object with a string `type`", param="messages")
    if part["type"] == "text" and not isinstance(part.get("text"), str):
        raise BadRequest(f"`{where}.text` must be a string", param="messages")


def check_messages(value: object) -> tuple[dict[str, Any], ...]:
    """`messages`: a non-empty list of objects with a string ``role`` and a content that is
    a string, null or a list of typed parts (``{"type": "text", "text": str}``, or other part
    types passed to the backend as they are)."""
    if not isinstance(value, list) or not value:
        raise BadRequest("`messages` must be a non-empty list", param="messages")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not msg["role"]:
            raise BadRequest(
                f"`messages[{i}]` must be an object with a string `role`", param="messages"
            )
        content = msg.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                _content_part(f"messages[{i}].content[{j}]", part)
        elif content is not None and not isinstance(content, str):
            raise BadRequest(
                f"`messages[{i}].content` must be a string, a list of parts or null",
                param="messages",
            )
        for key in ("name", "tool_call_id"):
            if msg.get(key) is not None and not isinstance(msg[key], str):
                raise BadRequest(f"`messages[{i}].{key}` must be a string", param="messages")
        calls = msg.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(map(_is_object, calls))):
            raise BadRequest(
                f"`messages[{i}].tool_calls` must be a list of objects", param="messages"
            )
    return tuple(value)


def _check_tools(value: object) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise BadRequest(
            f"`tools` must be a list of objects, got {_type_name(value)}", param="tools"
        )
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise BadRequest(f"`tools[{i}]` must be an object", param="tools")
        function = tool.get("function")
        if function is not None and not (
            isinstance(function, dict) and isinstance(function.get("name"), str)
        ):
            raise BadRequest(
                f"`tools[{i}].function` must be an object with a string `name`", param="tools"
            )


def _check_documents(value: object) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(map(_is_object, value)):
        raise BadRequest("`documents` must be a list of objects", param="documents")


def request_chat_template(body: dict[str, Any]) -> str | None:
    """The client-supplied chat template (top level or inside ``chat_template_kwargs``), or
    None; a non-string one is a 400. Call after `check_chat_fields()`."""
    kwargs = body.get("chat_template_kwargs") or {}
    for where, value in (
        ("chat_template", body.get("chat_template")),
        ("chat_template_kwargs.chat_template", kwargs.get("chat_template")),
    ):
        if value is None:
            continue
        if not isinstance(value, str):
            raise BadRequest(f"`{where}` must be a string, got {_type_name(value)}", param=where)
        return value
    return None


def check_chat_fields(body: dict[str, Any]) -> None:
    """The template-facing fields of a chat request: `BadRequest` naming the first bad one."""
    check_bool_fields(body)
    if body.get("add_generation_prompt") and body.get("continue_final_message"):
        raise BadRequest(
            "`add_generation_prompt` and `continue_final_message` cannot both be true",
            param="continue_final_message",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest(
            f"`chat_template_kwargs` must be an object with string keys, got {_type_name(kwargs)}",
            param="chat_template_kwargs",
        )
    _check_tools(body.get("tools"))
    _check_documents(body.get("documents"))
    request_chat_template(body)
