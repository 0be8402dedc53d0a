"""Several gateways in front of the same simulated replicas (`gateways` > 1): independent,
the workers of one host sharing their accounting (`shared_accounting`), or gateways on
separate hosts telling each other their accounting over the network (`gossip_interval_s`,
a what-if)."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.gateways import unseen_share
from engine_sim.simulator import RouterConfig, SimResult, SimulationError, simulate
from engine_sim.trace import TraceRequest, gamma_arrivals


def _workload(n: int, rate_per_s: float, seed: int = 5) -> list[TraceRequest]:
    times = gamma_arrivals(n, rate_per_s, cv=3.0, seed=seed)
    return [
        TraceRequest(t, 200 + (i * 7919) % 3000, 10 + (i * 104729) % 200)
        for i, t in enumerate(times)
    ]


def test_one_gateway_decides_as_before_and_logs_every_decision() -> None:
    reqs = _workload(150, rate_per_s=6.0)
    default = simulate(reqs, replicas=3, router=RouterConfig("p2c", seed=4))
    explicit = simulate(reqs, replicas=3, router=RouterConfig("p2c", seed=4, gateways=1))
    assert default.outcomes == explicit.outcomes
    assert len(default.decisions) == 150
    assert {d.gateway for d in default.decisions} == {0}
    by_time = sorted(default.outcomes, key=lambda o: o.arrival_s)
    assert [d.replica for d in default.decisions] == [o.replica for o in by_time]


@pytest.mark.parametrize("split", ["round_robin", "random"])
def test_every_gateway_gets_its_share_and_every_request_finishes(split: str) -> None:
    reqs = _workload(400, rate_per_s=10.0)
    router = RouterConfig("sal", gateways=4, gateway_split=split, seed=2)
    result = simulate(reqs, replicas=4, router=router)
    assert result.unfinished == 0
    shares = Counter(d.gateway for d in result.decisions)
    assert set(shares) == {0, 1, 2, 3}
    if split == "round_robin":
        assert max(shares.values()) - min(shares.values()) <= 1
    else:
        assert min(shares.values()) > 60  # 100 expected each


def test_each_gateway_polls_on_its_own_phase() -> None:
    reqs = _workload(300, rate_per_s=10.0)
    result = simulate(reqs, replicas=2, router=RouterConfig("sal", gateways=4))
    for d in result.decisions:
        if d.snapshot_s > reqs[0].arrival_s:  # the initial picture predates every poll
            phase = (d.snapshot_s / 0.1) % 1.0
            assert phase == pytest.approx(d.gateway / 4, abs=1e-6) or (
                d.gateway == 0 and phase == pytest.approx(1.0, abs=1e-6)
            )
            assert d.snapshot_s <= d.time_s


def test_gateways_only_count_their_own_requests_in_flight() -> None:
    # Two requests at once, one per gateway: each gateway sees both replicas empty, so
    # least_requests sends both to replica 0; one gateway would have used both replicas.
    reqs = [TraceRequest(0.0, 100, 50), TraceRequest(0.0, 100, 50)]
    one = simulate(reqs, replicas=2, router=RouterConfig("least_requests"))
    two = simulate(reqs, replicas=2, router=RouterConfig("least_requests", gateways=2))
    assert sorted(d.replica for d in one.decisions) == [0, 1]
    assert [d.replica for d in two.decisions] == [0, 0]


def test_sal_gateways_on_the_same_snapshot_herd_onto_the_same_replica() -> None:
    # Four requests within one poll period, one per gateway, every replica idle at the last
    # poll: each gateway knows only its own routing, so all four pick the same replica,
    # where one gateway's between-poll accounting spreads them.
    reqs = [TraceRequest(0.2 + 0.01 * i, 500, 5) for i in range(4)]
    herd = simulate(reqs, replicas=3, router=RouterConfig("sal", gateways=4, poll_interval_s=1.0))
    assert [d.replica for d in herd.decisions] == [0, 0, 0, 0]
    one = simulate(reqs, replicas=3, router=RouterConfig("sal", poll_interval_s=1.0))
    assert len({d.replica for d in one.decisions}) == 3


def test_workers_sharing_their_accounting_spread_like_one_gateway() -> None:
    # The same four requests: sharing (one host's workers), every gateway sees what the
    # others routed since the snapshot, so they spread as one gateway does.
    reqs = [TraceRequest(0.2 + 0.01 * i, 500, 5) for i in range(4)]
    router = RouterConfig("sal", gateways=4, poll_interval_s=1.0, shared_accounting=True)
    shared = simulate(reqs, replicas=3, router=router)
    one = simulate(reqs, replicas=3, router=RouterConfig("sal", poll_interval_s=1.0))
    assert [d.replica for d in shared.decisions] == [d.replica for d in one.decisions]
    assert len({d.replica for d in shared.decisions}) == 3
    # With one gateway there is nobody to share with: the same decisions.
    alone = simulate(reqs, replicas=3, router=RouterConfig("sal", shared_accounting=True))
    assert alone.decisions == simulate(reqs, replicas=3, router=RouterConfig("sal")).decisions


def test_eight_sharing_workers_herd_less_than_eight_gateways() -> None:
    reqs = _workload(600, rate_per_s=40.0)

    def unseen(shared: bool) -> float:
        router = RouterConfig("sal", gateways=8, seed=1, shared_accounting=shared)
        return unseen_share(simulate(reqs, replicas=8, router=router).decisions)

    assert unseen(True) < 0.6 * unseen(False)


def test_gossip_at_every_arrival_without_delay_decides_as_sharing_does() -> None:
    reqs = _workload(400, rate_per_s=30.0)
    shared = RouterConfig("sal", gateways=4, seed=3, shared_accounting=True)
    told = RouterConfig("sal", gateways=4, seed=3, gossip_interval_s=0.0, gossip_delay_s=0.0)
    assert (
        simulate(reqs, replicas=4, router=told).decisions
        == simulate(reqs, replicas=4, router=shared).decisions
    )


def test_gossip_arrives_after_its_delay() -> None:
    # The four requests of the herding test, 10 ms apart. Counts that take 5 ms to arrive
    # reach the next gateway in time, and it spreads as one gateway does; counts that take
    # 20 ms arrive after the next request was routed, and the first two land together.
    reqs = [TraceRequest(0.2 + 0.01 * i, 500, 5) for i in range(4)]

    def replicas(delay_s: float) -> list[int]:
        router = RouterConfig(
            "sal", gateways=4, poll_interval_s=1.0, gossip_interval_s=0.0, gossip_delay_s=delay_s
        )
        return [d.replica for d in simulate(reqs, replicas=3, router=router).decisions]

    one = simulate(reqs, replicas=3, router=RouterConfig("sal", poll_interval_s=1.0))
    assert replicas(0.005) == [d.replica for d in one.decisions]
    late = replicas(0.02)
    assert late[0] == late[1]


def test_gossip_sent_less_often_than_requests_come_is_not_heard_in_time() -> None:
    # The same four requests; each gateway sends its counts once a second (gateway g at
    # g / 4 s past the second), so the counts that would spread them are sent too late.
    reqs = [TraceRequest(0.2 + 0.01 * i, 500, 5) for i in range(4)]
    router = RouterConfig(
        "sal", gateways=4, poll_interval_s=1.0, gossip_interval_s=1.0, gossip_delay_s=0.0
    )
    assert [d.replica for d in simulate(reqs, replicas=3, router=router).decisions] == [0] * 4


def test_gossip_settings_are_checked() -> None:
    with pytest.raises(SimulationError, match="gossip"):
        RouterConfig(gateways=2, gossip_interval_s=-1.0)
    with pytest.raises(SimulationError, match="exclude"):
        RouterConfig(gateways=2, gossip_interval_s=0.01, shared_accounting=True)


def test_several_gateways_are_deterministic_for_a_seed() -> None:
    reqs = _workload(200, rate_per_s=8.0)
    router = RouterConfig("p2c", gateways=3, gateway_split="random", seed=9)
    a = simulate(reqs, replicas=4, router=router)
    b = simulate(reqs, replicas=4, router=router)
    assert a.outcomes == b.outcomes
    assert a.decisions == b.decisions


def test_bad_gateway_settings_are_refused() -> None:
    with pytest.raises(SimulationError, match="gateways"):
        RouterConfig(gateways=0)
    with pytest.raises(SimulationError, match="gateway_split"):
        RouterConfig(gateways=2, gateway_split="hash")


def _chat() -> list[TraceRequest]:
    from engine_sim.workloads import ChatSpec, multi_turn_chat

    lengths = [(300 + 97 * i % 900, 50 + 31 * i % 300) for i in range(200)]
    spec = ChatSpec(conversations=40, rate_per_s=2.0, think_time_s=(2.0, 10.0))
    return multi_turn_chat(spec, lengths, seed=3)


def _hit_rate(reqs: list[TraceRequest], **kw: object) -> float:
    """SAL's prefix-cache hit rate on 4 replicas with the approximate index and `kw`."""
    router = RouterConfig("sal", seed=1, cache_source="approximate", **kw)  # type: ignore[arg-type]
    result = simulate(reqs, replicas=4, router=router, enable_prefix_caching=True)
    assert result.unfinished == 0
    return result.summary.hit_rate


def test_a_session_split_keeps_each_conversation_on_one_gateway() -> None:
    reqs = _chat()
    router = RouterConfig("sal", gateways=4, gateway_split="session", seed=1)
    result = simulate(reqs, replicas=2, router=router, enable_prefix_caching=True)
    by_time = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    gateways: dict[str | None, set[int]] = {}
    for i, d in zip(by_time, result.decisions, strict=True):
        gateways.setdefault(reqs[i].session, set()).add(d.gateway)
    assert len(gateways) == 40
    assert all(len(g) == 1 for g in gateways.values())
    assert len(set().union(*gateways.values())) == 4


def test_workers_told_each_others_blocks_keep_the_reuse_one_gateway_keeps() -> None:
    """Conversations whose turns reach 4 workers at random: each worker's own index misses
    the turns it did not route, and the fleet prefills them again; told of each other's
    blocks (``listen.share_prefix_index``) they find them as one gateway does."""
    reqs = _chat()

    def hit_rate(**kw: object) -> float:
        return _hit_rate(reqs, **kw)

    workers = {"gateways": 4, "gateway_split": "random", "shared_accounting": True}
    one = hit_rate()
    alone = hit_rate(**workers)
    told = hit_rate(**workers, share_prefix_index=True)
    assert alone < one - 0.15
    assert told > one - 0.05


def test_gateways_on_other_hosts_told_each_others_blocks_keep_the_reuse_one_keeps() -> None:
    """The same with 4 gateways on separate hosts (``peers``: counts 1 ms after each change)
    that also tell each other their routed blocks (``peers.share_prefix_blocks``), arriving
    1 ms later and indexed unheld: they find the conversations' prefixes as one gateway does;
    without the blocks they lose them."""
    reqs = _chat()

    def hit_rate(**kw: object) -> float:
        return _hit_rate(reqs, **kw)

    hosts = {"gateways": 4, "gateway_split": "random", "gossip_interval_s": 0.0}
    one = hit_rate()
    alone = hit_rate(**hosts)
    told = hit_rate(**hosts, peer_prefix_blocks=True)
    assert alone < one - 0.15
    assert told > one - 0.05


def test_lost_datagrams_cost_some_reuse_and_every_lost_end_is_released() -> None:
    """``peers`` over a lossy network (20 % of datagrams lost, far worse than a data centre):
    a gateway that missed a prompt's run knows less of it; one that missed an end hears the
    copy the next heartbeat sends, or, both lost, holds the blocks until the sender's
    watermark (oldest request not ended) passes it; every end lost twice is released by the
    time the run's requests have ended, and most of the reuse survives."""
    from engine_sim.simulator import PEER_KEYS_PER_DATAGRAM, PEER_MAX_DATAGRAMS
    from sal_gateway.peer_wire import BLOCK_KEYS_PER_DATAGRAM
    from sal_gateway.peers import MAX_BLOCK_DATAGRAMS

    assert (PEER_KEYS_PER_DATAGRAM, PEER_MAX_DATAGRAMS) == (
        BLOCK_KEYS_PER_DATAGRAM,
        MAX_BLOCK_DATAGRAMS,
    )
    reqs = _chat()
    hosts = {"gateways": 4, "gateway_split": "random", "gossip_interval_s": 0.0}

    def run(loss: float) -> SimResult:
        router = RouterConfig(
            "sal",
            seed=1,
            cache_source="approximate",
            peer_prefix_blocks=True,
            peer_datagram_loss=loss,
            **hosts,  # type: ignore[arg-type]
        )
        return simulate(reqs, replicas=4, router=router, enable_prefix_caching=True)

    clean, lossy = run(0.0), run(0.2)
    alone = _hit_rate(reqs, **hosts)
    assert clean.peer_lost_ends == 0
    assert lossy.unfinished == 0
    assert lossy.peer_resent_ends > 50  # the heartbeat's copies repair most lost ends
    assert 0 < lossy.peer_lost_ends < lossy.peer_resent_ends
    assert lossy.peer_lost_ends_released == lossy.peer_lost_ends
    assert lossy.peer_watermark_wait_s is not None
    assert lossy.peer_watermark_wait_s > 0
    assert alone < lossy.summary.hit_rate <= clean.summary.hit_rate + 0.02
    assert lossy.summary.hit_rate > clean.summary.hit_rate - 0.1
    with pytest.raises(SimulationError, match="peer_datagram_loss"):
        RouterConfig(peer_datagram_loss=1.0)
