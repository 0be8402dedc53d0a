"""`bench.lora_real`: its workload and its report (the real replicas run in the benchmark)."""

from __future__ import annotations

from collections import Counter

from bench.lora_real import RunResult, _decisions, build_parser, report, workload


def test_the_workload_is_seeded_poisson_with_uniform_adapters() -> None:
    reqs = workload(3, 400, 2.0, 4)
    assert reqs == workload(3, 400, 2.0, 4)
    assert reqs != workload(4, 400, 2.0, 4)
    times = [r.at_s for r in reqs]
    assert times == sorted(times)
    assert 150 < times[-1] < 250  # 400 arrivals at 2 per second
    counts = Counter(r.adapter for r in reqs)
    assert set(counts) == {"lora-0", "lora-1", "lora-2", "lora-3"}
    assert min(counts.values()) > 60
    assert all(20 <= len(r.prompt.split()) <= 60 for r in reqs)


def test_slot_decisions_are_read_from_the_gateway_metrics() -> None:
    text = (
        'sal_lora_slot_decisions_total{model="tiny",outcome="steered"} 3.0\n'
        'sal_lora_slot_decisions_total{model="other",outcome="steered"} 2.0\n'
        'sal_lora_slot_decisions_total{model="tiny",outcome="affinity"} 1.0\n'
    )
    assert _decisions(text) == {"affinity": 1.0, "steered": 5.0, "no_free_slot": 0.0}


def _run(config: str, seed: int, p99: float) -> RunResult:
    return RunResult(config, seed, 80, ttft_p50_s=0.1, ttft_p95_s=1.0, ttft_p99_s=p99,
                     total_p50_s=0.5)  # fmt: skip


def test_the_report_pairs_each_configuration_with_sal_by_seed() -> None:
    # SAL's p99 is 2 s on every seed; blind SAL's 1 s (a loss), round robin's 3-5 s (a win).
    runs = [_run("sal", s, 2.0) for s in range(3)]
    runs += [_run("sal+blind", s, 1.0) for s in range(3)]
    runs += [_run("round_robin+blind", s, 3.0 + s) for s in range(3)]
    text = report(runs, build_parser().parse_args([]))
    paired, _, every = text.partition("## SAL with the slot rule")[2].partition("## Every run")
    rows = {line.split("|")[1].strip(): line for line in paired.splitlines() if "|" in line}
    assert "0.5x loss" in rows["sal+blind"]  # p99: 1 s / 2 s on every seed
    assert "2x [1.5–2.5] win" in rows["round_robin+blind"]
    assert "1x tie" in rows["sal+blind"]  # p50: the same on every seed
    listed = [line.split("|")[1].strip() for line in every.splitlines() if "|" in line]
    configs = Counter(x for x in listed if not x.startswith(("-", "configuration")))
    assert configs == {"sal": 3, "sal+blind": 3, "round_robin+blind": 3}
