"""Optional dependencies: a command that needs one that is missing stops with one line naming the
extra that installs it, not a traceback."""
import importlib


def require(extra, *modules):
    """Import ``modules``; where one is missing, exit with the pip command that installs ``extra``."""
    missing = set()
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name not in modules:  # something else is broken: that traceback is the useful one
                raise
            missing.add(error.name)  # which may be another of the extra's (transformers imports tqdm)
    if missing:
        missing = [module for module in modules if module in missing]
        raise SystemExit(f"fastoptim: needs {' and '.join(missing)}, from the {extra} extra: "
                         f'pip install "fastoptim[{extra}]"')
