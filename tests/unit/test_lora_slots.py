"""LoRA slots: where an adapter's request can start now (`sal_core.lora_slots`), the state
table's view of each replica's slots between polls, and the stock ``/metrics`` source."""

from __future__ import annotations

import dataclasses

from engine_sim.fake_vllm import FakeBackend, default_stats
from sal_core.lora_slots import can_start, lora_route, prefer_free_slots, prefer_running_adapter
from sal_core.policies import BackendView
from sal_gateway.state import StateTable
from sal_gateway.vllm_metrics import parse_vllm_metrics

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def _view(url: str, eligible: bool = True, queued: int = 0, in_flight: int = 0) -> BackendView:
    return BackendView(url, eligible, in_flight, 1000, queued, 2048)


def test_an_adapter_starts_where_it_runs_or_a_slot_is_free() -> None:
    assert can_start("x", 1, {"x"})  # already in the batch
    assert can_start("x", 2, {"y"})  # a free slot
    assert not can_start("x", 1, {"y"})
    assert not can_start("x", 2, {"y", "z"})
    assert can_start("x", 0, {"y", "z"})  # slots unknown: nothing known to hold it back


def test_full_replicas_are_passed_over_only_while_another_can_start_it() -> None:
    views = [_view(A), _view(B), _view(C, eligible=False)]
    narrowed = prefer_free_slots(views, {A})
    assert [v.eligible for v in narrowed] == [False, True, False]
    assert [v.url for v in narrowed] == [A, B, C]  # same pool, same positions
    # Every eligible replica is full (C, which is free, is not eligible): the request still
    # goes somewhere, to wait for a slot there.
    assert prefer_free_slots(views, {A, B}) == views
    assert prefer_free_slots(views, set()) == views


def test_the_replica_running_the_adapter_is_preferred_while_its_queue_is_within_a_step() -> None:
    # A runs x; B and C have free slots. A's queue is one step (2,048 tokens) above B's.
    views = [_view(A, queued=2048), _view(B, queued=0), _view(C, queued=500)]
    assert [v.eligible for v in prefer_running_adapter(views, {A})] == [True, False, False]
    # A step and one token more: taking a free slot elsewhere is the lesser wait.
    views[0] = _view(A, queued=2049)
    assert prefer_running_adapter(views, {A}) == views
    # Of two holders, only the one within a step of the best other replica is kept.
    views = [_view(A, queued=9000), _view(B, queued=1000), _view(C, queued=0)]
    assert [v.eligible for v in prefer_running_adapter(views, {A, B})] == [False, True, False]
    # Every candidate holds it, or none does: nothing to prefer.
    assert prefer_running_adapter(views, {A, B, C}) == views
    assert prefer_running_adapter(views, set()) == views
    # An ineligible holder is never brought back.
    views = [_view(A, eligible=False), _view(B)]
    assert prefer_running_adapter(views, {A}) == views


def test_lora_route_says_what_decided_the_candidates() -> None:
    views = [_view(A), _view(B), _view(C)]
    # A's slots are held by other adapters; B runs the adapter; C has a free slot.
    narrowed, outcome = lora_route(views, blocked={A}, holders={B})
    assert ([v.eligible for v in narrowed], outcome) == ([False, True, False], "affinity")
    narrowed, outcome = lora_route(views, blocked={A}, holders=set())
    assert ([v.eligible for v in narrowed], outcome) == ([False, True, True], "steered")
    # B, the holder, is the only replica left after the slot filter: that is all "steered".
    narrowed, outcome = lora_route(views[:2], blocked={A}, holders={B})
    assert ([v.eligible for v in narrowed], outcome) == ([False, True], "steered")
    # Every slot held everywhere: the request waits for one wherever it goes, and a slot
    # frees sooner where fewer requests run: the fewest in flight (the policy picks among
    # equals); without that step, the policy weighs all of them.
    views = [_view(A, in_flight=5), _view(B, in_flight=2), _view(C, in_flight=2)]
    narrowed, outcome = lora_route(views, blocked={A, B, C}, holders=set())
    assert ([v.eligible for v in narrowed], outcome) == ([False, True, True], "no_free_slot")
    assert lora_route(views, {A, B, C}, set(), when_full=False) == (views, "no_free_slot")
    # Only when every one is full: with a free slot somewhere the counts do not matter.
    narrowed, outcome = lora_route(views, blocked={B, C}, holders=set())
    assert ([v.eligible for v in narrowed], outcome) == ([True, False, False], "steered")
    assert lora_route(views, blocked=set(), holders=set()) == (views, None)


def _table() -> StateTable:
    table = StateTable(stale_after_s=1.0, eject_after_failures=3, accounting_grace_s=0.05)
    table.add_backend("m", A)
    table.add_backend("m", B)
    return table


def _poll(table: StateTable, url: str, now_s: float, running: tuple[str, ...]) -> None:
    stats = dataclasses.replace(default_stats(), max_loras=1, lora_running=running)
    table.record_poll_success("m", url, stats, "stats", now_s=now_s)


def test_a_request_routed_to_a_free_slot_holds_it_until_the_engine_reports() -> None:
    table = _table()
    _poll(table, A, 0.0, ("x",))
    _poll(table, B, 0.0, ())
    assert table.lora_blocked("m", "y") == {A}
    assert table.lora_blocked("m", "x") == set()
    # y goes to B's free slot: until a snapshot includes it, B's slot is y's.
    ticket = table.route("m", B, 100, sent_s=0.1, adapter="y")
    assert table.lora_blocked("m", "z") == {A, B}
    assert table.lora_blocked("m", "y") == {A}
    # B's engine reports y running: the same; then y's request ends, and B's engine is idle.
    _poll(table, B, 0.5, ("y",))
    assert table.lora_blocked("m", "z") == {A, B}
    StateTable.release(ticket)
    _poll(table, B, 0.8, ())
    assert table.lora_blocked("m", "z") == {A}


def test_a_request_the_engine_has_seen_but_not_started_holds_no_slot() -> None:
    table = _table()
    _poll(table, A, 0.0, ("x",))
    table.route("m", A, 100, sent_s=0.1, adapter="y")  # sent where every slot is full
    _poll(table, A, 0.5, ("x",))  # waiting in A's engine: x still holds A's only slot
    assert table.lora_blocked("m", "y") == {A}
    assert table.lora_blocked("m", "x") == set()


def test_holders_are_the_replicas_running_the_adapter_or_just_sent_it() -> None:
    table = _table()
    _poll(table, A, 0.0, ("x",))
    _poll(table, B, 0.0, ())
    assert table.lora_holders("m", "x") == {A}
    assert table.lora_holders("m", "y") == set()
    table.route("m", B, 100, sent_s=0.1, adapter="y")
    assert table.lora_holders("m", "y") == {B}


def test_replicas_without_lora_slots_known_never_block() -> None:
    table = _table()
    table.record_poll_success("m", A, default_stats(), "stats", now_s=0.0)  # max_loras 0
    table.route("m", A, 100, sent_s=0.1, adapter="y")
    assert table.lora_blocked("m", "z") == set()


def test_stock_metrics_give_the_newest_lora_series() -> None:
    fake = FakeBackend(metrics_max_lora=2, metrics_running_loras=("x", "y"))
    stats = parse_vllm_metrics(fake.metrics_text(), "tiny", 0.0)
    # The fake also serves an older series naming "long-gone": vLLM keeps every label set.
    assert (stats.max_loras, stats.lora_running) == (2, ("x", "y"))
    idle = FakeBackend(metrics_max_lora=1)
    assert parse_vllm_metrics(idle.metrics_text(), "tiny", 0.0).lora_running == ()
    off = parse_vllm_metrics(FakeBackend().metrics_text(), "tiny", 0.0)
    assert (off.max_loras, off.lora_running) == (0, ())
