"""``python -m fastoptim``: the ``fastoptim`` command."""
from fastoptim.cli import main

main()
