"""Keep a vLLM replica's engine on CPUs of its own, apart from its API server and the client.

On a small machine the engine, the API server that streams its tokens and the benchmark
client that reads them all compete for the same cores, and how much CPU the engine gets in a
given second decides whether a replay keeps up or falls behind (docs/engine_patch.md,
"Measured 2026-12-07"). Pinning gives the engine a fixed share: `split_cpus` picks the CPUs,
`pin_replica` puts a replica's main process (vLLM's API server) on the front CPUs and every
process it started (EngineCore, workers) on the engine CPUs, `pin_self` puts the calling
process on the front CPUs. Every thread of each process is pinned; threads started later
inherit their creator's CPUs. Linux only (``/proc`` and ``sched_setaffinity``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def split_cpus(available: Iterable[int]) -> tuple[frozenset[int], frozenset[int]]:
    """(front, engine): the highest-numbered available CPU for the engines, the others for
    the API servers and the client. Needs at least 2 CPUs (ValueError otherwise)."""
    cpus = sorted(set(available))
    if len(cpus) < 2:
        raise ValueError(f"pinning needs at least 2 CPUs, this process may use {cpus}")
    return frozenset(cpus[:-1]), frozenset(cpus[-1:])


def children(pid: int, proc: Path = PROC) -> list[int]:
    """Direct children of `pid`, from each process's ``stat`` (processes that exit while
    being read are left out)."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """Every process below `pid` (children, their children, ...), parents first."""
    out: list[int] = []
    frontier = [pid]
    while frontier:
        kids = [c for p in frontier for c in children(p, proc)]
        out += kids
        frontier = kids
    return out


def pin_process(pid: int, cpus: frozenset[int], proc: Path = PROC) -> int:
    """Pin every thread of `pid` to `cpus`; return how many threads were pinned (0 if the
    process is gone)."""
    pinned = 0
    try:
        tids = [int(t.name) for t in (proc / str(pid) / "task").iterdir()]
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            continue
        pinned += 1
    return pinned


def pin_replica(pid: int, front: frozenset[int], engine: frozenset[int]) -> list[int]:
    """The replica's main process (`pid`, vLLM's API server) on `front`, every process it
    started on `engine`; return the engine-side PIDs."""
    pin_process(pid, front)
    below = descendants(pid)
    for child in below:
        pin_process(child, engine)
    return below


def pin_self(front: frozenset[int]) -> None:
    """This process (every thread) on `front`."""
    pin_process(os.getpid(), front)
