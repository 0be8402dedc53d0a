#!/usr/bin/env bash
# The CPU compose stack, built and run for real in a local Docker engine (docs/deployment.md,
# "Proven by running"): no image registry is needed.
#
#   scripts/compose-smoke.sh          (as root; CI runs it through tests/e2e/test_compose_smoke.py)
#
# 1. installs Debian's docker.io, docker-compose (1.29) and debootstrap if missing;
# 2. starts dockerd if none answers (and stops only the one it started, on every exit path);
# 3. builds a base image from Debian's packages (debootstrap + docker import), cached per
#    suite, package list and month, with the mirror apt is configured with on this machine;
# 4. builds the gateway image (Dockerfile, on that base) and a Prometheus image from Debian's
#    package (deploy/prometheus.Dockerfile); pip and apt inside the builds use this machine's
#    index, certificate and proxies, read at run time and passed as build secrets/arguments;
# 5. brings up the CPU profile (gateway + emulated replicas + Prometheus; Grafana is not packaged
#    by Debian, so it is left out), waits for health, checks the gateway runs as its non-root
#    user, sends OpenAI SDK traffic through the published port on 127.0.0.1, checks Prometheus'
#    targets and the dashboard's and alert rules' queries, scales the replicas up and down and
#    waits for the gateway's DNS discovery and Prometheus to follow;
# 6. tears everything down and prints the time of each stage.
#
# Environment: PYTHON (default .venv/bin/python: needs the dev extra: openai, promql-parser),
# SMOKE_REPLICAS (2), SMOKE_SUITE (bookworm), DEBIAN_MIRROR (default: from apt's sources),
# DOCKER (the docker CLI; default Debian's /usr/bin/docker, whose builder needs no buildx).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

python_bin=${PYTHON:-$repo/.venv/bin/python}
replicas=${SMOKE_REPLICAS:-2}
suite=${SMOKE_SUITE:-bookworm}
base_packages=python3,python3-venv,ca-certificates
project=sal-smoke
gateway_image=sal-gateway:smoke
prometheus_image=sal-prometheus:smoke
model=tiny # SERVED_MODEL_NAME of deploy/cpu.env
work=$(mktemp -d /tmp/sal-smoke.XXXXXX)

# --- stages, timings, cleanup --------------------------------------------------------------

timings=()
results=()
stage_name=""
stage_start=$SECONDS
stage() {
  end_stage
  stage_name=$1
  stage_start=$SECONDS
  echo "== $1"
}
end_stage() {
  if [[ -n $stage_name ]]; then
    timings+=("$(printf '  %-34s %5d s' "$stage_name" $((SECONDS - stage_start)))")
  fi
  stage_name=""
}
note() {
  local line
  while IFS= read -r line; do
    echo "$line"
    results+=("  $line")
  done <<<"$1"
}
die() {
  echo "FAILED: $*" >&2
  exit 1
}

started_dockerd=""
stack_up=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local failed_stage=$stage_name
  end_stage
  if [[ -n $stack_up ]]; then
    if ((rc != 0)); then
      echo "== logs of the stack (failure in: $failed_stage)"
      compose logs --no-color --tail 40 || true
    fi
    echo "== tearing down the stack"
    compose down -v --remove-orphans --timeout 10 >/dev/null 2>&1 || true
  fi
  if [[ -n $started_dockerd ]]; then
    if ((rc != 0)); then tail -n 20 "$work/dockerd.log" || true; fi
    echo "== stopping the dockerd this script started (pid $started_dockerd)"
    kill -TERM "$started_dockerd" 2>/dev/null || true
    for _ in $(seq 60); do
      kill -0 "$started_dockerd" 2>/dev/null || break
      sleep 0.5
    done
  fi
  rm -rf "$work"
  echo "== compose smoke: stage times"
  printf '%s\n' "${timings[@]}"
  printf '  %-34s %5d s\n' "total" "$SECONDS"
  if ((${#results[@]})); then
    echo "== compose smoke: results"
    printf '%s\n' "${results[@]}"
  fi
  if ((rc == 0)); then echo "compose smoke: PASSED"; else echo "compose smoke: FAILED (in: $failed_stage)"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- 1. tools ------------------------------------------------------------------------------

stage "tools (docker.io, docker-compose, debootstrap)"
missing=()
[[ -x /usr/sbin/dockerd ]] || command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
  [[ $(id -u) == 0 ]] || die "installing ${missing[*]} needs root"
  echo "installing ${missing[*]} from Debian"
  apt-get update -q >"$work/apt.log" 2>&1 || { tail -n 20 "$work/apt.log"; die "apt-get update"; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
    >>"$work/apt.log" 2>&1 || { tail -n 20 "$work/apt.log"; die "apt-get install ${missing[*]}"; }
fi
docker=${DOCKER:-}
if [[ -z $docker ]]; then
  # Debian's client drives the engine's built-in BuildKit itself; a newer static client
  # earlier on PATH would insist on the buildx plugin, which Debian does not package.
  if [[ -x /usr/bin/docker ]]; then docker=/usr/bin/docker; else docker=$(command -v docker); fi
fi
[[ -x $python_bin ]] || die "no Python at $python_bin (run scripts/test.sh once, or set PYTHON)"
"$python_bin" -c "import openai, promql_parser, yaml" || die "$python_bin lacks the dev extra"
echo "docker CLI $docker ($("$docker" --version)); $(docker-compose version --short 2>/dev/null || echo docker-compose ?)"

compose() {
  docker-compose --project-name "$project" --env-file "$repo/deploy/cpu.env" \
    --file "$work/compose.yaml" --project-directory "$repo/deploy" "$@"
}

# --- 2. engine -----------------------------------------------------------------------------

stage "docker engine"
if "$docker" info >/dev/null 2>&1; then
  echo "using the running Docker engine"
else
  [[ $(id -u) == 0 ]] || die "no Docker engine answers and starting dockerd needs root"
  dockerd_bin=$(command -v dockerd || echo /usr/sbin/dockerd)
  "$dockerd_bin" --pidfile "$work/dockerd.pid" >"$work/dockerd.log" 2>&1 &
  started_dockerd=$!
  for _ in $(seq 120); do
    "$docker" info >/dev/null 2>&1 && break
    kill -0 "$started_dockerd" 2>/dev/null || { tail -n 30 "$work/dockerd.log"; die "dockerd exited"; }
    sleep 0.5
  done
  "$docker" info >/dev/null 2>&1 || { tail -n 30 "$work/dockerd.log"; die "dockerd did not answer in 60 s"; }
  echo "started dockerd (pid $started_dockerd)"
fi
echo "engine $("$docker" version --format '{{.Server.Version}}'), storage $("$docker" info --format '{{.Driver}}')"

# --- 3. base image -------------------------------------------------------------------------

# The Debian archive apt uses here (deb822 `.sources` first, then one-line `.list` files).
apt_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    awk -v suite="$suite" '
      function flush() { if (uri != "" && ok && !done) { print uri; done = 1 } uri = ""; ok = 0 }
      /^[[:space:]]*$/ { flush(); next }
      tolower($1) == "uris:" { uri = $2 }
      tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == suite) ok = 1 }
      END { flush() }' "$f"
  done
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk -v suite="$suite" '
    $1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ } if ($(i + 1) == suite) print $i }'
}

stage "base image (debootstrap $suite)"
key=$(printf '%s %s %s' "$suite" "$base_packages" "$(date +%Y-%m)" | sha256sum | cut -c1-12)
base_image=sal-base:$suite-$key
if "$docker" image inspect "$base_image" >/dev/null 2>&1; then
  echo "cached: $base_image"
else
  mirror=${DEBIAN_MIRROR:-$(apt_mirror | head -n 1)} || true
  [[ -n $mirror ]] || die "no Debian mirror for $suite in apt's sources; set DEBIAN_MIRROR"
  debootstrap --variant=minbase --include="$base_packages" "$suite" "$work/rootfs" "$mirror" \
    >"$work/debootstrap.log" 2>&1 || { tail -n 20 "$work/debootstrap.log"; die "debootstrap"; }
  rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
  tar -C "$work/rootfs" -c . | "$docker" import -c 'CMD ["/bin/bash"]' - "$base_image" >/dev/null
  rm -rf "$work/rootfs"
  # Older bases (another month or package list) go; their layers stay while images use them.
  "$docker" images --format '{{.Repository}}:{{.Tag}}' sal-base | grep -vx "$base_image" |
    xargs -r "$docker" rmi >/dev/null 2>&1 || true
  echo "built $base_image"
fi

# --- 4. images -----------------------------------------------------------------------------

# pip inside the build uses this machine's index, certificate and timeout (never written into
# a committed file): its effective configuration goes in as the build secret `pip.conf`, the
# certificate as `pip-cert`. Local-directory indexes (file://) do not exist in the build.
"$python_bin" - "$work" <<'EOF'
import re, shutil, subprocess, sys
from pathlib import Path

work = Path(sys.argv[1])
listed = subprocess.run(
    [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
).stdout
config: dict[str, str] = {}
for line in listed.splitlines():  # later scopes override earlier ones (env last)
    match = re.fullmatch(r"[^.]*\.([\w-]+)='(.*)'", line.strip())
    if match:
        config[match[1]] = match[2]
lines = ["[global]"]
for key in ("index-url", "extra-index-url"):
    urls = [u for u in config.get(key, "").split() if u.startswith(("http://", "https://"))]
    if urls:
        lines.append(f"{key} = {' '.join(urls)}")
for key in ("trusted-host", "proxy", "timeout", "default-timeout", "retries"):
    if key in config:
        lines.append(f"{key.removeprefix('default-')} = {config[key]}")
if config.get("cert") and Path(config["cert"]).is_file():
    shutil.copyfile(config["cert"], work / "pip-cert")
    lines.append("cert = /run/secrets/pip-cert")
(work / "pip.conf").write_text("\n".join(lines) + "\n")
print("pip settings passed to the build:", ", ".join(l.split(" =")[0] for l in lines[1:]) or "none")
EOF
secrets=(--secret "id=pip.conf,src=$work/pip.conf")
[[ -f $work/pip-cert ]] && secrets+=(--secret "id=pip-cert,src=$work/pip-cert")
proxies=()
for var in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  [[ -n ${!var:-} ]] && proxies+=(--build-arg "$var")
done

build() {
  local log=$work/build-$1.log
  shift
  DOCKER_BUILDKIT=1 "$docker" build --progress plain --network host "${proxies[@]}" "$@" \
    >"$log" 2>&1 || { tail -n 40 "$log"; die "docker build $*"; }
}

stage "gateway image build"
build gateway "${secrets[@]}" --build-arg "PYTHON_IMAGE=$base_image" --build-arg PYTHON=python3 \
  -t "$gateway_image" .
echo "built $gateway_image ($("$docker" image inspect -f '{{.Size}}' "$gateway_image" | awk '{printf "%d MB", $1 / 1e6}'))"

stage "prometheus image build (Debian)"
build prometheus --build-arg "BASE_IMAGE=$base_image" -t "$prometheus_image" - \
  <deploy/prometheus.Dockerfile
echo "built $prometheus_image ($("$docker" run --rm "$prometheus_image" --version 2>&1 | head -n 1))"

# --- 5. the stack --------------------------------------------------------------------------

free_port() { "$python_bin" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export GATEWAY_BIND=127.0.0.1 GATEWAY_PORT PROMETHEUS_PORT GATEWAY_IMAGE=$gateway_image \
  PROMETHEUS_IMAGE=$prometheus_image CPU_REPLICAS=$replicas
GATEWAY_PORT=$(free_port)
PROMETHEUS_PORT=$(free_port)
gateway_url=http://127.0.0.1:$GATEWAY_PORT
prometheus_url=http://127.0.0.1:$PROMETHEUS_PORT
# Runs one check of scripts/compose_smoke.py and records what it printed.
smoke() {
  local out
  out=$("$python_bin" "$repo/scripts/compose_smoke.py" "$@") || die "compose_smoke.py $*"
  note "$out"
}

# docker-compose 1.29 predates the top-level `name:` (compose v2 reads it); the project name
# comes from --project-name instead. Everything else is the committed file, as written.
"$python_bin" -c '
import sys, yaml
spec = yaml.safe_load(open(sys.argv[1]))
spec.pop("name", None)
yaml.safe_dump(spec, open(sys.argv[2], "w"), sort_keys=False)' deploy/compose.yaml "$work/compose.yaml"

stage "stack up + healthy"
compose down -v --remove-orphans --timeout 5 >/dev/null 2>&1 || true # a run killed earlier
stack_up=1
# Grafana has no Debian package (and no registry to pull it from): every other service runs.
compose up -d --no-build gateway emulator prometheus
wait_healthy() {
  local ids status
  for _ in $(seq 120); do
    ids=$(compose ps -q gateway emulator)
    status=$("$docker" inspect -f '{{.Name}} {{.State.Health.Status}}' $ids)
    grep -vq ' healthy$' <<<"$status" || { echo "$status"; return 0; }
    sleep 1
  done
  echo "$status"
  return 1
}
wait_healthy || die "containers not healthy in 120 s"
gateway_container=$(compose ps -q gateway)
gateway_uid=$("$docker" exec "$gateway_container" id -u)
[[ $gateway_uid != 0 ]] || die "the gateway runs as root"
note "gateway image: healthy by its own HEALTHCHECK, runs as uid $gateway_uid ($("$docker" exec "$gateway_container" id -un))"
smoke ready "$gateway_url" "$replicas"

stage "openai SDK traffic"
smoke traffic "$gateway_url" "$model" --requests 64 --concurrency 8 --adapter demo-lora --adapter demo-lora-b

stage "prometheus targets + queries"
smoke prometheus "$prometheus_url" "$gateway_url" "$replicas"

stage "scale replicas up ($replicas -> $((replicas + 1)))"
compose up -d --no-build --no-recreate --scale "emulator=$((replicas + 1))" emulator
smoke ready "$gateway_url" $((replicas + 1))
smoke targets "$prometheus_url" $((replicas + 1))
smoke traffic "$gateway_url" "$model" --requests 16 --concurrency 4

stage "scale replicas down ($((replicas + 1)) -> 1)"
compose up -d --no-build --no-recreate --scale emulator=1 emulator
smoke ready "$gateway_url" 1
smoke targets "$prometheus_url" 1
smoke traffic "$gateway_url" "$model" --requests 16 --concurrency 4

stage "teardown"
compose down -v --remove-orphans --timeout 10
stack_up=""
end_stage
