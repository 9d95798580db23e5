"""Optional dependencies: a command that needs one that is missing stops with one line naming the
extra that installs it, not a traceback; and their imports' noise is kept off the output."""
import contextlib
import importlib
import os
import sys
import warnings


@contextlib.contextmanager
def output_discarded():
    """Everything written to this process's stdout and stderr (file descriptors 1 and 2, so also by
    C code and by loggers holding the streams), and every warning, is dropped inside."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(os.devnull, "w") as devnull, warnings.catch_warnings(), contextlib.redirect_stdout(devnull), \
                contextlib.redirect_stderr(devnull):
            warnings.simplefilter("ignore")
            os.dup2(devnull.fileno(), 1)
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def quiet_import(module):
    """``module``, imported with its import's noise kept off the output: torchao (which transformers
    imports too, where it is installed) prints that it cannot load its CUDA libraries, and torch logs
    deprecation warnings for its pytree registrations; neither is a fault here. An import that fails
    still raises."""
    if sys.modules.get(module) is None:  # not imported yet (None: blocked, and the import says so)
        with output_discarded():
            importlib.import_module(module)
    return sys.modules[module]


def require(extra, *modules):
    """Import ``modules``; where one is missing, exit with the pip command that installs ``extra``."""
    missing = set()
    for module in modules:
        try:
            quiet_import(module)
        except ModuleNotFoundError as error:
            if error.name not in modules:  # something else is broken: that traceback is the useful one
                raise
            missing.add(error.name)  # which may be another of the extra's (transformers imports tqdm)
    if missing:
        missing = [module for module in modules if module in missing]
        raise SystemExit(f"fastoptim: needs {' and '.join(missing)}, from the {extra} extra: "
                         f'pip install "fastoptim[{extra}]"')
