"""The engine command lines in deploy/ parse with the pinned vLLM's own ``serve`` parser.

The launcher accepts them (test_deploy_compose / test_deploy_k8s); this checks the step after:
that every argument the launcher hands to vLLM exists in the installed vLLM (the CPU build has
the same CLI as the GPU image's) with the intended value — a renamed vLLM flag would otherwise
show up only when a GPU replica fails to start.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import pytest

from engine_patch.launcher import plan_launch
from tests.deploy_support import DEPLOY, K8S, compose_project, load_yaml

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_serve_parser() -> argparse.ArgumentParser:
    """vLLM's ``vllm serve`` parser, built as `engine_patch.launcher.run_vllm_serve` builds it."""
    # torch and vLLM emit DeprecationWarnings of their own at import time
    # (torch.jit.script_method and friends); `filterwarnings=error` would fail the fixture.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM (deploy test)")
    subparsers = parser.add_subparsers(dest="subparser", required=True)
    ServeSubcommand().subparser_init(subparsers)
    result: argparse.ArgumentParser = parser
    return result


def _compose_engine_args() -> list[str]:
    project = compose_project(DEPLOY / ".env")
    args: list[str] = project["services"]["vllm-0"]["command"]
    return args


def _k8s_engine_args() -> list[str]:
    statefulset = load_yaml(K8S / "vllm-statefulset.yaml")
    args: list[str] = statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


@pytest.mark.parametrize("source", ["compose", "k8s"])
def test_engine_args_parse_with_vllm(
    source: str, vllm_serve_parser: argparse.ArgumentParser
) -> None:
    args = _compose_engine_args() if source == "compose" else _k8s_engine_args()
    plan = plan_launch(args, async_default=True)  # the GPU image schedules asynchronously
    ns: Any = vllm_serve_parser.parse_args(["serve", *plan.vllm_args])
    assert ns.model_tag == args[0]
    assert ns.port == 8000
    assert ns.host == "0.0.0.0"
    assert ns.tensor_parallel_size == 1
    assert ns.max_model_len == 8192
    assert ns.gpu_memory_utilization == pytest.approx(0.9)
    assert ns.scheduler_cls == "engine_patch.scheduler.LarryTailAsyncScheduler"
    assert ns.middleware == ["engine_patch.stats_route.StatsMiddleware"]
    assert ns.additional_config["larry_tail"]["alpha"] == pytest.approx(1.0)


def test_vllm_parser_rejects_a_misspelt_flag(vllm_serve_parser: argparse.ArgumentParser) -> None:
    # Guards the test above: vLLM's parser must refuse unknown flags, not ignore them.
    with pytest.raises(SystemExit):
        vllm_serve_parser.parse_args(["serve", "m", "--max-model-lenn", "3"])
