"""``python -m fastoptim``: the ``fastoptim`` command."""
from fastoptim.cli import main

if __name__ == "__main__":  # not when a tool (the docs' API pages) imports every module of the package
    main()
