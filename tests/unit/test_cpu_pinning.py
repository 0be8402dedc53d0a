"""`bench.cpu_pinning`: a replica's engine processes on their own CPU, the rest elsewhere."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cpu_pinning import children, descendants, pin_replica, split_cpus


def test_the_last_cpu_goes_to_the_engines_the_others_to_the_front() -> None:
    assert split_cpus([1, 0]) == (frozenset({0}), frozenset({1}))
    assert split_cpus({0, 2, 5, 7}) == (frozenset({0, 2, 5}), frozenset({7}))
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        split_cpus([3])


def _fake_proc(tmp_path: Path, parents: dict[int, int], comm: str = "x") -> Path:
    for pid, ppid in parents.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")
    (tmp_path / "self").mkdir()  # not a PID
    return tmp_path


def test_the_process_tree_is_read_from_proc_even_with_odd_command_names(tmp_path: Path) -> None:
    # 10 -> 11 -> 13, 10 -> 12; 20 is someone else's. A command name may hold ") (".
    proc = _fake_proc(tmp_path, {10: 1, 11: 10, 12: 10, 13: 11, 20: 1}, comm="VLLM::a) (b")
    assert sorted(children(10, proc)) == [11, 12]
    assert sorted(descendants(10, proc)) == [11, 12, 13]
    assert descendants(20, proc) == []


def test_a_real_process_tree_is_split_between_front_and_engine_cpus() -> None:
    available = os.sched_getaffinity(0)
    front, engine = split_cpus(available)  # CI and this machine have 2 CPUs
    # A parent (the API server) that starts a child (the engine) with a thread of its own.
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
        "time.sleep(30)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{child}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pin_replica(parent.pid, front, engine) == [child]
        assert os.sched_getaffinity(parent.pid) == front
        for tid in os.listdir(f"/proc/{child}/task"):
            assert os.sched_getaffinity(int(tid)) == engine
    finally:
        os.sched_setaffinity(0, available)
        if child:
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
