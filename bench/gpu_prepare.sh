#!/usr/bin/env bash
# Run HERE (the development machine), in a session whose task is lent a GPU, before the
# device call. The device machine (Python 3.12, its own torch with CUDA, nothing to fetch)
# lacks what tiermem needs beside torch: cffi's runtime, liburing and our native module.
# This puts them in .gpu/ (ignored by git through .git/info/exclude), to be carried:
#
#   bash bench/gpu_prepare.sh
#   device run: command "bash bench/gpu_session.sh", carry [".gpu"], timeout_s 540
#
# bench/gpu_session.sh then runs bench/gpu_check.py there and leaves its JSON and log in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null  # builds tiermem/_native.abi3.so (limited API: loads on 3.12 too)
abi3=tiermem/_native.abi3.so
[ -f "$abi3" ] || { echo "gpu_prepare: $abi3 was not built (make setup)" >&2; exit 1; }
rm -rf .gpu && mkdir -p .gpu/whl .gpu/lib
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
cp "$abi3" .gpu/
# The shared liburing our module links against (plain C, needs glibc >= 2.4 only).
cp "$(ldconfig -p | awk '/liburing\.so\.2 / {print $NF; exit}')" .gpu/lib/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl cffi pycparser
du -sh .gpu
echo "gpu_prepare: ready; carry .gpu and run: bash bench/gpu_session.sh"
