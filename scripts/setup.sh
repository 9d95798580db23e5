#!/usr/bin/env bash
# Creates .venv with torch, fastoptim (editable) and the test tools. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
# --system-site-packages: a torch already installed for this Python is used as it is.
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv --system-site-packages .venv
pip=(.venv/bin/python -m pip install --quiet)
if .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -c "import sys, torch; v = tuple(map(int, torch.__version__.split('.')[:2]));
sys.exit(0 if v >= (2, 4) else f'setup: torch {torch.__version__} is installed; fastoptim needs torch>=2.4')"
else
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "${pip[@]}" "torch>=2.4"
    elif ! "${pip[@]}" "torch==2.13.0+cpu"; then
        # A plain 'torch' requirement would pull several GB of CUDA packages onto a machine without a GPU.
        echo "setup: no CPU build of torch found; install a CPU torch>=2.4 into .venv, then re-run" >&2
        exit 1
    fi
fi
"${pip[@]}" -e ".[test,bench,peers,triton]"
# timm's Adan is a test peer, loaded by file path: timm's package imports torchvision, so no deps.
"${pip[@]}" --no-deps "timm>=1.0"
