"""The set-up's choice of a torch build (scripts/install_torch.py), run as a script against a stub
Python whose pip answers as a stubbed index would, and the one-line errors for missing extras."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "install_torch.py"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_BUILD = {"torch": "2.14.1", "nvidia-cublas": "13.1.1.3"}
CPU_BUILD = {"torch": "2.13.0+cpu"}

# A stand-in for the environment's Python: `-c` (the import of torch) fails until its pip has installed
# one; `-m pip install --dry-run --report FILE ... REQUIREMENT` writes the stubbed answer of the
# index that the arguments name (--index-url URL, or "config"), and every call is logged.
STUB = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    state = os.environ["STUB_STATE"]
    answers = json.loads(os.environ["STUB_ANSWERS"])
    args = sys.argv[1:]
    with open(os.path.join(state, "log"), "a") as log:
        log.write(json.dumps(args) + "\\n")
    if "--index-url" in args and os.environ.get("PIP_CONFIG_FILE") != os.devnull:
        sys.exit("read the pip configuration while asking an index alone")
    installed = os.path.join(state, "installed")
    if args[0] == "-c":
        if not os.path.exists(installed):
            sys.exit("ModuleNotFoundError: No module named 'torch'")
        print(json.dumps([open(installed).read(), os.environ.get("STUB_INSTALLED_CUDA") or None]))
        sys.exit()
    index = args[args.index("--index-url") + 1] if "--index-url" in args else "config"
    requirement = args[-1]
    packages = answers.get(index, {{}}).get(requirement)
    if "--dry-run" in args:
        if packages is None:
            sys.exit("ERROR: No matching distribution found for " + requirement)
        report = {{"install": [{{"metadata": {{"name": name, "version": version}},
                                 "download_info": {{"url": index + "/" + name}}}}
                               for name, version in packages.items()]}}
        open(args[args.index("--report") + 1], "w").write(json.dumps(report))
    else:
        open(installed, "w").write(requirement.split("==")[1])
    """)


def install(tmp_path, answers, gpu=False, installed_cuda=None):
    """Runs the script against the stub; returns its exit code, its output and the stub's log of calls."""
    python = tmp_path / "python"
    python.write_text(STUB.format(python=sys.executable))
    python.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: stub'\n" if gpu else "#!/bin/sh\nexit 9\n")
    smi.chmod(0o755)
    env = dict(os.environ, STUB_STATE=str(tmp_path), STUB_ANSWERS=json.dumps(answers),
               STUB_INSTALLED_CUDA=installed_cuda or "", PATH=f"{bin_dir}:{os.environ['PATH']}")
    out = subprocess.run([sys.executable, str(SCRIPT), str(python)], env=env, capture_output=True, text=True)
    calls = [json.loads(line) for line in (tmp_path / "log").read_text().splitlines()]
    installs = [call for call in calls if call[:3] == ["-m", "pip", "install"] and "--dry-run" not in call]
    return out.returncode, out.stdout + out.stderr, installs


def test_without_a_gpu_the_cpu_index_comes_first(tmp_path):
    code, output, installs = install(tmp_path, {CPU_INDEX: {"torch>=2.4": CPU_BUILD},
                                                "config": {"torch>=2.4": CUDA_BUILD}})
    assert code == 0, output
    assert "torch 2.13.0+cpu from PyTorch's CPU wheel index" in output
    (call,) = installs
    assert call[call.index("--index-url") + 1] == CPU_INDEX and call[-1] == "torch==2.13.0+cpu"


def test_where_the_index_is_unreachable_the_configuration_offers_a_cpu_build(tmp_path):
    # as on a machine whose pip configuration has a CPU wheel, and whose newest torch is a CUDA build
    code, output, installs = install(tmp_path, {"config": {"torch>=2.4": CUDA_BUILD, "torch==2.13.0": CPU_BUILD}})
    assert code == 0, output
    assert "torch 2.13.0+cpu from the pip configuration" in output
    (call,) = installs
    assert "--index-url" not in call and call[-1] == "torch==2.13.0+cpu"


def test_a_cuda_build_is_never_installed_without_a_gpu(tmp_path):
    code, output, installs = install(tmp_path, {"config": {"torch>=2.4": CUDA_BUILD, "torch==2.13.0": CUDA_BUILD}})
    assert code == 1 and installs == []
    assert "only a CUDA build (2.14.1), refused without a GPU" in output
    assert f"pip install torch --index-url {CPU_INDEX}" in output  # what to run
    assert "Traceback" not in output


def test_nothing_found_stops_with_what_to_run(tmp_path):
    code, output, installs = install(tmp_path, {})
    assert code == 1 and installs == []
    assert "torch>=2.4 from PyTorch's CPU wheel index: not found" in output
    assert f"pip install torch --index-url {CPU_INDEX}" in output


def test_with_a_gpu_the_configuration_gives_its_cuda_build(tmp_path):
    code, output, installs = install(tmp_path, {"config": {"torch>=2.4": CUDA_BUILD}}, gpu=True)
    assert code == 0, output
    (call,) = installs
    assert "--index-url" not in call and call[-1] == "torch==2.14.1"


def test_a_cuda_build_that_slipped_through_is_reported(tmp_path):
    # pip installed something other than what its dry run said: the check after installing catches it
    code, output, _ = install(tmp_path, {CPU_INDEX: {"torch>=2.4": {"torch": "2.13.0"}}}, installed_cuda="13.0")
    assert code == 1 and "is a CUDA 13.0 build on a machine without a GPU" in output


def test_an_installed_torch_is_kept(tmp_path):
    (tmp_path / "installed").write_text("2.13.0+cpu")
    code, output, installs = install(tmp_path, {})
    assert code == 0 and installs == [] and "already installed" in output


@pytest.mark.parametrize("module, command", [
    ("tqdm", ["bench", "--list"]), ("matplotlib", ["bench", "--list"]), ("transformers", ["train", "--steps", "1"]),
])
def test_a_missing_extra_is_one_line_naming_it(module, command):
    code = (f"import sys; sys.modules[{module!r}] = None\n"  # as if not installed
            f"from fastoptim import cli; cli.main({command!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f'fastoptim: needs {module}, from the bench extra: pip install "fastoptim[bench]"']
