"""``sal-bench capacity`` (`bench.capacity`): the bisection, the SLO judgement, the report."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from bench import capacity
from bench.capacity import QUICK, Cell, capacity_rows, find_capacity, probe
from bench.capacity_report import render, replicas_needed
from bench.cli import main
from bench.stacks import STACKS, Stack, engine_config, run_stack, stacks_by_name, tpot_s
from engine_sim.results import RequestOutcome
from engine_sim.schedulers import LarryTailScheduler, make_scheduler
from engine_sim.trace import TraceRequest, gamma_arrivals
from sal_core.larry_tail import TailParams


def test_bisection_finds_a_threshold_within_the_tolerance_from_either_side() -> None:
    for threshold in (0.3, 1.0, 2.7):
        for guess in (0.1, 1.0, 5.0):
            calls: list[float] = []

            def sustains(x: float, t: float = threshold, calls: list[float] = calls) -> bool:
                calls.append(x)
                return x <= t

            found = find_capacity(sustains, guess, rel_tol=0.02)
            assert threshold / 1.02 <= found <= threshold
            assert len(calls) < 40


def test_bisection_reports_zero_and_the_limit_at_the_ends() -> None:
    assert find_capacity(lambda x: False, 1.0, 0.05, limits=(0.1, 10.0)) == 0.0
    assert find_capacity(lambda x: True, 1.0, 0.05, limits=(0.1, 10.0)) == 10.0


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    out = RequestOutcome("r", 0, 0.0, 100, 11, first_token_s=0.5, finish_s=1.5, num_preemptions=0)
    assert tpot_s(out) == pytest.approx(0.1)
    one = RequestOutcome("r", 0, 0.0, 100, 1, first_token_s=0.5, finish_s=0.5, num_preemptions=0)
    assert tpot_s(one) is None


def test_a_stack_is_one_line_of_engine_config_fields() -> None:
    larry = stacks_by_name(["sal+larry"])[0]
    config = engine_config(larry, "llama3-8b-a100")
    assert (config.scheduler, config.alpha) == ("larry", 1.0)
    custom = Stack("sal+larry a=500", "sal", {"scheduler": "larry", "alpha": 500.0})
    assert engine_config(custom, "llama3-8b-a100").alpha == 500.0
    # The tail guard's margin, as a deployment sets it in --additional-config.
    for name, margin in (
        ("sal+larry_tail", TailParams().margin_s),
        ("sal+larry_tail margin 2 s", 2.0),
    ):
        config = engine_config(stacks_by_name([name])[0], "llama3-8b-a100")
        scheduler = make_scheduler(config)
        assert isinstance(scheduler, LarryTailScheduler)
        assert scheduler.params.margin_s == margin
    with pytest.raises(ValueError, match="tail_margin_s"):
        engine_config(custom, "llama3-8b-a100", tail_margin_s=-1.0)
    with pytest.raises(KeyError, match="unknown stack"):
        stacks_by_name(["nope"])


def _cell(rate_per_s: float) -> Cell:
    times = gamma_arrivals(200, rate_per_s, cv=3.0, seed=2)
    reqs = [TraceRequest(t, 400 + (i * 7919) % 3000, 20 + i % 50) for i, t in enumerate(times)]
    return Cell("code", "llama3-8b-a100", 2, 0, reqs)


def test_more_load_fails_the_slo_that_a_light_load_meets() -> None:
    cell = _cell(0.5)
    stack = stacks_by_name(["p2c+fcfs"])[0]
    light, heavy = probe(cell, stack, 0.5), probe(cell, stack, 40.0, early_stop=False)
    assert light.ok
    assert light.ttft_p95_s <= cell.slo.ttft_p95_s
    assert not heavy.ok
    assert heavy.ttft_p95_s > light.ttft_p95_s


def test_every_stack_gets_a_capacity_and_latency_at_the_baselines() -> None:
    cell = _cell(0.5)
    rows = capacity_rows(cell, stacks_by_name(["p2c+fcfs", "sal+fcfs"]), rel_tol=0.1)
    base, sal = rows
    assert base["baseline_capacity_x"] == sal["baseline_capacity_x"] == base["capacity_x"]
    for row in rows:
        assert row["capacity_x"] > 0
        ok = [p["load_x"] for p in row["probes"] if p["ok"]]
        failed = [p["load_x"] for p in row["probes"] if not p["ok"]]
        assert max(ok) == row["capacity_x"]
        assert min(failed) <= row["capacity_x"] * 1.1
        assert row["at_baseline"]["load_x"] == base["capacity_x"]


def test_replicas_needed_is_the_inverse_capacity_ratio() -> None:
    base = [{"capacity_x": 1.0}, {"capacity_x": 2.0}]
    better = [{"capacity_x": 1.25}, {"capacity_x": 2.5}]
    assert replicas_needed(base, better) == [0.8, 0.8]


@pytest.mark.slow
def test_the_quick_command_writes_report_json_and_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = capacity.Plan(("code",), (("llama3-8b-a100", 2),), 120.0, 3, 0.25)
    monkeypatch.setattr(capacity, "QUICK", tiny)
    names = "p2c+fcfs,sal+fcfs"
    assert main(["capacity", "--quick", "--stacks", names, "--out", str(tmp_path)]) == 0
    first = (tmp_path / "capacity.json").read_text()
    data = json.loads(first)
    assert {r["stack"] for r in data["rows"]} == {"p2c+fcfs", "sal+fcfs"}
    assert {r["window"] for r in data["rows"]} == {0, 1, 2}
    md = (tmp_path / "capacity.md").read_text()
    assert "replicas needed for the same traffic" in md
    assert "| sal+fcfs |" in md
    assert (tmp_path / "capacity.png").stat().st_size > 1000
    assert not (tmp_path / "capacity.partial.json").exists()
    assert render(data["rows"], data["meta"]) == md
    # Another stack merged in: the others' rows stay, every stack in table order.
    merged = "sal+larry_tail margin 2 s"
    assert main(["capacity", "--quick", "--stacks", merged, "--merge", "--out", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "capacity.json").read_text())
    kept = [r for r in again["rows"] if r["stack"] != merged]
    assert {json.dumps(r, sort_keys=True) for r in kept} >= {
        json.dumps(r, sort_keys=True) for r in json.loads(first)["rows"] if r["stack"] == "sal+fcfs"
    }
    order = ["p2c+fcfs", *(s.name for s in STACKS if s.name != "p2c+fcfs")]
    stacks = [r["stack"] for r in again["rows"]]
    assert set(stacks) == {"p2c+fcfs", "sal+fcfs", merged}
    assert [order.index(s) for s in stacks] == sorted(order.index(s) for s in stacks)
    assert again["meta"]["wall_s"] > data["meta"]["wall_s"]
    assert f"| {merged} |" in (tmp_path / "capacity.md").read_text()
    # A full run cannot be merged into a quick one's results (it refuses before measuring).
    assert main(["capacity", "--stacks", "sal+fcfs", "--merge", "--out", str(tmp_path)]) == 2


def test_an_unknown_stack_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--stacks", "sal+nope"]) == 2
    assert "unknown stack 'sal+nope'" in capsys.readouterr().err


def test_stacks_that_need_prefix_reuse_are_registered_but_skipped_without_it() -> None:
    from bench.stacks import for_workload

    assert any(s.needs_reuse for s in STACKS)
    assert all(not s.needs_reuse for s in for_workload(STACKS, has_reuse=False))
    assert QUICK.windows >= 3


def test_on_multi_turn_chat_load_is_more_conversations_with_the_same_think_times() -> None:
    from bench.windows import multiturn_lengths
    from tests.conftest import DATA_DIR

    cell = Cell("multiturn", "llama31-8b-a100-80gb", 2, 0, (), 120.0, multiturn_lengths(DATA_DIR))
    light, heavy = cell.requests_at(1.0), cell.requests_at(2.0)
    conversations = {r.session for r in light}
    assert len({r.session for r in heavy}) >= 1.8 * len(conversations)
    # Each conversation's turns keep their spacing: the clock is not compressed.
    first = sorted((r for r in light if r.session == min(conversations)), key=lambda r: r.arrival_s)
    assert len(first) >= 2
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(first)]
    assert all(5.0 <= g <= 60.0 for g in gaps)


def test_with_prefix_reuse_the_cache_aware_stacks_see_the_cache_and_the_blind_ones_do_not() -> None:
    from bench.windows import multiturn_lengths
    from tests.conftest import DATA_DIR

    cell = Cell("multiturn", "llama31-8b-a100-80gb", 2, 0, (), 120.0, multiturn_lengths(DATA_DIR))
    sal, blind = stacks_by_name(["sal+fcfs", "sal_paper+fcfs"])
    aware, paper = probe(cell, sal, 1.0), probe(cell, blind, 1.0)
    # Replicas cache prefixes for every stack (vLLM's default); only a router that knows
    # where they are keeps conversations on them: more hits, lower TTFT at the same load.
    assert paper.hit_rate > 0
    assert aware.hit_rate > paper.hit_rate + 0.1
    assert aware.ttft_p95_s < paper.ttft_p95_s


def test_an_overloaded_probe_stops_early_with_the_same_verdict() -> None:
    cell = _cell(0.5)
    stack = stacks_by_name(["p2c+fcfs"])[0]
    for load_x in (0.5, 40.0):
        fast, whole = probe(cell, stack, load_x), probe(cell, stack, load_x, early_stop=False)
        assert fast.ok == whole.ok
        assert not whole.aborted
        if whole.ok:  # nothing to cut short: the very same run
            assert fast == whole
    heavy = probe(cell, stack, 40.0)
    assert heavy.aborted
    assert heavy.unfinished > 0


def test_late_abort_counts_only_requests_certainly_over_the_objective() -> None:
    from engine_sim.simulator import LateAbort, RouterConfig
    from sal_core.percentile import percentile

    cell = _cell(0.5)
    reqs = cell.requests_at(8.0)
    stack = stacks_by_name(["p2c+fcfs"])[0]
    whole = run_stack(reqs, stack, profile=cell.profile, replicas=2, router=RouterConfig())
    ttft = sorted(o.ttft_s for o in whole.outcomes)
    slo_s = percentile(ttft, 50)  # half the requests are over it in the whole run
    late = sum(t > slo_s for t in ttft)
    just_below = run_stack(
        reqs, stack, profile=cell.profile, replicas=2, abort=LateAbort(slo_s, late)
    )
    assert not just_below.aborted
    assert just_below.outcomes == whole.outcomes
    cut = run_stack(reqs, stack, profile=cell.profile, replicas=2, abort=LateAbort(slo_s, late - 1))
    assert cut.aborted
    assert cut.unfinished > 0
