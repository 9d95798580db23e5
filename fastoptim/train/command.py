"""The ``fastoptim train`` command: its arguments and its run."""
import argparse

from fastoptim import extras
from fastoptim.measure import check_names, named, non_negative, output_folder, positive

from . import loop as training


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Give the ``train`` subcommand's ``parser`` its arguments and :func:`run`.

    Args:
        parser: the subcommand's parser.
    """
    defaults = training.DEFAULTS
    parser.description = ("Each optimizer trains the same GPT-2 from the same initial weights on the same batches of "
                          "Python's standard-library sources: validation loss curves, optimizer time and state bytes. "
                          "The default runs three learning rates per optimizer: about 24 minutes on an idle 2-core "
                          "machine, three times the 8 of one lr each (--no-lr-sweep).")
    others = " ".join(sorted(set(training.RECIPES) - set(training.DEFAULT_RECIPES)))
    parser.add_argument("--optimizers", nargs="+",
                        help=f"default: {' '.join(training.DEFAULT_RECIPES)} (adamw is torch's AdamW, the others "
                             f"fastoptim's); also: {others} (those named bf16 train the model in bf16); the first is the "
                             "reference whose final validation loss the others race to")
    parser.add_argument("--steps", type=positive, help=f"training steps of each run (default {defaults['steps']})")
    parser.add_argument("--lr-sweep", action=argparse.BooleanOptionalAction, default=None,
                        help=f"a run per optimizer at each of {', '.join(f'{f:g}' for f in training.LR_SWEEP)} times "
                             "its recommended lr, each reported at its best, with every lr's loss (default); "
                             "--no-lr-sweep: the recommended lr alone, in a third of the time")
    parser.add_argument("--model-size", choices=training.model.SIZES,
                        help=f"default {defaults['model_size']}; tiny for smoke tests")
    parser.add_argument("--batch-size", type=positive, help=f"windows per step (default {defaults['batch_size']})")
    parser.add_argument("--eval-every", type=positive,
                        help=f"steps between validations (default {defaults['eval_every']})")
    parser.add_argument("--checkpoint-every", type=positive,
                        help=f"steps between checkpoints (default {defaults['checkpoint_every']}; also at the end)")
    parser.add_argument("--seed", type=non_negative,
                        help=f"of the initial weights and the batches (default {defaults['seed']})")
    parser.add_argument("--threads", type=positive, help=f"torch threads (default {defaults['threads']})")
    parser.add_argument("--out", type=output_folder,
                        help="folder for results.json, results.md, curves.png and checkpoints/ (default train-out)")
    parser.add_argument("--resume", type=named, metavar="DIR",
                        help="continue the run in DIR from its checkpoints, bit-identically")
    parser.add_argument("--stop-after", type=positive, metavar="STEP",
                        help="stop each run after this step, checkpointed; continue with --resume")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    """Run ``fastoptim train`` with its parsed arguments.

    Args:
        args: the arguments :func:`add_arguments` declared, parsed.
    """
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
    check_names("optimizer", given.get("optimizers", []), training.RECIPES)
    training.main(training.DEFAULTS | given, args.out or "train-out", args.stop_after)
