"""The structure targets of issue 51 ("one step path"), measured on the current tree. Each number,
with the issue's target beside it in the table:

- **calls**: Python calls into fastoptim's files during one ``opt.step()``, counted by a
  ``sys.setprofile`` hook ('call' events whose code file is under ``fastoptim/``; comprehensions and
  generator expressions excluded; a generator's resumption counts, as the hook reports it), after
  3 warm-up steps, on 148 fp32 params of 16 elements with grads (the 8-bit row and its fp32 twin:
  148 params of 4,096 elements, since 8-bit states need 4,096+). Target: bound AdamW <= 35; Adan
  likewise; ``max_grad_norm`` <= 1.3x its plain twin; ``sn`` and ``state_bits=8`` <= 1.2x theirs;
  fp32+bf16 in one group <= 1.2x one dtype; fused Muon on 148 4x4 matrices <= 80.
- **files**: the distinct fastoptim files those calls are in. Target: <= 6 for bound AdamW.
- **is_compiling**: mentions of ``is_compiling`` in the package (``fastoptim/**/*.py`` but
  ``bench/`` and ``train/``), per file. Target: <= 3 in the whole package.
- **step machinery lines**: lines of the files in ``STEP_MACHINERY`` (printed). Target: <= 2,200.
  Lines are physical lines, comments and docstrings included: at 82d9f85 this gives 3,577 (machinery)
  and 5,826 (library) where the issue's table, counted some other way, says 3,133 and 5,632.
- **library lines**: lines of ``fastoptim/**/*.py`` but ``bench/``, ``train/``, ``kernels/`` and
  ``cli.py``. Target: <= 5,200, and no file of it over 450 lines (the largest are listed, flagged).
- **stores**: the caches a step keeps of pointer tables, plans or prepared calls, from the declared
  list ``STORES`` (each a name and the pattern that finds it in the source): a store whose pattern no
  longer matches is gone, so the count drops as they are removed (``_engine_caches``, a dict of five
  kinds of key, became ``PlanStore``, a class whose fields are declared). Target: <= 2 (one plan store
  per optimizer, plus the native registry's re-check).
- **engines -> optimizers**: imports of ``fastoptim.optimizers`` in ``fastoptim/engines/``, and the
  distinct calls, during the counted steps, made from a function of ``engines/`` to one of
  ``optimizers/`` (an algorithm's scalars, helpers or update function called back; the last is what a
  plan hands the foreach and loop engines). Target: 0 of each (no call from an engine back into an
  algorithm).

Usage, from the repository root: .venv/bin/python -m benchmarks.structure [--json]
"""
import argparse
import json
import re
import sys
import warnings
from pathlib import Path

import torch

import fastoptim

PACKAGE = Path(fastoptim.__file__).resolve().parent
COMPREHENSIONS = {"<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>"}
N_PARAMS, TINY, EIGHT_BIT_NUMEL = 148, 16, 4096

# (file or folder under fastoptim/) that make up the machinery between opt.step() and the kernel
STEP_MACHINERY = ("optimizers/base.py", "optimizers/step_path.py", "optimizers/state_creation.py", "step_cache.py",
                  "optimizers/step_counts.py",
                  "bound_step.py", "engines", "multi_tensor.py", "clip.py",
                  "optimizers/scalars.py", "optimizers/algorithm.py")
TOOLS = ("bench", "train", "kernels", "cli.py")  # left out of "the library without its tools"
MAX_FILE_LINES = 450

# The stores a step keeps, each found by a pattern over the package's source (bench/ and train/ aside):
# (name, file or None for any, regex). The target replaces them all by one plan store.
STORES = (
    ("optimizer._engine_caches (per optimizer, several key kinds)", None, r"\b_engine_caches\b"),
    ("optimizer._plans: step_cache.PlanStore (per optimizer: each group's work and its grads patterns', "
     "the bound step, the traced state, the write notes)", None, r"^class PlanStore\b"),
    ("GroupWork.bucket_caches (per group entry, per bucket)", None, r"\bbucket_caches\s*="),
    ("GroupWork.buckets (per bucket of a group's work: its BucketPlan, declared fields)", None,
     r"^class BucketPlan\b"),
    ("BoundStep / Structure (the bound step's plan)", "bound_step.py", r"^class (BoundStep|Structure)\b"),
    ("engines.step_op._PREPARED (prepared op calls by layout id)", None, r"^_PREPARED\s*="),
    ("engines.step_op._OP_CACHE (traced op calls)", None, r"^_OP_CACHE\s*="),
    ("engines.step_op._CALLS (the step ops' calls: prepared ones and the op's own, one rule)", None,
     r"^_CALLS\s*="),
    ("clip: _engine_caches['clip'] GradTables (an optimizer's clip tables)", None,
     r"""caches\.setdefault\(["']clip["']"""),
    ("clip._OP_TABLES (clip_grad_norm_'s and the traced clip's tables)", "clip.py", r"^_OP_TABLES\s*="),
    ("plan.cache['prepared'] (a plan's prepared tables)", None, r"""cache\[["']prepared["']\]\s*="""),
    ("native registry of bound tables (native.cpp)", "kernels/native.cpp", r"unordered_map<[^>]*Bound>"),
)


def _params(numel, n=N_PARAMS, dtypes=(torch.float32,), shape=None):
    params = [torch.nn.Parameter(torch.randn(*(shape or (numel,)), dtype=dtypes[i % len(dtypes)]))
              for i in range(n)]
    for param in params:
        param.grad = torch.randn_like(param)
    return params


def _adamwsn(params, sn):
    """AdamWSN over ``params`` (AdamW with the group option where there is no AdamWSN)."""
    if hasattr(fastoptim, "AdamWSN"):
        return fastoptim.AdamWSN([{"params": params, "sn": sn}], lr=1e-3)
    return fastoptim.AdamW(params, lr=1e-3, sn=sn)


# row name: (make the optimizer, the row whose calls it is compared with, the ratio allowed, or None)
CASES = {
    "AdamW": (lambda: fastoptim.AdamW(_params(TINY), lr=1e-3), None, None),
    "Adan": (lambda: fastoptim.Adan(_params(TINY), lr=1e-3), None, None),
    "AdamW max_grad_norm=1": (lambda: fastoptim.AdamW(_params(TINY), lr=1e-3, max_grad_norm=1.0), "AdamW", 1.3),
    # 4x4 params (16 elements): a 1-D param's subset-norm partition (subset_size=None) is dense
    "AdamWSN 4x4": (lambda: _adamwsn(_params(0, shape=(4, 4)), sn=False), None, None),
    "AdamWSN 4x4 sn=True": (lambda: _adamwsn(_params(0, shape=(4, 4)), sn=True), "AdamWSN 4x4", 1.2),
    "AdamW 4096-element params": (lambda: fastoptim.AdamW(_params(EIGHT_BIT_NUMEL), lr=1e-3), None, None),
    "AdamW state_bits=8 (4096)": (lambda: fastoptim.AdamW(_params(EIGHT_BIT_NUMEL), lr=1e-3, state_bits=8),
                                  "AdamW 4096-element params", 1.2),
    "AdamW fp32+bf16 one group": (lambda: fastoptim.AdamW(_params(TINY, dtypes=(torch.float32, torch.bfloat16)),
                                                          lr=1e-3), "AdamW", 1.2),
    "Muon fused, 148 4x4": (lambda: fastoptim.Muon(_params(0, shape=(4, 4)), lr=1e-3, fused=True), None, None),
}
CALL_TARGETS = {"AdamW": 35, "Adan": 35, "Muon fused, 148 4x4": 80}
FILE_TARGETS = {"AdamW": 6}


def count_calls(optimizer, warmup=3):
    """{"calls", "files", "file list", "engines -> optimizers calls"}: the Python calls into fastoptim's
    files during one ``optimizer.step()`` after ``warmup`` steps, comprehensions excluded; the files
    (relative to the package) they are in; and those calls made from a function of ``engines/`` to one
    of ``optimizers/`` (as "caller -> callee")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(warmup):
            optimizer.step()
        calls, files, back = 0, set(), []
        root = str(PACKAGE) + "/"

        def hook(frame, event, arg):
            nonlocal calls
            if event == "call":
                code = frame.f_code
                if code.co_filename.startswith(root) and code.co_name not in COMPREHENSIONS:
                    calls += 1
                    path = code.co_filename[len(root):]
                    files.add(path)
                    caller = frame.f_back.f_code if frame.f_back is not None else None
                    if (path.startswith("optimizers/") and caller is not None
                            and caller.co_filename.startswith(root + "engines/")):
                        back.append(f"{caller.co_filename[len(root):]}:{caller.co_name} -> {path}:{code.co_name}")

        sys.setprofile(hook)
        try:
            optimizer.step()
        finally:
            sys.setprofile(None)
    return {"calls": calls, "files": len(files), "file list": sorted(files),
            "engines -> optimizers calls": sorted(set(back))}


def _library_files():
    """fastoptim's Python files, bench/ and train/ aside, as paths relative to the package."""
    return sorted(path.relative_to(PACKAGE) for path in PACKAGE.rglob("*.py")
                  if path.relative_to(PACKAGE).parts[0] not in ("bench", "train"))


def _lines(relative):
    return len((PACKAGE / relative).read_text().splitlines())


def is_compiling_mentions():
    """{file: mentions of ``is_compiling``} in the package, bench/ and train/ aside."""
    found = {str(path): (PACKAGE / path).read_text().count("is_compiling") for path in _library_files()}
    return {path: n for path, n in found.items() if n}


def line_counts():
    """{"step machinery": {file: lines}, "library": {file: lines}} (see the module's docstring)."""
    machinery = {}
    for entry in STEP_MACHINERY:
        target = PACKAGE / entry
        paths = sorted(target.rglob("*.py")) if target.is_dir() else [target]
        machinery.update({str(p.relative_to(PACKAGE)): _lines(p.relative_to(PACKAGE)) for p in paths if p.exists()})
    library = {str(p): _lines(p) for p in _library_files() if p.parts[0] not in TOOLS}
    return {"step machinery": machinery, "library": library}


def stores():
    """{store name: [file:line where its pattern matched]} for the stores of ``STORES`` still found."""
    sources = [path for path in _library_files()] + [Path("kernels/native.cpp")]
    found = {}
    for name, where, pattern in STORES:
        regex = re.compile(pattern, re.MULTILINE)
        for path in sources:
            if where is not None and str(path) != where or not (PACKAGE / path).exists():
                continue
            text = (PACKAGE / path).read_text()
            for match in regex.finditer(text):
                found.setdefault(name, []).append(f"{path}:{text.count(chr(10), 0, match.start()) + 1}")
    return found


def engine_to_optimizer_imports():
    """Imports of fastoptim.optimizers in fastoptim/engines/ (file:line: the statement)."""
    pattern = re.compile(r"^\s*(from\s+(\.\.+optimizers|fastoptim\.optimizers)\b.*|import\s+fastoptim\.optimizers\b.*"
                         r"|from\s+\.\.+\s+import\s+.*\boptimizers\b.*|from\s+fastoptim\s+import\s+.*\boptimizers\b.*)$",
                         re.MULTILINE)
    found = []
    for path in sorted((PACKAGE / "engines").rglob("*.py")):
        text = path.read_text()
        for match in pattern.finditer(text):
            found.append(f"{path.relative_to(PACKAGE)}:{text.count(chr(10), 0, match.start()) + 1}: "
                         f"{match.group(0).strip()}")
    return found


def measure(cases=None):
    """Every number of the module's docstring, as one dict."""
    torch.manual_seed(0)
    calls = {}
    for name in cases or CASES:
        make, _, _ = CASES[name]
        calls[name] = count_calls(make())
    lines = line_counts()
    return {"torch": torch.__version__, "calls": calls, "is_compiling": is_compiling_mentions(), "lines": lines,
            "stores": stores(),
            "engines -> optimizers imports": engine_to_optimizer_imports()}


def report(result):
    out = ["## Python calls per step (sys.setprofile, 3 warm-up steps, 148 params)", "",
           "| case | calls | files | vs | ratio | target |", "|---|---|---|---|---|---|"]
    for name, row in result["calls"].items():
        _, twin, allowed = CASES[name]
        ratio = f"{row['calls'] / result['calls'][twin]['calls']:.2f}" if twin in result["calls"] else ""
        target = []
        if name in CALL_TARGETS:
            target.append(f"<= {CALL_TARGETS[name]} calls")
        if name in FILE_TARGETS:
            target.append(f"<= {FILE_TARGETS[name]} files")
        if allowed:
            target.append(f"<= {allowed}x {twin}")
        out.append(f"| {name} | {row['calls']} | {row['files']} | {twin or ''} | {ratio} | {'; '.join(target)} |")
    if "AdamW" in result["calls"]:
        out += ["", "bound AdamW's files: " + ", ".join(result["calls"]["AdamW"]["file list"])]
    mentions = result["is_compiling"]
    out += ["", f"## is_compiling mentions: {sum(mentions.values())} in {len(mentions)} files (target <= 3)", ""]
    out += [f"- {path}: {n}" for path, n in sorted(mentions.items(), key=lambda item: -item[1])]
    machinery, library = result["lines"]["step machinery"], result["lines"]["library"]
    out += ["", f"## Lines: step machinery {sum(machinery.values())} (target <= 2200), "
                f"library without its tools {sum(library.values())} (target <= 5200)", "",
            "step machinery: " + ", ".join(f"{path} {n}" for path, n in machinery.items()), "",
            f"largest library files (> {MAX_FILE_LINES} flagged):"]
    for path, n in sorted(library.items(), key=lambda item: -item[1])[:8]:
        out.append(f"- {path}: {n}{'  **over ' + str(MAX_FILE_LINES) + '**' if n > MAX_FILE_LINES else ''}")
    found = result["stores"]
    out += ["", f"## Stores: {len(found)} found of {len(STORES)} declared (target <= 2)", ""]
    out += [f"- {name}: {', '.join(where)}" for name, where in found.items()]
    imports = result["engines -> optimizers imports"]
    out += ["", f"## engines -> optimizers imports: {len(imports)} (target 0)", ""] + [f"- {line}" for line in imports]
    back = sorted({call for row in result["calls"].values() for call in row["engines -> optimizers calls"]})
    out += ["", f"## engines -> optimizers calls during the counted steps: {len(back)} distinct (target 0)", ""]
    out += [f"- {call}" for call in back]
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON instead of tables")
    args = parser.parse_args(argv)
    result = measure()
    print(json.dumps(result, indent=1) if args.json else report(result))


if __name__ == "__main__":
    main()
