#!/usr/bin/env bash
# Builds the Debian package: a Release build without tests or CUDA (its
# binaries then need only Debian's libraries, which dpkg-shlibdeps turns
# into the package's dependencies), installed under /usr, packed by CPack.
#   ./scripts/package.sh      -> build-pkg/aidn_<version>_amd64.deb
# Environment: AIDN_PKG_DIR (default build-pkg), AIDN_CMAKE_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
dir=${AIDN_PKG_DIR:-build-pkg}
# shellcheck disable=SC2206
extra=(${AIDN_CMAKE_ARGS:-})
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr \
  -DAIDN_BUILD_TESTS=OFF -DAIDN_ENABLE_CUDA=OFF "${extra[@]}" >/dev/null
ninja -C "$dir"
(cd "$dir" && cpack -G DEB >/dev/null)
ls "$dir"/aidn_*.deb
