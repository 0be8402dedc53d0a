"""Running a benchmark's independent cells, in this process or in worker processes.

A *cell* is one picklable task (a workload window, a fleet) that returns its rows. The
sweeps (`capacity`, `gateways`, `sensitivity`) differ in their cells, not in how the cells
run: `run_cells` is that shared part.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

Task = TypeVar("Task")
Row = dict[str, Any]


def log(message: str) -> None:
    """One progress line on stderr, flushed (stdout carries the tables)."""
    print(message, file=sys.stderr, flush=True)


def run_cells(
    cell: Callable[[Task], list[Row]],
    tasks: Sequence[Task],
    jobs: int,
    on_rows: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Every task's rows, in the order of `tasks`.

    With `jobs` > 1 the cells run in that many spawned processes (`cell` must then be a
    module-level function and the tasks picklable). `on_rows`, if given, is called with
    each cell's rows as soon as that cell is done (in completion order when `jobs` > 1), so
    that a caller can save the partial results of a run that may be cut short.
    """
    done: dict[int, list[Row]] = {}

    def keep(n: int, cell_rows: list[Row]) -> None:
        done[n] = cell_rows
        if on_rows is not None:
            on_rows(cell_rows)

    if jobs <= 1:
        for n, task in enumerate(tasks):
            keep(n, cell(task))
    else:
        from multiprocessing import get_context

        numbered = [(n, cell, task) for n, task in enumerate(tasks)]
        with get_context("spawn").Pool(jobs) as pool:
            for n, cell_rows in pool.imap_unordered(_numbered, numbered, chunksize=1):
                keep(n, cell_rows)
    return [row for n in sorted(done) for row in done[n]]


def _numbered(item: tuple[int, Callable[[Any], list[Row]], Any]) -> tuple[int, list[Row]]:
    n, cell, task = item
    return n, cell(task)


def refused(command: str, data_dir: Path, jobs: int) -> int | None:
    """2, with the reason on stderr, when an Azure trace the trace-window sweeps replay is
    missing from `data_dir` or `jobs` is below 1; None when `command` can run."""
    from engine_sim.data import AZURE_CHAT, AZURE_CODE, missing_message

    for name in (AZURE_CHAT, AZURE_CODE):
        if not (data_dir / name).is_file():
            missing = missing_message(data_dir / name, "--data-dir")
            print(f"sal-bench {command}: error: {missing}", file=sys.stderr)
            return 2
    if jobs < 1:
        print(f"sal-bench {command}: error: --jobs must be >= 1", file=sys.stderr)
        return 2
    return None


def window_tasks(
    workloads: Sequence[str], windows: int, plan: Any, folder: Path
) -> list[tuple[str, int, Any, Path]]:
    """One cell per (workload, trace window): ``(workload, window index, plan, folder)``."""
    return [(w, i, plan, folder) for w in workloads for i in range(windows)]
