#!/usr/bin/env bash
# Installs the Debian packages kvlens needs (only those missing) and builds it into build/.
#   ./setup.sh            the CLI and the desktop app (kvlens-gui); the CUDA backend too where
#                         nvcc is found (KVLENS_CUDA=AUTO, the default); no test suites
#   ./setup.sh --tests    also the test suites and what they need: Xvfb and Mesa for the headless app tests,
#                         poppler-utils (pdftoppm) and expat for the figure export checks, Java
#                         and pycocoevalcap (PyPI, for its METEOR jar) for the caption metrics,
#                         OpenMPI for the sharded evaluation
#   KVLENS_CUDA=OFF ./setup.sh  skips the CUDA backend
set -euo pipefail
cd "$(dirname "$0")"

tests=0
for a in "$@"; do
  case "$a" in
    --tests) tests=1 ;;
    *) echo "usage: ./setup.sh [--tests]" >&2; exit 2 ;;
  esac
done

pkgs=(build-essential cmake pkg-config nlohmann-json3-dev libsentencepiece-dev libstb-dev libjpeg-dev
      libopenblas-dev libcli11-dev libgtest-dev libpcre2-dev libicu-dev)
# The desktop app and figure export: Dear ImGui, GLFW, Cairo, DejaVu fonts (Greek, math).
pkgs+=(libimgui-dev libglfw3-dev libcairo2-dev fonts-dejavu-core)
if [ "$tests" = 1 ]; then
  pkgs+=(xvfb xauth libgl1-mesa-dri poppler-utils libexpat1-dev)
  pkgs+=(libopenmpi-dev openmpi-bin python3-venv)
  command -v java >/dev/null 2>&1 || pkgs+=(default-jre-headless)
fi
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

# pycocoevalcap's meteor-1.5.jar (METEOR is compared with pycocoevalcap's): pip into the user's
# Python, or into .deps/venv where the system Python is externally managed.
if [ "$tests" = 1 ] && ! python3 -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("pycocoevalcap"))' 2>/dev/null \
   && ! [ -x .deps/venv/bin/python3 ]; then
  echo "kvlens setup: installing pycocoevalcap (PyPI)"
  python3 -m pip install -q --no-deps pycocoevalcap 2>/dev/null ||
    { python3 -m venv .deps/venv && .deps/venv/bin/python3 -m pip install -q --no-deps pycocoevalcap; }
fi

# The app and the CLI only, unless the tests are asked for (they are most of the build).
jobs=$(nproc 2>/dev/null || echo 2)
with_tests=OFF
[ "$tests" = 1 ] && with_tests=ON
echo "kvlens setup: configuring build/ (tests $with_tests, CUDA ${KVLENS_CUDA:-AUTO})"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKVLENS_CUDA="${KVLENS_CUDA:-AUTO}" -DKVLENS_TESTS="$with_tests" >/dev/null
echo "kvlens setup: building with $jobs jobs"
cmake --build build -j"$jobs"
