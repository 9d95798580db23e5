#!/usr/bin/env bash
# Creates .venv for one of the README's commands, and is safe to re-run:
#   scripts/setup.sh bench   torch, fastoptim (editable, C kernel built) and what `fastoptim bench` uses
#   scripts/setup.sh test    all of that, and the test tools, Triton and the training frameworks the tests use
#   scripts/setup.sh docs    torch, fastoptim and what `make docs` uses (MkDocs, its theme, mkdocstrings)
# torch comes from scripts/install_torch.py: a CPU build where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
purpose=${1:-test}
gpu=no
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=yes; fi
case $purpose in
    # Triton's kernels are the fused GPU engine; on a CPU machine only the tests use them (in its interpreter).
    bench) extras=bench,peers; [ $gpu = no ] || extras+=,triton,peers-gpu ;;
    test) extras=test,bench,peers,frameworks,triton; [ $gpu = no ] || extras+=,peers-gpu ;;
    docs) extras=docs ;;  # the API reference imports fastoptim, so the site is built beside it
    *) echo "usage: scripts/setup.sh [bench|test|docs]" >&2; exit 2 ;;
esac
say() { echo "setup: $*"; }
# A line every 20 s while a long step runs, so a quiet pip never looks hung.
ticking() {
    local started=$SECONDS
    ( while sleep 20; do say "... still $1 ($((SECONDS - started)) s so far)"; done ) &
    local ticker=$! status=0
    "${@:2}" || status=$?  # not left to set -e, which would leave the ticker running
    kill $ticker 2>/dev/null; wait $ticker 2>/dev/null || true
    return $status
}
say "preparing .venv for \`make $purpose\` (extras: $extras)"
# --system-site-packages: a torch already installed for this Python is used as it is.
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv --system-site-packages .venv
say "finding torch (a CPU build where there is no GPU; seconds if one is installed, else a download)"
.venv/bin/python scripts/install_torch.py
pip=(.venv/bin/python -m pip install --quiet)
# The editable install builds the native library (the C kernel and its torch ops), a minute of compiling: where fastoptim is installed and its
# kernel is newer than what it is built from (as after the other command's set-up), only the
# requirements of pyproject.toml (its dependencies and these extras) are installed.
kernel=$(ls fastoptim/_C*.so 2>/dev/null | head -1 || true)  # none in a fresh clone
# (what it is built from: setup.py and every C, C++ and header file under fastoptim/kernels)
if .venv/bin/python -c "import fastoptim" 2>/dev/null && [ -n "$kernel" ] && [ -z "$(find setup.py fastoptim/kernels \
        \( -name setup.py -o -name '*.c' -o -name '*.cpp' -o -name '*.h' \) -newer "$kernel")" ]; then
    mapfile -t requirements < <(.venv/bin/python -c 'import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + [r for extra in sys.argv[1].split(",")
                                          for r in project["optional-dependencies"][extra]]))' "$extras")
    say "the native library is up to date; installing the extras' packages (about a minute if they are new)"
    ticking "installing packages" "${pip[@]}" "${requirements[@]}"
else
    # the native library compiles against the installed torch: no isolated build environment, which
    # would fetch a torch of its own (a CUDA one, on a machine without a GPU)
    "${pip[@]}" "setuptools>=64"
    say "installing fastoptim's packages and building its native library: about 2-3 minutes on 2 idle cores" \
        "($(nproc) here; measured 2026-11-28), longer on a busy machine"
    ticking "building" "${pip[@]}" --no-build-isolation -e ".[$extras]"
fi
# timm's Adan is a peer, loaded by file path: timm's package imports torchvision, so no deps.
"${pip[@]}" --no-deps "timm>=1.0"
say "ready"
