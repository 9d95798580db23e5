"""The ``fastoptim`` command: ``info``, ``bench`` and ``train``."""
import argparse
import importlib.util

import torch

import fastoptim
from fastoptim import engines, extras
from fastoptim.kernels import fused_cpu
from fastoptim.train import loop as training


def info(_args):
    print(f"fastoptim {fastoptim.__version__}")
    gpu = "yes" if torch.cuda.is_available() else "no"
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}, GPU {gpu})")
    print(f"threads {torch.get_num_threads()}")
    print(f"engines {', '.join(engines.ENGINES)}")
    if fused_cpu.AVAILABLE:
        print(f"fused CPU kernel built, threads from {fused_cpu.openmp() or 'pthreads (torch has no OpenMP)'}")
    else:
        print("fused CPU kernel not built: fused=True falls back to foreach")
    print(f"triton {'installed' if importlib.util.find_spec('triton') else 'not installed'}")


QUICK_MODELS = ["gpt2-h12-l6-d768", "resnet50"]
# The 8-bit peers are GPU optimizers: on the CPU a step costs them 5-10x torch's foreach Adam, which
# alone would take the quick default past its 3 minutes; name them to run them. Our own 8-bit states
# join on the fused engine only: their loop and foreach engines are references, not contenders.
QUICK_FAMILIES = ["adan", "adamw", "adan-sn", "adamwsn"]
QUICK_EXTRAS = ["adan-8bit-fused-multi", "adamw-8bit-fused-multi"]
QUICK_PEERS = ["torch-adam-foreach", "torch-adam-fused", "torch-adamw-fused", "timm-adan", "po-adamwsn"]
# --device cuda: the FusedAdan benchmark's tables (its GPT-2 grid and vision models), 200 steps per repeat,
# against torch's Adam/AdamW, timm's Adan and a torch.compile'd Adan; fastoptim's fused engines run Triton.
GPU_PEERS = ["torch-adam-foreach", "torch-adam-fused", "torch-adamw-foreach", "torch-adamw-fused", "timm-adan",
             "adan-foreach-compiled"]
GPU_OURS = ["adan-foreach", "adan-fused-single", "adan-fused-multi", "adamw-fused-multi", "adan-sn-fused-multi",
            "adamwsn-fused-multi", "adan-8bit-fused-multi", "adamw-8bit-fused-multi"]
GPU_STEPS = 200


def bench(args):
    extras.require("bench", "tqdm", "matplotlib", "transformers")
    from .bench import models, report, run

    known = run.optimizers()
    if args.list:
        print("models:", " ".join(models.MODELS))
        print("optimizers:", " ".join(known))
        return
    if args.compare:
        print(report.compare(*args.compare))
        return
    gpu = args.device == "cuda"
    engines_of_fastoptim = [name for name, spec in known.items() if spec.family in QUICK_FAMILIES and not spec.compiled]
    quick = QUICK_PEERS + engines_of_fastoptim + QUICK_EXTRAS
    names = list(args.optimizers or (GPU_PEERS + GPU_OURS if gpu else quick))
    args.models = args.models or (models.SEED_MODELS if gpu else QUICK_MODELS)
    args.steps = args.steps or (GPU_STEPS if gpu else 1)
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


def train(args):
    extras.require("bench", "tqdm", "matplotlib", "transformers")
    # The options that define a run default to None here, so that the ones given can be told apart.
    given = {key: getattr(args, key) for key in training.DEFAULTS if getattr(args, key) is not None}
    if args.resume:
        if given or args.out:
            options = ", ".join("--" + key.replace("_", "-") for key in [*given, *(["out"] if args.out else [])])
            raise SystemExit(f"--resume continues the run in its folder with the settings it was started with; "
                             f"drop {options}")
        training.resume(args.resume, args.stop_after)
        return
    unknown = [name for name in given.get("optimizers", []) if name not in training.RECIPES]
    if unknown:
        raise SystemExit(f"unknown optimizer {', '.join(unknown)}; valid: {', '.join(training.RECIPES)}")
    training.main(training.DEFAULTS | given, args.out or "train-out", args.stop_after)


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fastoptim", description=fastoptim.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="version, torch, threads and available engines").set_defaults(func=info)
    b = commands.add_parser("bench", help="time and memory of optimizer steps on real model shapes, against peers",
                            description="With no arguments: a quick default (two models, every fastoptim engine, "
                                        "the installed peers) that took 12 minutes on 2 busy cores, with a peak of "
                                        "3.4 GiB of resident memory.")
    b.add_argument("--models", nargs="+", help=f"model names (see --list); default: {' '.join(QUICK_MODELS)}, or "
                                               "with --device cuda the FusedAdan benchmark's GPT-2 grid and vision "
                                               "models")
    b.add_argument("--optimizers", nargs="+", help="optimizer names (see --list); default: the peers, then "
                                                   "every fastoptim engine (with --device cuda: the FusedAdan "
                                                   "benchmark's peers and the fused engines)")
    b.add_argument("--baseline", help="the optimizer the ratios are to (default: the first, torch-adam-foreach)")
    b.add_argument("--steps", type=int, help=f"timed steps per repeat (default 1, {GPU_STEPS} with --device cuda)")
    b.add_argument("--repeats", type=positive, default=3,
                   help="interleaved repeats; the median is reported with the spread (default 3)")
    b.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="of params and grads (default fp32)")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    b.add_argument("--threads", type=positive, default=torch.get_num_threads(),
                   help=f"torch threads (default {torch.get_num_threads()}, torch's choice here)")
    b.add_argument("--out", default="bench-out", help="folder for results.json, results.md and bench.png")
    b.add_argument("--random-grads", action="store_true", help="random normal grads instead of one backward pass")
    b.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    b.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="show two runs side by side")
    b.add_argument("--list", action="store_true", help="list model and optimizer names")
    b.set_defaults(func=bench)
    defaults = training.DEFAULTS
    t = commands.add_parser("train", help="train a small GPT-2 on the standard library's sources with each optimizer",
                            description="Each optimizer trains the same GPT-2 from the same initial weights on the "
                                        "same batches of Python's standard-library sources: validation loss "
                                        "curves, optimizer time and state bytes. The default takes about 8 "
                                        "minutes on an idle 2-core machine.")
    t.add_argument("--optimizers", nargs="+", help=f"default: {' '.join(training.DEFAULT_RECIPES)} (adamw is torch's "
                                                   "AdamW, the others fastoptim's); also: " + ' '.join(
                                                       sorted(set(training.RECIPES) - set(training.DEFAULT_RECIPES)))
                                                   + " (a bf16 model); the first is the reference whose final "
                                                   "validation loss the others race to")
    t.add_argument("--steps", type=positive, help=f"training steps of each run (default {defaults['steps']})")
    t.add_argument("--lr-sweep", action="store_true", default=None,
                   help=f"a run per optimizer at each of {', '.join(f'{f:g}' for f in training.LR_SWEEP)} times its "
                        "recommended lr; the best is reported")
    t.add_argument("--model-size", choices=training.model.SIZES,
                   help=f"default {defaults['model_size']}; tiny for smoke tests")
    t.add_argument("--batch-size", type=positive, help=f"windows per step (default {defaults['batch_size']})")
    t.add_argument("--eval-every", type=positive, help=f"steps between validations (default {defaults['eval_every']})")
    t.add_argument("--checkpoint-every", type=positive,
                   help=f"steps between checkpoints (default {defaults['checkpoint_every']}; also at the end)")
    t.add_argument("--seed", type=int, help=f"of the initial weights and the batches (default {defaults['seed']})")
    t.add_argument("--threads", type=positive, help=f"torch threads (default {defaults['threads']})")
    t.add_argument("--out", help="folder for results.json, results.md, curves.png and checkpoints/ "
                                 "(default train-out)")
    t.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoints, bit-identically")
    t.add_argument("--stop-after", type=positive, metavar="STEP",
                   help="stop each run after this step, checkpointed; continue with --resume")
    t.set_defaults(func=train)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
