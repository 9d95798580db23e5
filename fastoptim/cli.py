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


def bench(args):
    from .bench import run, shapes

    known = run.optimizers()
    if args.list:
        print("models:", " ".join(shapes.MODELS))
        print("optimizers:", " ".join(known))
        return
    for kind, names, valid in (("model", args.models, shapes.MODELS), ("optimizer", args.optimizers, known)):
        unknown = [name for name in names if name not in valid]
        if unknown:
            raise SystemExit(f"unknown {kind} {', '.join(unknown)}; valid: {', '.join(valid)}")
    run.main(args.models, args.optimizers, args.steps, args.repeats, args.threads, not args.no_memory)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fastoptim", description=fastoptim.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="version, torch, threads and available engines").set_defaults(func=info)
    b = commands.add_parser("bench", help="time and peak memory of optimizer steps")
    b.add_argument("--models", nargs="+", default=["gpt2-124m"])
    b.add_argument("--optimizers", nargs="+",
                   default=["torch-adamw-foreach", "torch-adamw-fused", "adamw-loop", "adamw-foreach",
                            "adamw-fused-single", "adamw-fused-multi", "adan-loop", "adan-foreach",
                            "adan-fused-single", "adan-fused-multi", "adamwsn-foreach", "adamwsn-fused-multi",
                            "adan-sn-foreach", "adan-sn-fused-multi"])
    b.add_argument("--steps", type=int, default=3)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--threads", type=int, default=torch.get_num_threads())
    b.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    b.add_argument("--list", action="store_true", help="list model and optimizer names")
    b.set_defaults(func=bench)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
