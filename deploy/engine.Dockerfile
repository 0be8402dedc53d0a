# A vLLM replica with the LARRY scheduler and the `GET /stats` endpoint (engine_patch).
#
#   docker build -f deploy/engine.Dockerfile -t sal-engine:vllm-0.32.0 .
#
# Based on the official OpenAI-server image at the exact vLLM version engine_patch is tested
# against (pyproject's `vllm` extra). engine_patch plugs in through vLLM's own hooks
# (--scheduler-cls, --middleware), so upgrading vLLM means: bump VLLM_VERSION here and in
# pyproject.toml, run the vLLM-marked tests, rebuild (docs/deployment.md, "Upgrading vLLM").
#
# The base is a build argument: any image that already has this vLLM version and a Python
# with pip stands in (a mirror of the official image, or one built locally), e.g.
#   docker build -f deploy/engine.Dockerfile --build-arg ENGINE_BASE_IMAGE=my/vllm:0.32.0 \
#     --build-arg PYTHON=/opt/venv/bin/python .
ARG VLLM_VERSION=0.32.0
ARG ENGINE_BASE_IMAGE=vllm/vllm-openai:v${VLLM_VERSION}
FROM ${ENGINE_BASE_IMAGE}
# The interpreter vLLM is installed into (the official image's is `python3` on PATH).
ARG PYTHON=python3

COPY pyproject.toml README.md* /tmp/sal/
COPY sal_core/ /tmp/sal/sal_core/
COPY sal_gateway/ /tmp/sal/sal_gateway/
COPY engine_patch/ /tmp/sal/engine_patch/
COPY engine_sim/ /tmp/sal/engine_sim/
COPY bench/ /tmp/sal/bench/
# --no-deps: the base image already has everything engine_patch imports (vLLM, FastAPI,
# PyYAML); resolving the gateway's dependency list here could move vLLM's own pins.
RUN "${PYTHON}" -m pip install --no-cache-dir --no-deps /tmp/sal \
    && rm -rf /tmp/sal

ENV VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
# `sal-engine serve MODEL [vLLM serve arguments...]`: starts the OpenAI server with LARRY and
# /stats wired in (arguments after the model are passed to vLLM).
ENTRYPOINT ["sal-engine", "serve"]
