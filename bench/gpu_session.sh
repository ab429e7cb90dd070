#!/usr/bin/env bash
# Run ON THE DEVICE MACHINE (see bench/gpu_prepare.sh): installs the carried cffi runtime
# and liburing next to the image's own torch, then runs bench/gpu_check.py with its output
# in $OUT (JSON + log). Extra arguments go to gpu_check.py (e.g. --params 1B --steps 2).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
[ -d .gpu ] || { echo "gpu_session: no .gpu/ here: run bench/gpu_prepare.sh and carry .gpu" >&2; exit 2; }
if ! python3 -c "import _cffi_backend" 2>/dev/null; then  # the image has no cffi (2026-11)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/whl/*.whl || exit 2
fi
# Our module as built by gpu_prepare (limited API; a build made there would need liburing-dev).
[ -f tiermem/_native.abi3.so ] || cp .gpu/_native.abi3.so tiermem/
export PYTHONPATH="/tmp/site:$PWD" LD_LIBRARY_PATH="$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import sys, torch, tiermem; from tiermem.io import io_uring_status; \
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'io_uring', io_uring_status())"
  df -h "${TMPDIR:-/tmp}" | tail -1; nproc; free -g | head -2
} 2>&1 | tee "$out/env.txt"
# Correctness first (parity, CUDA tests), then two steps of the big model (the first only
# writes fresh records: 72 GB through the disk per step device at 2B parameters), then
# train_loop on the GPU if the budget leaves time for it. The JSON is rewritten after every
# phase, so a call cut short still brings back what was measured. Later arguments win.
python3 bench/gpu_check.py --swap-dir "${TMPDIR:-/tmp}" --out "$out/gpu_check.json" --steps 2 \
    --budget 480 "$@" 2>&1 \
    | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
