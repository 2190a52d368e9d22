#!/usr/bin/env bash
# Build docker/Dockerfile.cpu with podman and smoke-test it: `staleflow train configs/tiny.yaml`
# runs inside the image, completes, reconciles every group and learns; a second run, stopped
# with `podman stop`, ends cleanly (SIGTERM through tini, exit 143, resumable). Also builds
# the `wheel` stage of docker/Dockerfile.gpu (the stage that needs no CUDA base). `make image`
# and CI run it.
#
# No registry and no Docker daemon are needed: the Debian base is made locally with
# debootstrap and tagged with the name the Dockerfiles' FROM uses. With Docker and a registry,
# `docker build -f docker/Dockerfile.cpu .` is all it takes (README, "Containers").
#
# On this machine it changes podman's defaults: /etc/containers/containers.conf is written
# (runc as the runtime, container ulimits within the host's hard limits), fine on a CI
# machine; set STALEFLOW_KEEP_CONTAINERS_CONF=1 to keep an existing file.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-localhost/staleflow:cpu}
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

# Where the host's pip finds packages (a local wheel folder holds the CPU torch): the same
# settings, and the folders mounted read-only into the build.
pip_get() { python3 -m pip config get "global.$1" 2>/dev/null || true; }
find_links=$(pip_get find-links); extra_index=$(pip_get extra-index-url)
# Build args are kept in the image's history (`podman history`): a URL with a user or a
# token in it would be published with the image.
case "$find_links $extra_index" in
  *://*@*)
    echo "error: the host's pip find-links / extra-index-url holds credentials (user@ or" \
      "user:token@), which build args would store in the image's history; use an index" \
      "without them (a local mirror or wheel folder)" >&2
    exit 1 ;;
esac

step "podman, runc, debootstrap"
if ! { command -v podman && command -v runc && command -v debootstrap; } >/dev/null; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends podman runc debootstrap >/dev/null
fi
# crun fails here ("cgroups in hybrid mode not supported"); containers must not ask for more
# open files or processes than the host allows (nproc at most 32768).
if [ -z "${STALEFLOW_KEEP_CONTAINERS_CONF:-}" ] || [ ! -f /etc/containers/containers.conf ]; then
  n=$(ulimit -Hn); p=$(ulimit -Hu)
  if [ "$p" = unlimited ] || [ "$p" -gt 32768 ]; then p=32768; fi
  $SUDO mkdir -p /etc/containers
  printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n[engine]\nruntime = "runc"\n' \
    "$n" "$n" "$p" "$p" | $SUDO tee /etc/containers/containers.conf >/dev/null
fi

step "Debian bookworm base image"
if ! podman image exists docker.io/library/debian:bookworm-slim; then
  mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  rootfs=$(mktemp -d)
  $SUDO debootstrap --variant=minbase bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >/dev/null
  $SUDO rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  # HTTPS inside the build goes through the same proxy as the host: trust what the host trusts.
  $SUDO mkdir -p "$rootfs"/usr/local/share/ca-certificates "$rootfs"/etc/ssl/certs
  $SUDO cp /usr/local/share/ca-certificates/*.crt "$rootfs"/usr/local/share/ca-certificates/ 2>/dev/null || true
  $SUDO cp /etc/ssl/certs/ca-certificates.crt "$rootfs"/etc/ssl/certs/ca-certificates.crt
  $SUDO tar -C "$rootfs" -c . | podman import - localhost/debian:bookworm >/dev/null
  $SUDO rm -rf "$rootfs"
  podman tag localhost/debian:bookworm docker.io/library/debian:bookworm-slim
fi

build_args=() mounts=()
[ -n "$find_links" ] && build_args+=(--build-arg "PIP_FIND_LINKS=$find_links")
[ -n "$extra_index" ] && build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=$extra_index")
for location in $find_links; do
  dir=${location#file://}
  case "$dir" in /*) [ -d "$dir" ] && mounts+=(-v "$dir:$dir:ro") ;; esac
done
for location in $extra_index; do  # a local index links to files beside it: mount its parent
  dir=${location#file://}
  case "$dir" in /*) [ -d "$dir" ] && mounts+=(-v "$(dirname "$dir"):$(dirname "$dir"):ro") ;; esac
done

step "build $IMAGE from docker/Dockerfile.cpu"
podman build --pull=never "${build_args[@]}" "${mounts[@]}" -f docker/Dockerfile.cpu -t "$IMAGE" .

step "smoke test: staleflow train configs/tiny.yaml inside the image"
summary=$(podman run --rm --shm-size=1g --entrypoint sh "$IMAGE" -c \
  'staleflow train configs/tiny.yaml run.output_dir=/tmp/runs >&2 && cd /tmp/runs/* &&
   python -c "import json; print(json.dumps({\"summary\": json.load(open(\"summary.json\")),
   \"evals\": [r for r in map(json.loads, open(\"metrics.jsonl\")) if r[\"kind\"] == \"eval\"]}))"')
SUMMARY="$summary" python3 - <<'PY'
import json, os
out = json.loads(os.environ["SUMMARY"])
s, evals = out["summary"], out["evals"]
g = s["groups"]
first, last = evals[0], evals[-1]
print(f"in the image: {s['status']}, {s['steps']} steps, held-out reward "
      f"{first['reward_mean']:.3f} (step {first['step']}) -> {last['reward_mean']:.3f} "
      f"(step {last['step']}), pushed {g['pushed']} = trained {g['trained']} + stale "
      f"{g['dropped_stale']} + invalid {g['dropped_invalid']} + left {g['left_in_buffer']}")
assert s["status"] == "completed", s["status"]
assert g["reconciled"] and g["duplicates"] == 0, g
assert last["reward_mean"] > first["reward_mean"], "the tiny run did not learn in the image"
PY

step "stop test: \`podman stop\` (SIGTERM, through the image's tini) stops a run cleanly"
# The image's own entry point, as `docker run IMAGE train ...` uses it: the run must end
# interrupted by SIGTERM, with a checkpoint to resume from and its groups reconciled.
cid=$(podman run -d --shm-size=1g "$IMAGE" train configs/tiny.yaml run.name=stop \
  run.steps=100000 run.eval_every=0)
# on a failure below: the container's last output, then it goes
trap 'podman logs --tail 100 "$cid" >&2 || true; podman rm -f "$cid" >/dev/null 2>&1 || true' EXIT
count_steps='import json; print(sum(json.loads(line)["kind"] == "step" for line in open("runs/stop/metrics.jsonl")))'
steps=0
for _ in $(seq 300); do  # a few steps done: the run is past its start
  steps=$(podman exec "$cid" python -c "$count_steps" 2>/dev/null || echo 0)
  [ "$steps" -ge 3 ] || [ "$(podman inspect -f '{{.State.Running}}' "$cid")" != true ] && break
  sleep 1
done
podman stop -t 120 "$cid" >/dev/null
rc=$(podman wait "$cid")
summary=$(podman cp "$cid:/opt/staleflow/runs/stop/summary.json" - | tar -xO)
RC="$rc" STEPS="$steps" SUMMARY="$summary" python3 - <<'PY'
import json, os
s, rc = json.loads(os.environ["SUMMARY"]), int(os.environ["RC"])
print(f"stopped after {os.environ['STEPS']}+ steps: exit {rc}, {s['status']} by "
      f"{s.get('stopped_by')} at step {s['steps']}, resume: {s.get('resume')!r}, "
      f"reconciled {s['groups']['reconciled']}")
assert rc == 128 + 15, f"exit {rc}, not 143 (128 + SIGTERM): the stop was not clean"
assert (s["status"], s.get("stopped_by")) == ("interrupted", "SIGTERM"), s
assert s.get("resume") and s["groups"]["reconciled"], s
PY
trap - EXIT
podman rm "$cid" >/dev/null

step "docker/Dockerfile.gpu, stage 'wheel' (the CUDA stage needs nvidia/cuda, not here)"
podman build --pull=never "${build_args[@]}" "${mounts[@]}" --target wheel \
  -f docker/Dockerfile.gpu -t localhost/staleflow:gpu-wheel .
podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep staleflow
