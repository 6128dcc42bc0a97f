"""The training loop and the small objects it composes."""
