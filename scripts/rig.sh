#!/usr/bin/env bash
# The test rig: installs what the tests need, starts an isolated containerd
# (its own root, state directory and socket; CRI disabled) unless it is already
# up, and builds the test images. Idempotent; used by CI, the README and
# developers. Prints the environment the tests read.
#
#   ZATTERA_RIG_DIR   where the rig keeps containerd's root, logs and images
#                     (default /var/lib/zattera-rig)
#   ZATTERA_RIG_RUN   containerd's state dir and socket (default /run/zattera-rig)
#   ZATTERA_RIG_S3_PORT  the loopback port of the rig's S3 server (default 9555)
#   ZATTERA_RIG_S3=0     no S3 server (the demo needs none)
set -euo pipefail

RIG_DIR=${ZATTERA_RIG_DIR:-/var/lib/zattera-rig}
RIG_RUN=${ZATTERA_RIG_RUN:-/run/zattera-rig}
SOCK="$RIG_RUN/containerd/containerd.sock"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

say() { printf '\033[1m[rig]\033[0m %s\n' "$*" >&2; }

if [ "$(id -u)" != 0 ]; then
  echo "rig.sh: must run as root (it installs packages and starts containerd)" >&2
  exit 1
fi

# --- packages --------------------------------------------------------------
PACKAGES=(containerd runc crun protobuf-compiler nftables busybox-static dnsutils iproute2 dnsmasq-base
          docker-registry skopeo python3 ca-certificates procps curl gcc libc6-dev
          libzstd-dev zstd pkg-config python3-venv tmux tcpdump iperf3 buildah)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d keeps the package scripts from starting the host's own
  # containerd or registry: the rig runs its own, isolated ones.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  rm -f /usr/sbin/policy-rc.d
  trap - EXIT
fi

# --- containerd --------------------------------------------------------------
mkdir -p "$RIG_DIR" "$RIG_RUN/containerd"
cat > "$RIG_DIR/containerd.toml" <<TOML
version = 2
root = "$RIG_DIR/containerd"
state = "$RIG_RUN/containerd"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "$SOCK"

[ttrpc]
  address = "$SOCK.ttrpc"

[debug]
  address = "$RIG_RUN/containerd/debug.sock"
TOML

if ctr --address "$SOCK" version >/dev/null 2>&1; then
  say "containerd already running on $SOCK"
else
  say "starting containerd on $SOCK (log: $RIG_DIR/containerd.log)"
  rm -f "$SOCK"
  setsid nohup containerd --config "$RIG_DIR/containerd.toml" >>"$RIG_DIR/containerd.log" 2>&1 < /dev/null &
  echo $! > "$RIG_RUN/containerd.pid"
  for _ in $(seq 1 100); do
    ctr --address "$SOCK" version >/dev/null 2>&1 && break
    sleep 0.1
  done
  if ! ctr --address "$SOCK" version >/dev/null 2>&1; then
    echo "rig.sh: containerd did not come up; last log lines:" >&2
    tail -n 20 "$RIG_DIR/containerd.log" >&2
    exit 1
  fi
fi

# --- test images -------------------------------------------------------------
IMAGES="$RIG_DIR/images"
mkdir -p "$IMAGES"
# The security tests' hostile process, static so it runs in a busybox image.
if [ ! -x "$IMAGES/ztprobe" ] || [ "$HERE/testbin/ztprobe.c" -nt "$IMAGES/ztprobe" ]; then
  say "building ztprobe"
  gcc -static -O2 -o "$IMAGES/ztprobe" "$HERE/testbin/ztprobe.c"
fi
# What the symlink image points at (a fixed path, as the image is fixed): a
# host directory no container may see.
mkdir -p /var/lib/zattera-rig/host-secret
echo "host secret" > /var/lib/zattera-rig/host-secret/secret.txt
if [ ! -s "$IMAGES/tools-oci.tar" ] || [ ! -s "$IMAGES/symlink-oci.tar" ] || [ ! -s "$IMAGES/busybox-user-oci.tar" ] \
  || [ ! -s "$IMAGES/volume-oci.tar" ] \
  || [ /bin/busybox -nt "$IMAGES/busybox-oci.tar" ] || [ "$HERE/mkimage.py" -nt "$IMAGES/busybox-oci.tar" ] \
  || [ "$IMAGES/ztprobe" -nt "$IMAGES/tools-oci.tar" ]; then
  say "building test images in $IMAGES"
  ZTPROBE="$IMAGES/ztprobe" python3 "$HERE/mkimage.py" "$IMAGES" >&2
fi

# --- S3 server ---------------------------------------------------------------
# moto's S3 server on loopback for the snapshot tests and bench/snapshot, in a
# venv of its own with what tests/snapshot_ref.py needs (the independent
# Tier A writer: cryptography's AES-GCM, zstandard; tests/telemetry.rs's
# exposition-format parser, prometheus_client). moto over s3s-fs: a pip
# install in seconds, where `cargo install s3s-fs` compiles for many minutes
# on a small machine; both speak path-style S3 with V4 signatures.
S3_VENV="$RIG_DIR/s3-venv"
S3_PORT=${ZATTERA_RIG_S3_PORT:-9555}
if [ "${ZATTERA_RIG_S3:-1}" != 0 ]; then
  if ! "$S3_VENV/bin/python" -c 'import moto.server, cryptography, zstandard, prometheus_client' 2>/dev/null; then
    say "installing moto[server], cryptography, zstandard and prometheus_client into $S3_VENV"
    rm -rf "$S3_VENV"
    /usr/bin/python3 -m venv "$S3_VENV"
    "$S3_VENV/bin/pip" install -q --disable-pip-version-check 'moto[server]>=5,<6' 'cryptography>=41' 'zstandard>=0.22' 'prometheus_client>=0.20' >&2
  fi
  if curl -fsS -o /dev/null "http://127.0.0.1:$S3_PORT/moto-api/data.json" 2>/dev/null; then
    say "S3 server already running on 127.0.0.1:$S3_PORT"
  else
    say "starting moto's S3 server on 127.0.0.1:$S3_PORT (log: $RIG_DIR/s3.log)"
    setsid nohup "$S3_VENV/bin/moto_server" -H 127.0.0.1 -p "$S3_PORT" >>"$RIG_DIR/s3.log" 2>&1 < /dev/null &
    echo $! > "$RIG_RUN/s3.pid"
    for _ in $(seq 1 100); do
      curl -fsS -o /dev/null "http://127.0.0.1:$S3_PORT/moto-api/data.json" 2>/dev/null && break
      sleep 0.1
    done
    if ! curl -fsS -o /dev/null "http://127.0.0.1:$S3_PORT/moto-api/data.json" 2>/dev/null; then
      echo "rig.sh: the S3 server did not come up; last log lines:" >&2
      tail -n 20 "$RIG_DIR/s3.log" >&2
      exit 1
    fi
  fi
fi

cat <<ENV
export ZATTERA_TEST_CONTAINERD=$SOCK
export ZATTERA_TEST_IMAGES=$IMAGES
export ZATTERA_TEST_S3=http://127.0.0.1:$S3_PORT
export ZATTERA_TEST_S3_PYTHON=$S3_VENV/bin/python
ENV
