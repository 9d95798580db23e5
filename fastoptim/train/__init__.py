"""`fastoptim train`: the optimizers against each other on a real training run (see loop.py)."""
