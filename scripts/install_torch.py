"""Installs torch into a Python environment for fastoptim's set-up (standard library only: it runs
before torch exists).

Where torch is missing: with a GPU, torch from the pip configuration (PyPI's Linux wheels are CUDA
builds). Without one, a CPU build: first from PyTorch's CPU wheel index, then from what the pip
configuration offers. Each candidate is resolved by pip without installing (``--dry-run --report``),
and one that would bring CUDA is refused, so a machine without a GPU never downloads CUDA's
gigabytes. Where no candidate gives a CPU build, it stops and says what to run.

Usage: python scripts/install_torch.py [PYTHON]   (default: the Python running this script)
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REQUIREMENT = "torch>=2.4"
MINIMUM = (2, 4)
TESTED = "torch==2.13.0"  # the version fastoptim is tested with; a configuration may offer it as a CPU build
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# (where, pip arguments, requirement), tried in turn on a machine without a GPU. PyTorch's index is
# asked alone (no pip configuration files: their links and extra indexes would answer too).
ALONE = "--index-url"
CPU_CANDIDATES = [
    ("PyTorch's CPU wheel index", [ALONE, CPU_INDEX, "--timeout", "20", "--retries", "1"], REQUIREMENT),
    ("the pip configuration", [], REQUIREMENT),
    ("the pip configuration", [], TESTED),
]
GPU_CANDIDATES = [("the pip configuration", [], REQUIREMENT)]


def run(python, *args, capture=True):
    """``python`` with ``args``; a pip given its own --index-url reads no configuration files."""
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull) if ALONE in args else None
    return subprocess.run([python, *args], capture_output=capture, text=True, env=env)


def installed_torch(python):
    """The installed torch's version and CUDA version (None for a CPU build), or None if torch does not import."""
    out = run(python, "-c", "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))")
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None


def gpu_present():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except OSError:
        return False


def resolve(python, pip_args, requirement):
    """What pip would install for ``requirement`` (name -> (version, url)), or None where it cannot resolve."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        out = run(python, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--report",
                  str(report), *pip_args, requirement)
        if out.returncode != 0 or not report.exists():
            return None
        return {item["metadata"]["name"].lower(): (item["metadata"]["version"], item["download_info"]["url"])
                for item in json.loads(report.read_text())["install"]}


def brings_cuda(packages):
    """Whether a resolution is a CUDA build of torch: NVIDIA's libraries come with it, or its version says so."""
    return "+cu" in packages["torch"][0] or any(name.startswith(("nvidia-", "cuda-")) for name in packages)


def choose(gpu, resolve):
    """The first candidate that resolves to an acceptable build: (where, pip arguments, version, url).
    Raises SystemExit with what to run where none does."""
    tried = []
    for where, pip_args, requirement in GPU_CANDIDATES if gpu else CPU_CANDIDATES:
        packages = resolve(pip_args, requirement)
        if packages is None or "torch" not in packages:
            tried.append(f"{requirement} from {where}: not found")
        elif not gpu and brings_cuda(packages):
            tried.append(f"{requirement} from {where}: only a CUDA build ({packages['torch'][0]}), "
                         "refused without a GPU")
        else:
            return where, pip_args, *packages["torch"]
    raise SystemExit("setup: no torch build to install (" + "; ".join(tried) + ").\n"
                     "Install a torch>=2.4 into .venv yourself, then re-run; without a GPU, the CPU build:\n"
                     f"  .venv/bin/python -m pip install torch --index-url {CPU_INDEX}")


def main(python=sys.executable):
    present = installed_torch(python)
    if present is not None:
        version = tuple(int(part) for part in present[0].split("+")[0].split(".")[:2])
        if version < MINIMUM:
            raise SystemExit(f"setup: torch {present[0]} is installed; fastoptim needs {REQUIREMENT}")
        print(f"setup: torch {present[0]} already installed (CUDA {present[1] or 'none'})")
        return
    gpu = gpu_present()
    where, pip_args, version, url = choose(gpu, lambda pip_args, requirement: resolve(python, pip_args, requirement))
    print(f"setup: torch {version} from {where} ({url})", flush=True)
    out = run(python, "-m", "pip", "install", "--quiet", *pip_args, f"torch=={version}", capture=False)
    if out.returncode != 0:
        raise SystemExit(f"setup: pip failed to install torch {version} from {where}")
    cuda = installed_torch(python)[1]
    if cuda is not None and not gpu:
        raise SystemExit(f"setup: the installed torch {version} is a CUDA {cuda} build on a machine without a GPU; "
                         f"replace it: .venv/bin/python -m pip install --force-reinstall torch --index-url {CPU_INDEX}")


if __name__ == "__main__":
    main(*sys.argv[1:])
