"""HTTP checks of scripts/compose-smoke.sh against the running CPU compose stack.

The shell script owns Docker (engine, images, compose); this module only talks HTTP to the
ports compose published on 127.0.0.1:

    python scripts/compose_smoke.py ready GATEWAY_URL N        wait until N replicas are eligible
    python scripts/compose_smoke.py traffic GATEWAY_URL MODEL  OpenAI SDK requests, counted
    python scripts/compose_smoke.py prometheus PROM_URL GATEWAY_URL N
        targets API: the gateway and N replicas up; every dashboard and alert-rule query
        returns data there
    python scripts/compose_smoke.py targets PROM_URL N         wait until exactly N replicas are
                                                               scraped (after scaling)

Each command prints one summary line and exits non-zero with the reason when a check fails.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import promql_parser
import yaml

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "sal.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"

GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$model": ".*"}
"""What Grafana substitutes before a dashboard query reaches Prometheus ($model: "All")."""
COMPARISONS = frozenset({"==", "!=", ">", "<", ">=", "<=", "and", "or", "unless"})


class SmokeError(Exception):
    """A check failed; the message says what was seen."""


def get_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.load(response)


def get_text(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text: str = response.read().decode()
        return text


def wait_for(what: str, probe: Callable[[], str | None], timeout_s: float) -> None:
    """Call `probe` every second until it returns None (done) or `timeout_s` passes.

    `probe` returns what it saw while not done; the last observation goes into the error.
    """
    deadline = time.monotonic() + timeout_s
    seen: str | None = "nothing yet"
    while time.monotonic() < deadline:
        try:
            seen = probe()
        except OSError as exc:  # connection refused/reset while a container starts
            seen = repr(exc)
        if seen is None:
            return
        time.sleep(1.0)
    raise SmokeError(f"timed out after {timeout_s:.0f} s waiting for {what}; last seen: {seen}")


# --- the gateway -------------------------------------------------------------------------


def cmd_ready(gateway: str, replicas: int, timeout_s: float) -> None:
    def probe() -> str | None:
        body = get_json(f"{gateway}/ready")
        counts = body.get("eligible_backends", {})
        return None if body.get("ready") and set(counts.values()) == {replicas} else str(body)

    wait_for(f"{replicas} eligible replicas behind {gateway}/ready", probe, timeout_s)
    print(f"gateway /ready: {replicas} eligible replicas")


def cmd_traffic(
    gateway: str, base_model: str, requests: int, concurrency: int, adapters: Sequence[str] = ()
) -> None:
    """Completions and chat completions, half of them streamed, through the OpenAI SDK; with
    `adapters`, every third request names one of them in turn instead of the model."""
    from openai import OpenAI  # the dev extra; imported here so --help works without it

    client = OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=60)

    def one(i: int) -> int:
        model = adapters[(i // 3) % len(adapters)] if adapters and i % 3 == 2 else base_model
        prompt = f"request {i}: " + "lorem ipsum " * (5 + 7 * (i % 9))
        max_tokens = 4 + i % 13
        stream = i % 2 == 1
        if i % 4 < 2:
            if stream:
                chunks = client.completions.create(
                    model=model, prompt=prompt, max_tokens=max_tokens, stream=True
                )
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                return max_tokens if text else 0
            done = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens)
            return done.usage.completion_tokens if done.usage else 0
        messages: Any = [{"role": "user", "content": prompt}]
        if stream:
            events = client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, stream=True
            )
            text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
            return max_tokens if text else 0
        answer = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens
        )
        return answer.usage.completion_tokens if answer.usage else 0

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = list(pool.map(one, range(requests)))
    elapsed_s = time.monotonic() - started
    empty = sum(1 for t in tokens if t == 0)
    if empty:
        raise SmokeError(f"{empty} of {requests} requests came back without output")
    named = f", a third naming {', '.join(adapters)}" if adapters else ""
    print(
        f"traffic: {requests} requests served (completions + chat, half streamed, "
        f"{concurrency} concurrent{named}) in {elapsed_s:.1f} s, {sum(tokens)} output tokens"
    )


# --- Prometheus --------------------------------------------------------------------------


def targets_by_job(prometheus: str) -> dict[str, list[tuple[str, str]]]:
    body = get_json(f"{prometheus}/api/v1/targets?state=active")
    jobs: dict[str, list[tuple[str, str]]] = {}
    for target in body["data"]["activeTargets"]:
        jobs.setdefault(target["labels"]["job"], []).append(
            (target["labels"]["instance"], target["health"])
        )
    return jobs


def wait_for_targets(prometheus: str, replicas: int, timeout_s: float) -> str:
    def probe() -> str | None:
        jobs = targets_by_job(prometheus)
        gateway, vllm = jobs.get("sal-gateway", []), jobs.get("vllm", [])
        all_up = all(health == "up" for _, health in gateway + vllm)
        return None if len(gateway) == 1 and len(vllm) == replicas and all_up else str(jobs)

    wait_for(f"Prometheus to scrape the gateway and {replicas} replicas, all up", probe, timeout_s)
    jobs = targets_by_job(prometheus)
    return ", ".join(
        f"{job}: {sum(h == 'up' for _, h in targets)}/{len(targets)} up"
        for job, targets in sorted(jobs.items())
    )


def dashboard_queries() -> Iterator[tuple[str, str]]:
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            yield f"panel {panel['title']!r}", expr


def alert_queries() -> Iterator[tuple[str, str]]:
    """Each alert's operands: the rule itself is empty while nothing is wrong, so what must
    return data is what it compares (``up{job="sal-gateway"}`` of ``... == 0``)."""
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            for operand in _operands(promql_parser.parse(rule["expr"])):
                yield f"alert {rule['alert']}", operand


def _operands(node: Any) -> Iterator[str]:
    if isinstance(node, promql_parser.BinaryExpr) and str(node.op) in COMPARISONS:
        yield from _operands(node.lhs)
        yield from _operands(node.rhs)
    elif isinstance(node, promql_parser.ParenExpr):
        yield from _operands(node.expr)
    elif not isinstance(node, promql_parser.NumberLiteral):
        yield node.prettify()


def selectors(expr: str) -> list[str]:
    found: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node.prettify())

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def instant_query(prometheus: str, expr: str) -> list[Any]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = get_json(url)
    if body.get("status") != "success":
        raise SmokeError(f"Prometheus rejected {expr!r}: {body}")
    result: list[Any] = body["data"]["result"]
    return result


def counted_families(metrics_text: str) -> set[str]:
    """Counter families the gateway announces (``# TYPE x counter``), by sample name."""
    return {
        f"{m[1]}_total"
        for m in re.finditer(r"^# TYPE (\w+?)(?:_total)? counter$", metrics_text, re.MULTILINE)
    }


def check_queries(prometheus: str, gateway: str) -> str:
    """Every query returns data, except where a selector matches nothing because it counts
    failures that did not happen (a counter the gateway exports with no sample of that kind:
    5xx, retries, broken streams, ejections); those are listed, not hidden."""
    counters = counted_families(get_text(f"{gateway}/metrics"))
    queries = [*dashboard_queries(), *alert_queries()]
    no_failures: set[str] = set()
    with_data = 0
    for where, expr in queries:
        if instant_query(prometheus, expr):
            with_data += 1
            continue
        empty = [s for s in selectors(expr) if not instant_query(prometheus, s)]
        unexplained = [s for s in empty if s.split("{")[0] not in counters]
        if unexplained or not empty:
            raise SmokeError(f"{where}: {expr!r} returned no data (empty: {unexplained or expr})")
        no_failures.update(empty)
    line = f"queries: {with_data}/{len(queries)} dashboard and alert queries returned data"
    if no_failures:
        # One name per failure kind: the dashboard's copy differs only by `model=~".*"`.
        kinds = {re.sub(r',?model=~"\.\*",?|\{\}', "", s).replace("{}", "") for s in no_failures}
        line += "; empty only because no such failure happened: " + ", ".join(sorted(kinds))
    return line


def cmd_prometheus(prometheus: str, gateway: str, replicas: int, timeout_s: float) -> None:
    print("prometheus targets: " + wait_for_targets(prometheus, replicas, timeout_s))
    # Rates need two scrapes of the traffic (scrape_interval 5 s).
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            print(check_queries(prometheus, gateway))
            return
        except SmokeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(5.0)


def cmd_targets(prometheus: str, replicas: int, timeout_s: float) -> None:
    print("prometheus targets: " + wait_for_targets(prometheus, replicas, timeout_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-s", type=float, default=120.0)
    commands = parser.add_subparsers(dest="command", required=True)
    ready = commands.add_parser("ready")
    ready.add_argument("gateway")
    ready.add_argument("replicas", type=int)
    traffic = commands.add_parser("traffic")
    traffic.add_argument("gateway")
    traffic.add_argument("model")
    traffic.add_argument("--requests", type=int, default=64)
    traffic.add_argument("--concurrency", type=int, default=8)
    traffic.add_argument("--adapter", action="append", default=[], help="a LoRA adapter's name")
    prometheus = commands.add_parser("prometheus")
    prometheus.add_argument("prometheus")
    prometheus.add_argument("gateway")
    prometheus.add_argument("replicas", type=int)
    targets = commands.add_parser("targets")
    targets.add_argument("prometheus")
    targets.add_argument("replicas", type=int)
    args = parser.parse_args(argv)
    try:
        if args.command == "ready":
            cmd_ready(args.gateway, args.replicas, args.timeout_s)
        elif args.command == "traffic":
            cmd_traffic(args.gateway, args.model, args.requests, args.concurrency, args.adapter)
        elif args.command == "prometheus":
            cmd_prometheus(args.prometheus, args.gateway, args.replicas, args.timeout_s)
        else:
            cmd_targets(args.prometheus, args.replicas, args.timeout_s)
    except SmokeError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
