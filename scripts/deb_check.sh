#!/usr/bin/env bash
# The Debian package on a fresh Debian 12: builds it (scripts/package.sh),
# makes a minimal bookworm root with debootstrap (cached), installs the
# package there with apt (which fetches its dependencies from Debian), boots
# the root with systemd-nspawn on a private network, and checks that both
# units are active, the worker has joined the coordinator, and a job
# succeeds. Then it powers the container off and removes the root.
#   sudo ./scripts/deb_check.sh
# Needs root and Debian's archive (deb.debian.org); takes minutes, so it is
# not part of test.sh. AIDN_CACHE_DIR (default ~/.cache/aidn) keeps the
# bootstrapped root between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "deb_check.sh: run as root (debootstrap, chroot, nspawn)" >&2; exit 1; }
for tool in debootstrap systemd-nspawn nsenter; do
  command -v "$tool" >/dev/null || { echo "deb_check.sh: $tool is missing (apt-get install debootstrap systemd-container)" >&2; exit 1; }
done
log() { echo "deb_check.sh: $(date -u +%H:%M:%S) $*"; }

deb=$(./scripts/package.sh | tail -1)
log "package: $deb ($(du -h "$deb" | cut -f1))"

cache=${AIDN_CACHE_DIR:-$HOME/.cache/aidn}
base=$cache/debootstrap-bookworm-minbase.tar
mkdir -p "$cache"
work=$(mktemp -d /var/tmp/aidn-deb-check.XXXXXX)
root=$work/root
nspawn_pid=""
cleanup() {
  if [ -n "$nspawn_pid" ] && kill -0 "$nspawn_pid" 2>/dev/null; then
    kill -TERM "$nspawn_pid" 2>/dev/null || true  # a poweroff request to the container
    for _ in $(seq 60); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$nspawn_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

if [ ! -s "$base" ]; then
  log "debootstrap bookworm (minbase + systemd) into the cache"
  debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,ca-certificates \
    bookworm "$work/bootstrap" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log"; exit 1; }
  tar -C "$work/bootstrap" -cf "$base" .
  rm -rf "$work/bootstrap"
fi
mkdir -p "$root"
tar -C "$root" -xf "$base"
echo "aidn-deb-check" >"$root/etc/hostname"
: >"$root/etc/machine-id"

log "apt-get install $(basename "$deb") (and dataset-fashion-mnist for the job) in the fresh root"
cp "$deb" "$root/tmp/"
cp /etc/resolv.conf "$root/etc/resolv.conf"
chroot "$root" /bin/sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends /tmp/$(basename "$deb") dataset-fashion-mnist" \
  >"$work/apt.log" 2>&1 || { tail -30 "$work/apt.log"; exit 1; }
chroot "$root" dpkg -s aidn | sed -n 's/^Depends: /deb_check.sh: depends: /p'
for unit in aidn-coordinator aidn-worker; do
  [ -L "$root/etc/systemd/system/multi-user.target.wants/$unit.service" ] ||
    { echo "deb_check.sh: $unit.service was not enabled by the package" >&2; exit 1; }
done

log "booting the root with systemd-nspawn (private network: loopback only)"
systemd-nspawn --quiet --boot --register=no --keep-unit --private-network --directory="$root" \
  >"$work/console.log" 2>&1 &
nspawn_pid=$!
leader=""
for _ in $(seq 60); do
  leader=$(pgrep -P "$nspawn_pid" | head -1 || true)
  [ -n "$leader" ] && break
  sleep 0.5
done
[ -n "$leader" ] || { echo "deb_check.sh: the container did not start" >&2; cat "$work/console.log"; exit 1; }
inside() { nsenter --target "$leader" --mount --uts --ipc --net --pid -- "$@" </dev/null; }

# Polls "$@" inside the container for up to `limit` seconds.
wait_inside() {
  local limit=$1 what=$2
  shift 2
  local deadline=$((SECONDS + limit))
  until inside "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then
      echo "deb_check.sh: gave up waiting for $what" >&2
      inside journalctl --no-pager -n 60 -u aidn-coordinator -u aidn-worker >&2 || true
      exit 1
    fi
    sleep 1
  done
}
wait_inside 120 "the system to boot" systemctl is-system-running --wait
wait_inside 60 "both units to be active" systemctl is-active aidn-coordinator aidn-worker
log "active: $(inside systemctl is-active aidn-coordinator aidn-worker | tr '\n' ' ')"
ctl() {
  inside env AIDN_TOKEN="$(inside cat /var/lib/aidn/coordinator/admin.token)" \
    AIDN_TLS_CA=/var/lib/aidn/coordinator/tls/ca.pem aidnctl "$@"
}
# shellcheck disable=SC2016  # expanded inside the container
wait_inside 60 "the worker to join" sh -c \
  'AIDN_TOKEN=$(cat /var/lib/aidn/coordinator/admin.token) AIDN_TLS_CA=/var/lib/aidn/coordinator/tls/ca.pem aidnctl workers | grep -q ALIVE'
ctl workers
ctl health
log "a job from the installed examples"
inside sed -e 's/^epochs: .*/max_steps: 100/' /usr/share/aidn/examples/fashion-mnist-mlp.yaml \
  >"$root/root/job.yaml"
job=$(ctl -o json submit /root/job.yaml | python3 -c 'import json,sys; print(json.load(sys.stdin)["job"]["id"])')
ctl watch "$job"
log "the package installs on a fresh Debian 12, its services start, and a job succeeds"
