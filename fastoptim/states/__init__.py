"""State representations beside the dense one: subset-norm second moments (``subset_norm``)."""
