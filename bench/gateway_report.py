"""Print the gateway benchmark's raw report (`bench.gateway_bench.run_all`) as Markdown tables."""

from __future__ import annotations

from typing import Any

from bench.tables import format_table

_LATENCY_HEADERS = [
    "streams",
    "direct p50",
    "direct p99",
    "gateway p50",
    "gateway p99",
    "added p50",
    "added p99",
    "direct TTFT p50",
    "gateway TTFT p50",
    "added TTFT p99",
    "requests",
    "errors",
]
_LATENCY_KEYS = [
    "concurrency",
    "direct_p50_ms",
    "direct_p99_ms",
    "gateway_p50_ms",
    "gateway_p99_ms",
    "added_p50_ms",
    "added_p99_ms",
    "direct_ttft_p50_ms",
    "gateway_ttft_p50_ms",
    "added_ttft_p99_ms",
    "requests",
    "errors",
]


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``"0.42x"``; ``"n/a"`` when ``b`` is 0."""
    return f"{a / b:.2f}x" if b else "n/a"


def _latency_table(rows: list[dict[str, Any]]) -> str:
    table = format_table(_LATENCY_HEADERS, [[r[k] for k in _LATENCY_KEYS] for r in rows])
    failures = [
        f"\n* {r['concurrency']} streams: {r['errors']} errors, e.g. {r['error_sample'][:300]}"
        for r in rows
        if r["errors"]
    ]
    return table + "".join(failures)


def print_report(report: dict[str, Any]) -> None:
    """Print every section of ``report`` (sections missing from it are left out)."""
    sizing = report["sizing"]
    print(
        f"Gateway routing policy: {report.get('policy', 'sal')}; load cells of "
        f"{sizing['duration_s']} s (paced {sizing['paced_duration_s']} s), at most "
        f"{sizing['max_requests']} requests each."
    )
    print("\n## Added latency, saturating: SSE, 8 tokens, no delays (ms, full response)\n")
    print(_latency_table(report["added_latency"]))
    paced = report["paced_profile"]
    print(
        f"\n## Added latency, paced: SSE, {paced['tokens']} tokens, first after "
        f"{paced['first_byte_s'] * 1e3:.0f} ms, then every {paced['chunk_s'] * 1e3:.0f} ms (ms)\n"
    )
    print(_latency_table(report["paced_latency"]))

    tp = report["throughput"]
    sse = report["added_latency"][-1]
    print("\n## Throughput of one gateway process (saturating load)\n")
    rows = [
        [
            f"non-streaming req/s (c={tp['concurrency']})",
            tp["direct_req_per_s"],
            tp["gateway_req_per_s"],
            ratio(tp["gateway_req_per_s"], tp["direct_req_per_s"]),
        ],
        [
            f"SSE req/s (c={sse['concurrency']})",
            sse["direct_req_per_s"],
            sse["gateway_req_per_s"],
            ratio(sse["gateway_req_per_s"], sse["direct_req_per_s"]),
        ],
        [
            f"SSE events/s relayed (c={sse['concurrency']})",
            sse["direct_events_per_s"],
            sse["gateway_events_per_s"],
            ratio(sse["gateway_events_per_s"], sse["direct_events_per_s"]),
        ],
    ]
    print(format_table(["measure", "direct", "via gateway", "gateway/direct"], rows))

    stall = report.get("tokenize_stall")
    if stall:
        print(
            f"\n## Do long prompts stall other requests? {stall['small_concurrency']} short SSE "
            f"streams, alone and beside {stall['long_concurrency']} clients sending "
            f"{stall['long_prompt_words']}-word prompts (ms)\n"
        )
        rows = [
            ["short requests alone", stall["alone_p50_ms"], stall["alone_p99_ms"]],
            ["short requests beside long prompts", stall["with_long_p50_ms"],
             stall["with_long_p99_ms"]],
            [f"the long-prompt requests ({stall['long_req_per_s']:.0f} req/s)",
             stall["long_p50_ms"], float("nan")],
        ]  # fmt: skip
        print(format_table(["requests", "p50 ms", "p99 ms"], rows))
        if stall["errors"]:
            print(f"\n* {stall['errors']} errors, e.g. {stall['error_sample'][:300]}")

    if report.get("stacks"):
        print("\n## Client stacks: bare streaming proxies vs the gateway, 200 SSE streams\n")
        base = report["stacks"][0]["req_per_s"]
        print(
            format_table(
                ["stack", "req/s", "vs direct", "p50 ms", "p99 ms", "errors"],
                [
                    [
                        r["stack"],
                        r["req_per_s"],
                        ratio(r["req_per_s"], base),
                        r["p50_ms"],
                        r["p99_ms"],
                        r["errors"],
                    ]
                    for r in report["stacks"]
                ],
            )
        )

    print("\n## Routing decision time, 64 backends (microseconds per call)\n")
    print(
        format_table(
            ["policy", "mean us", "p50 us", "p99 us", "calls"],
            [
                [r["policy"], r["mean_us"], r["p50_us"], r["p99_us"], r["calls"]]
                for r in report["decisions"]
            ],
        )
    )
    if report.get("prefix_costs"):
        print("\n## Prefix cache cost per request, 64 replicas, 8k-token prompt (microseconds)\n")
        print(
            format_table(
                ["step", "p50 us", "p99 us"],
                [[r["step"], r["p50_us"], r["p99_us"]] for r in report["prefix_costs"]],
            )
        )
    print("\n## Tokenization (gateway tokenizer module, tiny model; per request)\n")
    print(
        format_table(
            ["input", "tokens", "p50 ms", "p99 ms", "reps"],
            [
                [r["name"], r["tokens"], r["p50_ms"], r["p99_ms"], r["reps"]]
                for r in report["tokenization"]
            ],
        )
    )
