"""The API surface the gateway relays: one registry, path -> how it is counted and routed (pure).

`ENDPOINTS` lists every JSON endpoint of vLLM 0.32's and 0.33's OpenAI-compatible servers that
the gateway relays (read from ``vllm/entrypoints/*/api_router.py``; `ApiEndpoint.since` marks
the ones a later release added). It drives the app's routes
(`app.create_app`), the front door's concurrency limit (`RELAYED_PATHS`), the request-body
parser (`api_body`), the routing policy per request (`route_policy`), the "API surface" table
of docs/gateway.md (`markdown_table`; a test keeps the two equal) and the tests.

Each endpoint has:

* a `Family`: which replicas can serve it. ``generate`` and ``pooling`` endpoints exist only
  on replicas started with that runner (vLLM registers its routes by the model's supported
  tasks), so the gateway sends them only to models configured with that ``runner``;
  ``tokenizer`` endpoints exist on every replica.
* a `Counting`: how the gateway counts the request's prompt tokens before routing it.
  Counted requests are routed by the configured policy (SAL uses the count) and booked in the
  state table like chat. `Counting.NONE` requests are routed by `FALLBACK_POLICY` when the
  configured policy needs a token count (see `route_policy` for why).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

FALLBACK_POLICY = "least_requests"
"""Routes requests whose prompt tokens the gateway cannot count, when the configured policy
needs a count: with no size known, the number of requests in flight is the best load signal
the gateway has, and it books no phantom KV tokens in the state table."""

TOKEN_AWARE_POLICIES = frozenset({"sal", "sal_paper", "sal_near", "llm_d", "cache_aware"})
"""Policies whose decision uses the prompt token count."""


class Family(Enum):
    """Which replicas serve an endpoint (vLLM mounts routes by the model's runner)."""

    GENERATE = "generate"
    POOLING = "pooling"
    TOKENIZER = "tokenizer"
    """Served by every replica, whatever its runner; no engine work."""


class Counting(Enum):
    """How the gateway counts an endpoint's prompt tokens (`api_body` implements each)."""

    PROMPT = "prompt"
    """``prompt``: text, texts, token IDs (as completions)."""
    CHAT = "chat"
    """``messages`` through the model's chat template (as chat completions)."""
    RESPONSES = "responses"
    """``instructions`` + ``input`` (text, or message items) through the chat template."""
    INPUT = "input"
    """Pooling ``input`` (text, texts, token IDs) or ``messages``/``input`` as a chat."""
    NONE = "none"
    """Not counted (see `ApiEndpoint.why`)."""


@dataclass(frozen=True, slots=True)
class ApiEndpoint:
    """One relayed endpoint (``POST``, JSON body)."""

    path: str
    family: Family
    counting: Counting
    streams: bool
    """The endpoint answers ``stream: true`` with server-sent events."""
    sdk: str
    """The openai SDK call that reaches it ("" when the SDK has none)."""
    why: str
    """Why it is counted and routed as it is (the docs table's last column)."""
    since: tuple[int, int, int] = (0, 32, 0)
    """The first vLLM release that serves it (a replica of an earlier one answers 404)."""


def _ep(
    path: str,
    family: Family,
    counting: Counting,
    why: str,
    *,
    streams: bool = False,
    sdk: str = "",
    since: tuple[int, int, int] = (0, 32, 0),
) -> ApiEndpoint:
    return ApiEndpoint(path, family, counting, streams, sdk, why, since)


_G, _P, _T = Family.GENERATE, Family.POOLING, Family.TOKENIZER
_PAIRS = (
    "query-document pairs: a bi-encoder embeds each text, a cross-encoder each pair, and the "
    "gateway cannot tell which it is; documents may be images"
)
_NO_ENGINE = "no engine work (the API server tokenizes): nothing to balance but requests"

ENDPOINTS: tuple[ApiEndpoint, ...] = (
    _ep(
        "/v1/completions",
        _G,
        Counting.PROMPT,
        "prompt tokenized as vLLM does",
        streams=True,
        sdk="completions.create",
    ),
    _ep(
        "/v1/chat/completions",
        _G,
        Counting.CHAT,
        "messages rendered with the chat template",
        streams=True,
        sdk="chat.completions.create",
    ),
    _ep(
        "/v1/responses",
        _G,
        Counting.RESPONSES,
        "instructions + input rendered with the chat template, as vLLM does",
        streams=True,
        sdk="responses.create",
    ),
    _ep(
        "/v1/chat/completions/batch",
        _G,
        Counting.NONE,
        "vLLM-only batch of conversations; not counted (rare, non-streaming)",
    ),
    _ep(
        "/v1/messages",
        _G,
        Counting.NONE,
        "Anthropic Messages format: vLLM converts it to chat with rules the gateway does "
        "not mirror",
        streams=True,
    ),
    _ep("/generative_scoring", _G, Counting.NONE, "vLLM-specific; not counted"),
    _ep(
        "/v1/decisions",
        _G,
        Counting.NONE,
        "vLLM 0.33+, structured decisions: vLLM builds the prompt from `input` and "
        "`questions` with per-model rules the gateway does not mirror; not counted",
        sdk="decisions.create",
        since=(0, 33, 0),
    ),
    _ep(
        "/v1/embeddings",
        _P,
        Counting.INPUT,
        "input (text, token IDs or messages) tokenized as vLLM does",
        sdk="embeddings.create",
    ),
    _ep("/pooling", _P, Counting.INPUT, "input tokenized as for embeddings"),
    _ep("/classify", _P, Counting.INPUT, "input tokenized as for embeddings"),
    _ep("/v2/embed", _P, Counting.NONE, "Cohere format (texts, images); not counted"),
    _ep("/score", _P, Counting.NONE, _PAIRS),
    _ep("/v1/score", _P, Counting.NONE, _PAIRS),
    _ep("/rerank", _P, Counting.NONE, _PAIRS),
    _ep("/v1/rerank", _P, Counting.NONE, _PAIRS),
    _ep("/v2/rerank", _P, Counting.NONE, _PAIRS),
    _ep(
        "/cohere/v2/chat",
        _G,
        Counting.NONE,
        "Cohere chat format (vLLM serves it with VLLM_ENABLE_COHERE_API); not counted",
        streams=True,
    ),
    _ep("/tokenize", _T, Counting.NONE, _NO_ENGINE),
    _ep("/detokenize", _T, Counting.NONE, _NO_ENGINE),
    _ep("/v1/messages/count_tokens", _G, Counting.NONE, _NO_ENGINE),
    *(
        _ep(p, _G, Counting.NONE, _NO_ENGINE + " (vLLM serves it with --enable-scale-out)")
        for p in (
            "/v1/chat/completions/render",
            "/v1/completions/render",
            "/v1/responses/render",
            "/v1/messages/render",
            "/cohere/v2/chat/render",
            "/v1/chat/completions/derender",
            "/v1/completions/derender",
        )
    ),
)
"""Every relayed endpoint, in the order the docs list them."""

BY_PATH: dict[str, ApiEndpoint] = {e.path: e for e in ENDPOINTS}
RELAYED_PATHS = frozenset(BY_PATH)
"""Paths whose requests count against ``limits.max_concurrent_requests``."""
LEGACY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Parsed by `request_body.parse_body` (the others by `api_body.parse_api_body`)."""


GATEWAY_OWN = frozenset({"/v1/models", "/health", "/metrics"})
"""vLLM paths the gateway answers itself (``/v1/models``: the replicas' union)."""

_REPLICA_ADMIN = "operator action on one replica (address the replica, not the fleet)"
_REPLICA_INFO = "describes one replica (the gateway's own /health, /ready, /metrics cover it)"
NOT_RELAYED: dict[str, str] = {
    "/v1/responses/{response_id}": (
        "stored responses live in one replica's memory (VLLM_ENABLE_RESPONSES_API_STORE, off "
        "by default); the gateway keeps no response-to-replica affinity"
    ),
    "/v1/responses/{response_id}/cancel": "as above: only the replica that stored it knows it",
    "/v1/audio/transcriptions": "multipart form body (speech models), not JSON",
    "/v1/audio/translations": "multipart form body (speech models), not JSON",
    "/v1/realtime": "WebSocket (speech models)",
    "/v1/systemone": "experimental; vLLM leaves its handler unset unless configured for it",
    "/inference/v1/generate": "disaggregated-serving internals, sent to one replica by its "
    "orchestrator (--enable-scale-out)",
    "/inference/v1/abort_requests": "disaggregated-serving internals (per replica)",
    "/abort_requests": "per-replica control (RL / scale-out)",
    "/invocations": "SageMaker's single entry point (the gateway is not a SageMaker container)",
    "/ping": "SageMaker health check of one container",
    "/v1/load_lora_adapter": _REPLICA_ADMIN,
    "/v1/unload_lora_adapter": _REPLICA_ADMIN,
    "/tokenizer_info": _REPLICA_INFO,
    "/load": _REPLICA_INFO,
    "/version": _REPLICA_INFO,
    "/server_info": _REPLICA_INFO,
    "/kv_event_sources": _REPLICA_INFO,
    "/is_sleeping": _REPLICA_INFO,
    "/is_paused": _REPLICA_INFO,
    "/is_scaling_elastic_ep": _REPLICA_INFO,
    "/get_world_size": _REPLICA_INFO,
    "/weight_info": _REPLICA_INFO,
    "/fault_tolerance/status": _REPLICA_INFO,
    **{
        p: _REPLICA_ADMIN
        for p in (
            "/start_profile",
            "/stop_profile",
            "/sleep",
            "/wake_up",
            "/release_kv_cache_memory",
            "/reset_prefix_cache",
            "/reset_mm_cache",
            "/reset_encoder_cache",
            "/collective_rpc",
            "/pause",
            "/resume",
            "/scale_elastic_ep",
            "/fault_tolerance/apply",
            "/init_weight_transfer_engine",
            "/shutdown_weight_transfer_engine",
            "/start_weight_update",
            "/start_draft_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/update_weight_version",
            "/weight_checker",
        )
    },
}
"""vLLM 0.32 and 0.33 routes the gateway does not relay, and why (answered 404 naming the
path)."""


def route_policy(counted: bool, configured: str) -> str | None:
    """The policy that routes a request: None for the configured one.

    A request the gateway did not count (`Counting.NONE`, or a form of a counted endpoint it
    cannot tokenize) is routed by `FALLBACK_POLICY` when the configured policy needs a count
    (SAL): given a count of 0, SAL would take it for free and send every such request to the
    backend with the most free KV cache, whatever its real size."""
    if not counted and configured in TOKEN_AWARE_POLICIES:
        return FALLBACK_POLICY
    return None


def serves(endpoint: ApiEndpoint, runner: str) -> bool:
    """Whether a replica started with `runner` (``generate`` or ``pooling``) has `endpoint`."""
    return endpoint.family is Family.TOKENIZER or endpoint.family.value == runner


_COUNTED = {
    Counting.PROMPT: "`prompt`",
    Counting.CHAT: "`messages` via chat template",
    Counting.RESPONSES: "`instructions` + `input` via chat template",
    Counting.INPUT: "`input` (or `messages`)",
    Counting.NONE: "not counted",
}


def markdown_table(configured_policy: str = "sal") -> str:
    """The docs' endpoint table (docs/gateway.md "API surface"), from the registry."""
    rows = [
        "| Path | Method | Replicas | Prompt tokens | Routed by | Why |",
        "|---|---|---|---|---|---|",
    ]
    for e in ENDPOINTS:
        counted = e.counting is not Counting.NONE
        policy = route_policy(counted, configured_policy) or "configured policy (SAL: tokens)"
        sdk = f" (SDK: `{e.sdk}`)" if e.sdk else ""
        stream = ", streams" if e.streams else ""
        rows.append(
            f"| `{e.path}`{sdk} | POST{stream} | {e.family.value} | {_COUNTED[e.counting]} "
            f"| {policy} "
            f"| {e.why} |"
        )
    return "\n".join(rows)
