#!/usr/bin/env bash
# Installs the Debian packages kvlens needs (only those missing) and builds it into build/.
#   ./setup.sh            CPU build (+ the GUI when its packages are present)
#   KVLENS_CUDA=ON ./setup.sh   also builds the CUDA backend (needs nvcc)
set -euo pipefail
cd "$(dirname "$0")"

pkgs=(build-essential cmake pkg-config nlohmann-json3-dev libsentencepiece-dev libstb-dev libjpeg-dev
      libopenblas-dev libcli11-dev libgtest-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "kvlens setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKVLENS_CUDA="${KVLENS_CUDA:-OFF}" >/dev/null
cmake --build build -j"$jobs"
