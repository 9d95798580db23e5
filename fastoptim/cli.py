"""The ``fastoptim`` command: ``info`` and ``bench``."""
import argparse
import importlib.util

import torch

import fastoptim
from fastoptim import engines
from fastoptim.kernels import fused_cpu


def info(_args):
    print(f"fastoptim {fastoptim.__version__}")
    gpu = "yes" if torch.cuda.is_available() else "no"
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}, GPU {gpu})")
    print(f"threads {torch.get_num_threads()}")
    print(f"engines {', '.join(engines.ENGINES)}")
    if fused_cpu.AVAILABLE:
        print(f"fused CPU kernel built, threads from {fused_cpu.LIBRARY.openmp or 'pthreads (torch has no OpenMP)'}")
    else:
        print("fused CPU kernel not built: fused=True falls back to foreach")
    print(f"triton {'installed' if importlib.util.find_spec('triton') else 'not installed'}")


QUICK_MODELS = ["gpt2-h12-l6-d768", "resnet50"]
# The 8-bit peers are GPU optimizers: on the CPU a step costs them 5-10x torch's foreach Adam, which
# alone would take the quick default past its 3 minutes; name them to run them.
# 8-bit states run on foreach until their fused kernel lands: too slow for the quick default's budget
QUICK_FAMILIES = ["adan", "adamw", "adan-sn", "adamwsn"]
QUICK_PEERS = ["torch-adam-foreach", "torch-adam-fused", "torch-adamw-fused", "timm-adan", "po-adamwsn"]


def bench(args):
    from .bench import models, report, run

    known = run.optimizers()
    if args.list:
        print("models:", " ".join(models.MODELS))
        print("optimizers:", " ".join(known))
        return
    if args.compare:
        print(report.compare(*args.compare))
        return
    engines_of_fastoptim = [name for name, spec in known.items() if spec.family in QUICK_FAMILIES and not spec.compiled]
    names = list(args.optimizers or QUICK_PEERS + engines_of_fastoptim)
    baseline = args.baseline or names[0]
    for kind, chosen, valid in (("model", args.models, models.MODELS), ("optimizer", [*names, baseline], known)):
        unknown = list(dict.fromkeys(name for name in chosen if name not in valid))
        if unknown:
            raise SystemExit(f"unknown {kind} {', '.join(unknown)}; valid: {', '.join(valid)}")
    if baseline not in names:
        names.insert(0, baseline)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    settings = dict(device=args.device, dtype=args.dtype, threads=args.threads, steps=args.steps,
                    repeats=args.repeats, baseline=baseline, memory=not args.no_memory,
                    gradients="random" if args.random_grads else "backward")
    run.main(args.models, names, settings, args.out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fastoptim", description=fastoptim.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="version, torch, threads and available engines").set_defaults(func=info)
    b = commands.add_parser("bench", help="time and memory of optimizer steps on real model shapes, against peers",
                            description="With no arguments: a quick default (two models, every fastoptim engine, "
                                        "the installed peers) that takes a few minutes on 2 cores.")
    b.add_argument("--models", nargs="+", default=QUICK_MODELS, help="model names (see --list)")
    b.add_argument("--optimizers", nargs="+", help="optimizer names (see --list); default: the peers, then "
                                                   "every fastoptim engine")
    b.add_argument("--baseline", help="the optimizer the ratios are to (default: the first, torch-adam-foreach)")
    b.add_argument("--steps", type=int, default=1, help="timed steps per repeat")
    b.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median is reported")
    b.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="params and grads")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    b.add_argument("--threads", type=int, default=torch.get_num_threads())
    b.add_argument("--out", default="bench-out", help="folder for results.json, results.md and bench.png")
    b.add_argument("--random-grads", action="store_true", help="random normal grads instead of one backward pass")
    b.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    b.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="show two runs side by side")
    b.add_argument("--list", action="store_true", help="list model and optimizer names")
    b.set_defaults(func=bench)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
