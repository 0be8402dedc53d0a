# The SAL gateway image.
#
#   docker build -t sal-gateway:0.1.0 .
#   docker run -p 8080:8080 -v $PWD/config.yaml:/etc/sal/config.yaml:ro sal-gateway:0.1.0
#
# Two stages: `build` installs the project into a virtual environment; the final stage copies
# only that environment onto a fresh copy of the same base, so no pip cache, sources or build
# tooling reach the runtime image. Every dependency ships manylinux wheels: no compiler is
# needed in either stage. The same image also runs the engine emulator (the CPU compose profile):
#   docker run sal-gateway:0.1.0 python -m engine_sim.emulator ...   (entrypoint overridden)
#
# The base is a build argument. The default is the pinned public Python image; any Debian-like
# image with Python >= 3.11, its `venv` module and `groupadd`/`useradd` stands in, e.g. one
# made from Debian's own packages where no image registry is reachable
# (scripts/compose-smoke.sh; Debian names the interpreter `python3`):
#   docker build --build-arg PYTHON_IMAGE=sal-base:bookworm --build-arg PYTHON=python3 .
# The venv links to the base's interpreter, which is why both stages use the same base.
#
# pip reads an optional build secret `pip.conf` (an index, a certificate path under
# /run/secrets) and an optional secret `pip-cert`, for builds behind a private index:
#   docker build --secret id=pip.conf,src=... --secret id=pip-cert,src=... .
# Without them pip uses its defaults; the secrets never reach an image layer.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# The interpreter that creates the venv: `python` in the public image, `python3` on Debian's.
ARG PYTHON=python
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONFIG_FILE=/run/secrets/pip.conf
WORKDIR /src
RUN "${PYTHON}" -m venv /opt/sal
COPY pyproject.toml README.md* ./
COPY sal_core/ sal_core/
COPY sal_gateway/ sal_gateway/
COPY engine_patch/ engine_patch/
COPY engine_sim/ engine_sim/
COPY bench/ bench/
# A regular (non-editable) install: the runtime stage gets site-packages, not a link to /src.
# With the otel extra, so that `tracing.enabled` works in the image, and kv-events, so that
# `routing.prefix_cache: kv_events` does (pyzmq, msgspec: manylinux wheels).
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-cert \
    /opt/sal/bin/pip install --no-compile '.[otel,kv-events]' \
    && /opt/sal/bin/python -m compileall -q /opt/sal/lib

FROM ${PYTHON_IMAGE} AS runtime
ARG SAL_UID=10001
LABEL org.opencontainers.image.title="sal-gateway" \
      org.opencontainers.image.description="SAL: server-aware, token-aware OpenAI-compatible load balancer for vLLM" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid "${SAL_UID}" sal \
    && useradd --system --uid "${SAL_UID}" --gid sal --home-dir /var/cache/sal \
       --create-home --shell /usr/sbin/nologin sal
COPY --from=build /opt/sal /opt/sal
# The baked default config (DNS discovery of the `vllm` name, policy `sal`); mount your own
# file over /etc/sal/config.yaml, or override fields with SAL_GATEWAY__SECTION__FIELD=value.
COPY deploy/gateway/config.yaml /etc/sal/config.yaml
# Tokenizers load offline only: from a mounted directory or a Hugging Face cache under HF_HOME.
ENV PATH=/opt/sal/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/var/cache/sal/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
USER ${SAL_UID}:${SAL_UID}
WORKDIR /var/cache/sal
EXPOSE 8080
# No curl in the base image: the venv's interpreter that is already there does the probe.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8080/health', timeout=2).status != 200)"]
ENTRYPOINT ["sal-gateway"]
CMD ["serve", "--config", "/etc/sal/config.yaml", "--host", "0.0.0.0", "--port", "8080"]
