"""Hand-written kernels below the model and attention layers (their torch formulas stay the reference)."""
