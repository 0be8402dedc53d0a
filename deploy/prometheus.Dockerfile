# Prometheus from Debian's own package, for machines that reach no image registry.
#
#   docker build -f deploy/prometheus.Dockerfile --build-arg BASE_IMAGE=sal-base:bookworm \
#     -t sal-prometheus:debian - < deploy/prometheus.Dockerfile
#
# Compose runs the pinned `prom/prometheus` image by default; scripts/compose-smoke.sh builds
# this one on a base made by debootstrap and sets PROMETHEUS_IMAGE to it. It behaves like the
# official image where compose relies on it: the binary is the entrypoint (compose passes the
# flags), the config is mounted at /etc/prometheus, the data lives in /prometheus, owned by
# `nobody` (uid 65534, as in the official image), which it runs as. Debian bookworm ships Prometheus 2.42.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
# Unpinned on purpose: the version is whatever the base's Debian release carries, and a pin
# would break on each of its point releases.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o 65534 -g 65534 /prometheus
USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
