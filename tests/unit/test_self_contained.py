"""The repository is self-contained: it reads nothing beside the checkout, and its traces are
all present, unmodified, each with its licence (issue 11, item 1).

A user who clones the project must be able to run the tests and every ``sal-bench`` command
with nothing next to the clone.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

from engine_sim import data
from tests.conftest import DATA_DIR, REPO

# Assembled from pieces so that this file does not itself contain what it forbids.
_SHARED = "shared"
FORBIDDEN = (
    f"../{_SHARED}",
    f"/work/{_SHARED}",
    f"SAL_{_SHARED.upper()}_DATA",  # the old environment override of the traces' folder
    f'"{_SHARED}" / "data"',  # the old path arithmetic (repo parent, then that folder)
)
"""References to the folder beside the checkout where the traces used to be read from."""

_ROW = re.compile(
    r"^\| `(?P<file>[^`]+)` \| (?P<licence>[^|]+) \| [^|]+ \| `(?P<sha>[0-9a-f]{64})` \|$"
)
"""One row of the file table in data/README.md: file, licence file, source, sha256."""


def _repository_files() -> list[Path]:
    """Tracked files plus untracked ones git does not ignore (work not yet committed)."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    paths = [REPO / name for name in listing.decode().split("\0") if name]
    return [p for p in paths if p.is_file()]  # a tracked file deleted in the work tree


def test_no_file_of_the_repository_refers_to_the_folder_beside_the_checkout() -> None:
    files = _repository_files()
    assert len(files) > 100  # the listing worked (it lists the whole repository)
    offenders = []
    for path in files:
        content = path.read_bytes()
        for needle in FORBIDDEN:
            if needle.encode() in content:
                offenders.append(f"{path.relative_to(REPO)}: {needle}")
    assert offenders == []


def _listed() -> list[dict[str, str]]:
    rows = []
    for line in (DATA_DIR / "README.md").read_text().splitlines():
        match = _ROW.match(line)
        if match:
            rows.append({k: v.strip() for k, v in match.groupdict().items()})
    return rows


def test_every_listed_data_file_is_present_unmodified_with_its_licence() -> None:
    rows = _listed()
    assert len(rows) == 10
    for row in rows:
        path = DATA_DIR / row["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == row["sha"], row["file"]
        if row["licence"] != "(itself)":
            licence = DATA_DIR / row["licence"].strip("`")
            assert licence.is_file(), row
            assert any(name in licence.read_text() for name in ("Apache License", "Attribution"))


def test_every_file_in_data_is_listed_in_its_readme() -> None:
    present = {p.relative_to(DATA_DIR).as_posix() for p in DATA_DIR.rglob("*") if p.is_file()} - {
        "README.md"
    }
    assert present == {row["file"] for row in _listed()}


def test_the_readme_gives_the_attribution_the_licences_ask_for() -> None:
    readme = (DATA_DIR / "README.md").read_text()
    assert "Splitwise: Efficient generative LLM inference using phase splitting" in readme
    assert "CC-BY-4.0" in readme
    assert "Apache-2.0" in readme


def test_the_code_finds_the_checkout_data_and_honours_the_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
    assert data.data_dir() == DATA_DIR
    for name in (
        data.AZURE_CHAT,
        data.AZURE_CODE,
        data.MOONCAKE_CONVERSATION,
        data.MOONCAKE_SYNTHETIC,
        data.SHAREGPT_STATS,
    ):
        assert (data.data_dir() / name).is_file(), name
    monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path))
    assert data.data_dir() == tmp_path
