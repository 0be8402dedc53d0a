"""The prefix-real benchmark's pure parts: the multi-turn workload and the report."""

from __future__ import annotations

import itertools

from bench import prefix_bench as pb
from bench.prefix_real import RunResult, build_parser, report
from bench.prefix_workload import SYSTEM_TOKENS, make_workload
from engine_sim.demo import fleet_reuse_rates
from sal_core.policies import BackendView, RouteRequest, make_policy
from tests.conftest import DATA_DIR


def test_workload_is_seeded_fits_the_context_and_shares_only_the_system_prompt() -> None:
    first = make_workload(3, 10, rate_per_s=1.0, think_mean_s=2.0)
    assert first == make_workload(3, 10, rate_per_s=1.0, think_mean_s=2.0)
    assert first != make_workload(4, 10, rate_per_s=1.0, think_mean_s=2.0)
    starts = [c.start_s for c in first]
    assert starts == sorted(starts)
    system = first[0].turns[0].message[:SYSTEM_TOKENS]
    for conv in first:
        assert len(conv.turns) >= 1
        assert conv.turns[0].message[:SYSTEM_TOKENS] == system
        assert conv.turns[0].think_s == 0.0
        total = sum(len(t.message) + t.output_tokens for t in conv.turns)
        assert total <= 2048  # the prompt so far plus the reply always fits the context
    # Different conversations diverge right after the shared system prompt.
    seconds = {c.turns[0].message[SYSTEM_TOKENS : SYSTEM_TOKENS + 8] for c in first}
    assert len(seconds) == len(first)


def test_report_pairs_ratios_by_seed_and_lists_every_run() -> None:
    runs = [
        RunResult("sal+approximate", 0, 10, ttft_p50_s=1.0, ttft_p95_s=2.0, prompt_tokens=100),
        RunResult("p2c", 0, 10, ttft_p50_s=1.5, ttft_p95_s=2.0, prompt_tokens=100),
        RunResult("sal+approximate", 1, 10, ttft_p50_s=2.0, ttft_p95_s=4.0, prompt_tokens=100),
        RunResult("p2c", 1, 10, ttft_p50_s=2.0, ttft_p95_s=2.0, prompt_tokens=100),
    ]
    text = report(runs, build_parser().parse_args(["--seeds", "0,1"]))
    # p50 ratios 1.5 and 1.0 -> median 1.25 (1.00-1.50); p95 1.0 and 0.5.
    assert "| p2c    | 1.25x (1.00x–1.50x) | 0.75x (0.50x–1.00x) |" in text
    assert text.count("| sal+approximate | 0 ") + text.count("| sal+approximate | 1 ") == 2
    assert "`sal-bench prefix-real --seeds 0,1`" in text


def test_mooncake_conversation_windows_are_18_disjoint_full_windows_spread_over_the_trace() -> None:
    """The simulator benchmark's conversation windows: 18, disjoint, each with requests, the
    last inside the trace (three windows could not tell a tie from a loss at saturation)."""
    ctx = pb.Context(data=DATA_DIR, quick=False)
    sc = next(s for s in pb.SCENARIOS if s.name == "conversation-40gb-sat")
    windows = pb.seeds(ctx, sc)
    assert len(windows) == 18
    starts = pb.CONVERSATION_STARTS
    assert all(b - a >= sc.window_s for a, b in itertools.pairwise(starts))
    sizes = [len(pb.workload(ctx, sc, w)) for w in windows]
    assert min(sizes) > 100, sizes
    assert starts[-1] + sc.window_s > 3_000  # the last window samples the trace's end
    assert len(pb.seeds(pb.Context(data=DATA_DIR, quick=True), sc)) == 1


def test_the_paper_memory_what_if_routes_with_beta_times_the_shortfall() -> None:
    # KV short on both; b has more free KV but a far longer queue. `sal` (steps) takes a;
    # the what-if (the paper's beta * shortfall, `sal` before the change) takes b.
    pool = [
        BackendView("a", True, 20, 5_000, 50_000, 2048, num_waiting=5, num_running=15),
        BackendView("b", True, 40, 8_000, 400_000, 2048, num_waiting=30, num_running=10),
    ]
    request = RouteRequest(prompt_tokens=14_000, beta=15.0)
    assert make_policy("sal").select(request, pool).url == "a"
    assert pb.SalPaperMemory().select(request, pool).url == "b"


def test_the_real_path_report_shows_the_gateways_fleet_reuse_estimate() -> None:
    exposition = "\n".join(
        [
            "# HELP sal_prefix_fleet_reuse_prompt_tokens_total ...",
            'sal_prefix_fleet_reuse_prompt_tokens_total{model="tiny"} 1000.0',
            'sal_prefix_fleet_reuse_hit_tokens_total{kv_scale="4",model="tiny"} 700.0',
            'sal_prefix_fleet_reuse_hit_tokens_total{kv_scale="1",model="tiny"} 400.0',
            'sal_prefix_fleet_reuse_hit_tokens_total{kv_scale="2",model="tiny"} 500.0',
        ]
    )
    rates = fleet_reuse_rates(exposition)
    assert list(rates.items()) == [("1", 0.4), ("2", 0.5), ("4", 0.7)]  # by scale
    assert fleet_reuse_rates("") == {}  # nothing routed with a known fleet KV yet
    runs = [
        RunResult("sal+approximate", s, 10, prompt_tokens=100, fleet_reuse=rates) for s in (0, 1)
    ]
    text = report(runs, build_parser().parse_args(["--seeds", "0,1"]))
    assert "0.40 (0.40–0.40) / 0.50 (0.50–0.50) / 0.70 (0.70–0.70)" in text


def test_two_gateway_configs_tell_each_other_blocks_only_when_told() -> None:
    from bench.prefix_real import _gateway_config

    told = _gateway_config(["http://a", "http://b"], ["ipc://x", "ipc://y"],
                           "sal+approximate@2told", 0, (7001, 7002))  # fmt: skip
    alone = _gateway_config(["http://a", "http://b"], ["ipc://x", "ipc://y"],
                            "sal+approximate@2alone", 0, (7002, 7001))  # fmt: skip
    assert (told.routing.policy, told.routing.prefix_cache) == ("sal", "approximate")
    assert told.peers.listen == "127.0.0.1:7001"
    assert told.peers.addresses == ("127.0.0.1:7002",)
    assert told.peers.share_prefix_blocks
    assert alone.peers.enabled  # the counts are shared either way
    assert not alone.peers.share_prefix_blocks
    one = _gateway_config(["http://a"], ["ipc://x"], "sal+kv_events", 0)
    assert (one.routing.prefix_cache, one.peers.enabled) == ("kv_events", False)


def test_the_busiest_replica_share_sums_both_gateways_decisions() -> None:
    from bench.prefix_real import _summarize
    from bench.prefix_workload import Replay

    metrics = "\n".join(
        f'sal_routing_decisions_total{{backend="{b}",model="tiny",policy="sal"}} {n}'
        for b, n in (("http://a", 3), ("http://b", 2), ("http://a", 1), ("http://b", 4))
    )  # gateway 1 then gateway 2: a 4, b 6
    counters = {"hits": 0.0, "queries": 0.0, "preemptions": 0.0}
    result = _summarize(
        "sal+approximate@2told", 0, Replay(), [counters], [counters], {}, metrics, 0.0,
        lambda *_: [],
    )  # fmt: skip
    assert result.busiest_share == 0.6
