#!/usr/bin/env bash
# Installs every Debian package aidn's build and tests need. Idempotent, and
# silent when everything is already there. Run as root (or with sudo).
set -euo pipefail

PACKAGES=(
  # toolchain
  g++ cmake ninja-build pkg-config
  # service libraries
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev libssl-dev
  libsqlite3-dev libyaml-cpp-dev libcli11-dev nlohmann-json3-dev zlib1g-dev
  libcpp-httplib-dev
  # aidnctl plot draws through gnuplot
  gnuplot-nox
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  # training: BLAS, Gloo, the dataset
  libopenblas-dev libdnnl-dev libgloo-dev dataset-fashion-mnist
  # a text corpus for the GPT (plain-text fortune files, about 2.5 MB)
  fortunes
  # the metrics tests scrape with a real Prometheus server and promtool, and
  # fetch /metrics over HTTPS with curl
  prometheus curl
  # fuzzing (scripts/fuzz.sh): clang with libFuzzer and the sanitizers
  clang
  # scripts/tsan.sh unpacks Debian's Abseil source (dpkg-source) to build it
  # with ThreadSanitizer
  dpkg-dev
  # the partition test makes a network namespace and a veth pair with ip
  iproute2
  # deployment tests: systemd-analyze verifies the units, a one-node Slurm
  # cluster runs the batch scripts, python3-kubernetes checks the manifests
  systemd slurm-wlm munge python3-kubernetes
  # the numerical oracle and speed peer (tests skip their torch checks only without it),
  # and torchvision's ResNet definitions
  python3-torch libopenblas0-openmp python3-torchvision
  # the Python client (python/aidn): gRPC and protobuf matching the C++ ones, CRC-32C at
  # disk speed for checkpoint manifests, YAML job specs and config
  python3-grpcio python3-protobuf python3-crc32c python3-yaml
  # the web UI draws its charts with Debian's Chart.js; its test drives headless Chromium
  libjs-chart.js chromium chromium-driver python3-selenium
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then SUDO=sudo; else
    echo "setup.sh: need root to install: ${missing[*]}" >&2
    exit 1
  fi
fi
echo "setup.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup.sh: done"
