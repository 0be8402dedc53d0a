"""`bench.prefix_report`: medians with spreads, ties, and the aims verdicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.prefix_report import aims, ratio, write_report
from bench.spread import verdict


def _row(router: str, seed: int, p50: float, **extra: float) -> dict[str, Any]:
    base = {
        "scenario": "s", "router": router, "engine": "fcfs", "seed": seed, "requests": 10,
        "unfinished": 0, "ttft_p50_s": p50, "ttft_p95_s": 2 * p50, "ttft_p99_s": 3 * p50,
        "tgt_p50_s": 9.0, "hit_rate": 0.5, "predicted_hit_rate": 0.4,
        "preemptions_per_100": 0.0, "busiest_share": 0.3,
    }  # fmt: skip
    return {**base, **extra}


def _doc(rows: list[dict[str, Any]], regime: str) -> dict[str, Any]:
    scenario = {
        "name": "s", "workload": "chat", "profile": "p", "replicas": 4, "load_factor": 1.0,
        "window_s": 1.0, "think_time_s": [5, 60], "regime": regime,
    }  # fmt: skip
    return {"command": "cmd", "wall_s": 60.0, "scenarios": [scenario], "results": {"s": rows}}


def test_comparisons_are_paired_per_seed_not_spreads_that_overlap() -> None:
    # The windows differ a lot, so the two routers' spreads overlap, but the paper's SAL is
    # 10 % slower on every window: a paired win, not a tie.
    rows = [_row("sal", s, p) for s, p in enumerate((1.0, 2.0, 3.0))]
    rows += [_row("sal_paper", s, 1.1 * p) for s, p in enumerate((1.0, 2.0, 3.0))]
    r = ratio(rows, "sal", "sal_paper", "fcfs", "ttft_p50_s")
    assert (round(r.median, 6), round(r.low, 6), round(r.high, 6), r.n) == (1.1, 1.1, 1.1, 3)
    assert verdict(r) == "win"


def test_the_headline_is_the_median_of_the_paired_ratios_not_a_ratio_of_medians() -> None:
    # Per seed 1.25, 1.62, 1.27 (median 1.27); the medians' ratio would say 0.9 / 0.55 = 1.62.
    rows = [_row("sal", s, p) for s, p in enumerate((0.246, 0.554, 1.486))]
    rows += [_row("sal_paper", s, p) for s, p in enumerate((0.307, 0.898, 1.889))]
    rows += [_row("llm_d", s, 5.0) for s in range(3)]
    verdicts = {a: (m, v) for _, a, m, v in aims(_doc(rows, "reuse survives"))}
    assert verdicts["p50 TTFT >= 1.5x lower than sal_paper"] == (
        "1.27x [1.25-1.62], better on 3 of 3 (win)",
        "not met",
    )


def test_aims_report_met_and_not_met_with_the_best_baseline_named(tmp_path: Path) -> None:
    rows = []
    for seed in range(3):
        rows += [
            _row("sal", seed, 1.0 + 0.01 * seed),
            _row("sal_paper", seed, 2.0 + 0.01 * seed),
            _row("llm_d", seed, 1.1 + 0.01 * seed),
            _row("cache_aware", seed, 3.0),
            _row("prefix_affinity", seed, 5.0, preemptions_per_100=0.0),
        ]
    verdicts = {
        aim: (measured, verdict) for _, aim, measured, verdict in aims(_doc(rows, "reuse survives"))
    }
    assert verdicts["p50 TTFT >= 1.5x lower than sal_paper"] == (
        "1.99x [1.98-2.00], better on 3 of 3 (win)",
        "met (every seed)",
    )
    assert verdicts["p50 TTFT >= 1.2x lower than the best baseline (llm_d)"] == (
        "1.10x [1.10-1.10], better on 3 of 3 (win)",
        "not met",
    )
    write_report(_doc(rows, "reuse survives"), tmp_path / "prefix.md")
    text = (tmp_path / "prefix.md").read_text()
    assert "| fcfs | sal | 1.01 (1.00-1.02) |" in text
    assert "3 seeds / trace windows per cell." in text
    assert "not met" in text


def test_a_loss_on_every_seed_is_not_hidden_by_a_wide_spread() -> None:
    # Windows differ a lot (wide, overlapping spreads), but SAL is slower in each one.
    rows = []
    for seed, p50 in enumerate((1.0, 2.0, 3.0)):
        rows += [
            _row("sal", seed, p50 * 1.1),
            _row("sal_paper", seed, p50),
            _row("llm_d", seed, p50 * 2),
        ]
    verdicts = {aim: v for _, aim, _, v in aims(_doc(rows, "reuse does not survive"))}
    assert verdicts["no p50 regression vs sal_paper"] == "not met (worse on every seed)"


def test_a_worse_tail_than_a_baseline_other_than_the_best_by_p50_is_its_own_aim() -> None:
    # The best baseline by p50 (llm_d) has a long tail; cache_aware's tail is SAL's better.
    rows = []
    for seed in range(3):
        rows += [
            _row("sal", seed, 1.0, ttft_p99_s=10.0 + seed),
            _row("sal_paper", seed, 2.0),
            _row("llm_d", seed, 1.1, ttft_p99_s=20.0),
            _row("cache_aware", seed, 1.5, ttft_p99_s=6.0 + seed),
        ]
    verdicts = {aim: (m, v) for _, aim, m, v in aims(_doc(rows, "reuse survives"))}
    assert verdicts["p99 no worse than the best baseline (llm_d)"] == (
        "1.82x [1.67-2.00], better on 3 of 3 (win)",
        "met",
    )
    assert verdicts["p99 no worse than any prefix-aware baseline (worst: cache_aware)"] == (
        "0.64x [0.60-0.67], better on 0 of 3 (loss)",
        "not met (worse on every seed)",
    )


def test_the_bound_says_how_much_any_router_could_gain_over_the_best_baseline(
    tmp_path: Path,
) -> None:
    rows = []
    for seed in range(3):
        rows += [
            _row("sal", seed, 1.0),
            _row("sal_paper", seed, 3.0),
            _row("llm_d", seed, 1.2 + 0.1 * seed, hit_rate=0.45),
        ]
    doc = _doc(rows, "reuse survives")
    doc["results"]["bound"] = [
        {"scenario": "s", "seed": seed, "requests": 10, "bound_p50_s": 0.8,
         "bound_p95_s": 1.0, "bound_p99_s": 1.1, "max_hit_rate": 0.74}
        for seed in range(3)
    ]  # fmt: skip
    verdicts = {aim: measured for _, aim, measured, _ in aims(doc)}
    # llm_d's p50 over the bound's, per seed: 1.5, 1.625, 1.75.
    assert verdicts["p50 TTFT >= 1.2x lower than the best baseline (llm_d)"].endswith(
        "; no router could exceed 1.62x (1.50-1.75x, the TTFT bound)"
    )
    write_report(doc, tmp_path / "prefix.md")
    text = (tmp_path / "prefix.md").read_text()
    assert (
        "| s | 74% / 50% / 45% | 0.80 | 1.25x (1.25-1.25x) | 1.62x (1.50-1.75x) (llm_d) |" in text
    )


def test_the_paper_memory_what_if_is_reported_beside_sal_per_scenario(tmp_path: Path) -> None:
    # SAL twice as fast as the what-if with the paper's memory term on both seeds.
    pairs = (("sal", 1.0), ("sal_paper_memory", 2.0))
    rows = [_row(r, s, p * (1 + s)) for s in range(2) for r, p in pairs]
    grid = [_row(r, 0, 1.0) for r in ("sal", "sal_paper", "llm_d")]
    doc = _doc(grid, "reuse does not survive")
    doc["results"]["paper-memory"] = rows
    found = [a for a in aims(doc) if a[1].startswith("memory term in steps")]
    assert [(a[0], a[2]) for a in found] == [
        (
            "s / fcfs",
            "p50 2.00x [2.00-2.00], better on 2 of 2 (win); "
            "p95 2.00x [2.00-2.00], better on 2 of 2 (win); "
            "p99 2.00x [2.00-2.00], better on 2 of 2 (win)",
        )
    ]
    write_report(doc, tmp_path / "prefix.md")
    text = (tmp_path / "prefix.md").read_text()
    assert "## What-if: the paper's memory term" in text
    assert "| fcfs | sal_paper_memory | 3.00 (2.00-4.00) |" in text


def test_the_decode_reserve_what_ifs_are_reported_beside_sal_per_scenario(tmp_path: Path) -> None:
    # Reserving halves the preemptions (4 -> 2 -> 1) at 1.25x / 1.5x the p50 TTFT.
    cases = (("sal", 1.0, 4.0), ("sal_reserve_0.5", 1.25, 2.0), ("sal_reserve_1", 1.5, 1.0))
    rows = [_row(r, s, p50, preemptions_per_100=pre) for s in range(2) for r, p50, pre in cases]
    doc = _doc([_row(r, 0, 1.0) for r in ("sal", "sal_paper", "llm_d")], "reuse survives")
    doc["results"]["decode-reserve"] = rows
    found = [a for a in aims(doc) if a[1].startswith("routing.decode_reserve")]
    assert [(a[0], a[2], a[3]) for a in found] == [
        (
            "s / fcfs",
            "preemptions/100 4.00; 0.5: 2.00, p50 0.80x, p99 0.80x; 1: 1.00, p50 0.67x, p99 0.67x",
            "reported",
        )
    ]
    write_report(doc, tmp_path / "prefix.md")
    text = (tmp_path / "prefix.md").read_text()
    assert "## routing.decode_reserve 0.5 and 1.0 beside 0" in text
    assert "| fcfs | sal_reserve_1 | 1.50 |" in text


def test_the_kv_capacity_what_if_gets_its_own_aims_and_section(tmp_path: Path) -> None:
    # At x1 SAL only ties the paper's SAL; at x2 it halves its p50 on every window.
    rows = []
    for seed in range(3):
        for scale, paper in ((1.0, 1.0), (2.0, 2.0)):
            rows += [
                _row("sal", seed, 1.0, kv_scale=scale, hit_rate=0.1 * scale),
                _row("sal_paper", seed, paper, kv_scale=scale),
                _row("prefix_affinity", seed, 5.0, kv_scale=scale, hit_rate=0.1 * scale),
                _row("llm_d", seed, 1.5, kv_scale=scale),
            ]
    doc = _doc([], "reuse survives")
    doc["scenarios"][0].update(name="s", workload="synthetic", profile="llama31-8b-a100-80gb")
    doc["results"] = {"kv-capacity": rows, "bound": [{"scenario": "s", "max_hit_rate": 0.3}]}
    verdicts = {(tag, aim): v for tag, aim, _, v in aims(doc)}
    assert verdicts[("s, KV x2 (what-if) / fcfs", "p50 TTFT >= 1.5x lower than sal_paper")] == (
        "met (every seed)"
    )
    assert not any(tag.startswith("s, KV x1 ") for tag, _ in verdicts)  # the main grid's
    write_report(doc, tmp_path / "prefix.md")
    text = (tmp_path / "prefix.md").read_text()
    assert "## Which regime: s with more KV per replica (what-if)" in text
    # x2 doubles the profile's 450,896 tokens per replica; hit rates 20 % for sal and affinity.
    assert "| x2 (901,792) | 30% / 20% / 20% / 50% (llm_d) | 1.00 / 2.00 / 1.50 |" in text
    assert "2.00x [2.00-2.00], better on 3 of 3 (win)" in text


def test_the_fleet_reuse_estimate_is_set_beside_the_best_measured_hit_rate(tmp_path: Path) -> None:
    # Per window: the estimate, the grid's best cache-aware router (llm_d here, not sal) and
    # the KV what-if's rows at x2; the difference is in points, estimate minus best.
    grid = []
    kv = []
    estimates = []
    for seed, (est1, est2) in enumerate(((0.30, 0.50), (0.34, 0.56), (0.32, 0.52))):
        grid += [
            _row("sal", seed, 1.0, hit_rate=0.28),
            _row("llm_d", seed, 1.0, hit_rate=0.31),
            _row("sal_paper", seed, 2.0, hit_rate=0.05),
        ]
        for scale, hit in ((1.0, 0.31), (2.0, 0.50)):
            kv += [
                _row("sal", seed, 1.0, kv_scale=scale, hit_rate=hit),
                _row("llm_d", seed, 1.5, kv_scale=scale, hit_rate=hit - 0.01),
                _row("sal_paper", seed, 2.0, kv_scale=scale, hit_rate=0.1),
            ]
        estimates.append(
            {"scenario": "s", "seed": seed, "reuse_x1": est1, "reuse_x2": est2, "reuse_x4": 0.7}
        )
    doc = _doc(grid, "reuse survives")
    doc["scenarios"][0].update(profile="llama31-8b-a100-80gb")
    doc["results"].update({"kv-capacity": kv, "reuse-profile": estimates})
    write_report(doc, tmp_path / "prefix.md")
    text = (tmp_path / "prefix.md").read_text()
    assert "## Telling the regime from the gateway: the fleet-reuse estimate" in text
    assert "| s | x1 | 32.0% | 31.0% | +1.0 (-1.0 to +3.0) | 28.0% | 5.0% |" in text
    assert "| s | x2 | 52.0% | 50.0% | +2.0 (+0.0 to +6.0) | 50.0% | 10.0% |" in text


def test_the_workers_section_pairs_told_workers_against_alone_and_one_gateway(
    tmp_path: Path,
) -> None:
    # Per window: one gateway 1.0 s, 4 workers alone 3x worse, told 1.1x one gateway's; 8
    # gateways on separate hosts 2x worse, told as good as one gateway.
    rows = []
    setups = (
        ("1 gateway", 1.0), ("4 workers", 3.0), ("4 workers, told", 1.1),
        ("8 hosts", 2.0), ("8 hosts, told", 1.0),
    )  # fmt: skip
    for seed, scale in enumerate((1.0, 1.2, 0.9)):
        for setup, p50 in setups:
            rows.append(
                _row("sal", seed, p50 * scale, source="approximate", setup=setup, hit_rate=0.7)
            )
        rows.append(_row("sal", seed, 1.0, source="oracle", setup="8 workers"))
    doc = _doc([], "reuse survives")
    doc["results"]["workers"] = rows
    write_report(doc, tmp_path / "prefix.md")
    text = (tmp_path / "prefix.md").read_text()
    assert "## Several workers or gateways: is the prefix index shared?" in text
    assert "| sal | approximate | 4 workers | 3.00 (2.70-3.60) |" in text
    assert "| sal | oracle | 8 workers | 1.00 |" in text
    # alone / told: 3.0 / 1.1 on every window, a win for telling; told / one gateway 1.1x.
    assert (
        "| sal | 4 workers | 2.73x [2.73-2.73], better on 3 of 3 (win) "
        "| 2.73x [2.73-2.73], better on 3 of 3 (win) "
        "| 1.10x [1.10-1.10], better on 3 of 3 (win) |"
    ) in text
    assert "| sal | 8 hosts | 2.00x [2.00-2.00], better on 3 of 3 (win) " in text
    assert "| sal | approximate | 8 hosts, told | 1.00 (0.90-1.20) |" in text
    assert "| sal | 8 workers |" not in text  # not measured: no row
    assert "5 % lost / lossless" not in text  # not measured: no table


def test_the_workers_section_pairs_a_lossy_network_against_the_lossless_one(
    tmp_path: Path,
) -> None:
    rows = []
    for seed, (lost, wait) in enumerate(((10, 0.5), (30, 0.25), (20, None))):
        for setup, p50 in (("8 hosts, told", 1.0), ("8 hosts, told, 5 % lost", 1.05)):
            row = _row("sal", seed, p50, source="approximate", setup=setup, hit_rate=0.7)
            if "lost" in setup:
                row.update(
                    peer_resent_ends=4 * lost, peer_lost_ends=lost, peer_watermark_wait_s=wait
                )
            rows.append(row)
    doc = _doc([], "reuse survives")
    doc["results"]["workers"] = rows
    write_report(doc, tmp_path / "prefix.md")
    text = (tmp_path / "prefix.md").read_text()
    # 5 % lost is 1.05x slower on every window; 20 (10-30) ends lost; a window whose lost
    # ends none was released (None) does not count in the extra hold.
    assert (
        "| sal | 1.05x [1.05-1.05], better on 3 of 3 (win) "
        "| 1.05x [1.05-1.05], better on 3 of 3 (win) | 80 (40-120) | 20 (10-30) "
        "| 0.38 (0.25-0.50) |"
    ) in text
