"""`bench.cells.run_cells`: the sweeps' rows come back in task order, whatever ran first."""

from __future__ import annotations

from typing import Any

import pytest

from bench.cells import run_cells


@pytest.mark.parametrize("jobs", [1, 2])
def test_rows_in_task_order_and_each_cell_reported_once(jobs: int) -> None:
    # `list` stands in for a cell: a picklable callable that returns a task's rows.
    tasks = [[{"cell": n, "row": k} for k in range(n % 3)] for n in range(7)]
    seen: list[list[dict[str, Any]]] = []
    rows = run_cells(list, tasks, jobs, seen.append)
    assert rows == [row for task in tasks for row in task]
    assert sorted(seen, key=lambda r: r[0]["cell"] if r else -1) == sorted(
        tasks, key=lambda r: r[0]["cell"] if r else -1
    )
    assert len(seen) == len(tasks)
