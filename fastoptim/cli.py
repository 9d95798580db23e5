"""The ``fastoptim`` command: ``info``, ``bench`` and ``train``. A subcommand's module (its arguments
and its run) is imported only when that subcommand is named."""
import argparse
import importlib
import importlib.util
import sys
import textwrap

import fastoptim

# name: (one line of help, the module holding its add_arguments and run; None: info, here)
COMMANDS = {"info": ("version, torch, threads and available engines", None),
            "bench": ("time and memory of optimizer steps on real model shapes, against peers",
                      "fastoptim.bench.command"),
            "train": ("train a small GPT-2 on the standard library's sources with each optimizer",
                      "fastoptim.train.command")}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, wrapped between words only: an optimizer's name (``adamw-bf16-m24-8bit``) stays whole."""

    def _split_lines(self, text, width):
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def info(_args: argparse.Namespace) -> None:
    """Print the versions, threads and engines this machine has."""
    import torch

    from fastoptim import engines
    from fastoptim.engines.backends import cpu as cpu_backend

    print(f"fastoptim {fastoptim.__version__}")
    gpu = "yes" if torch.cuda.is_available() else "no"
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}, GPU {gpu})")
    print(f"threads {torch.get_num_threads()}")
    print(f"engines {', '.join(engines.ENGINES)}")
    if cpu_backend.AVAILABLE:
        print(f"fused CPU kernel built, threads from {cpu_backend.openmp() or 'pthreads (torch has no OpenMP)'}")
    else:
        print("native library not loaded (the warning above says why): CPU steps take the foreach engine; build it "
              "with pip install --no-build-isolation . where torch and a C compiler are installed")
    print(f"triton {'installed' if importlib.util.find_spec('triton') else 'not installed'}")


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default: the command line) and run the subcommand it names.

    Args:
        argv: the arguments after ``fastoptim``.
    """
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="fastoptim", description=fastoptim.__doc__, formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    named = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, (help_line, module) in COMMANDS.items():
        command = commands.add_parser(name, help=help_line, formatter_class=HelpFormatter)
        if module is None:
            command.set_defaults(func=info)
        elif name == named:
            importlib.import_module(module).add_arguments(command)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
