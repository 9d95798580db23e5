"""The ``fastoptim bench`` command: its arguments and its run. The harness is imported when the
command runs, after its extras are checked."""
import argparse

import torch

from fastoptim import extras
from fastoptim.measure import check_names, named, output_folder, positive

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
DEFAULT_OUT = "bench-out"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Give the ``bench`` subcommand's ``parser`` its arguments and :func:`run`.

    Args:
        parser: the subcommand's parser.
    """
    parser.description = ("With no arguments: a quick default (two models, every fastoptim engine, the installed "
                          "peers): about 1.5 minutes on 2 idle cores of an Intel Xeon (2026-11-28), several times "
                          "that on a busy machine, with a peak of 3.4 GiB of resident memory (measured 2026-11-25).")
    parser.add_argument("--models", nargs="+", help=f"model names (see --list); default: {' '.join(QUICK_MODELS)}, "
                                                    "or with --device cuda the FusedAdan benchmark's GPT-2 grid and "
                                                    "vision models")
    parser.add_argument("--optimizers", nargs="+", help="optimizer names (see --list); default: the peers, then "
                                                        "every fastoptim engine (with --device cuda: the FusedAdan "
                                                        "benchmark's peers and the fused engines)")
    parser.add_argument("--baseline", type=named,
                        help="the optimizer the ratios are to (default: the first, torch-adam-foreach)")
    parser.add_argument("--steps", type=positive,
                        help=f"timed steps per repeat (default 1, {GPU_STEPS} with --device cuda)")
    parser.add_argument("--repeats", type=positive, default=3,
                        help="interleaved repeats; the median is reported with the spread (default 3)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="of params and grads (default fp32)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    parser.add_argument("--threads", type=positive, default=torch.get_num_threads(),
                        help=f"torch threads (default {torch.get_num_threads()}, torch's choice here)")
    parser.add_argument("--out", type=output_folder,
                        help=f"folder for results.json, results.md and bench.png (default {DEFAULT_OUT}), "
                             "checked before anything is measured")
    parser.add_argument("--random-grads", action="store_true", help="random normal grads instead of one backward pass")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="show two runs side by side")
    parser.add_argument("--list", action="store_true", help="list model and optimizer names")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    """Run ``fastoptim bench`` with its parsed arguments.

    Args:
        args: the arguments :func:`add_arguments` declared, parsed.
    """
    extras.require("bench", "tqdm", "matplotlib", "transformers")
    from . import models, report, run as harness

    known = harness.optimizers()
    if args.list or args.compare:
        check_alone(args, "list" if args.list else "compare")
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
    args.steps = args.steps if args.steps is not None else (GPU_STEPS if gpu else 1)
    baseline = args.baseline or names[0]
    check_names("model", args.models, models.MODELS)
    check_names("optimizer", names, known)
    check_names("optimizer", [baseline], known)
    if baseline not in names:
        names.insert(0, baseline)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    settings = dict(device=args.device, dtype=args.dtype, threads=args.threads, steps=args.steps,
                    repeats=args.repeats, baseline=baseline, memory=not args.no_memory,
                    gradients="random" if args.random_grads else "backward")
    if args.out is None:  # the default, checked here: --list and --compare write nothing
        try:
            args.out = output_folder(DEFAULT_OUT)
        except argparse.ArgumentTypeError as error:
            raise SystemExit(f"the default --out {DEFAULT_OUT}: {error}") from None
    harness.main(args.models, names, settings, args.out)


def check_alone(args: argparse.Namespace, option: str) -> None:
    """Raise SystemExit naming the options set beside ``--list`` or ``--compare`` (``option``) to other than
    their defaults: those measure nothing and would ignore them.

    Args:
        args: the parsed arguments.
        option: "list" or "compare".
    """
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))  # none checks a folder: --out's default is checked where it is written
    given = [name for name, value in vars(args).items()
             if name != option and name in defaults and value != defaults[name]]
    if given:
        raise SystemExit(f"--{option} takes no other option: it measures nothing (given: "
                         + ", ".join("--" + name.replace("_", "-") for name in given) + ")")
