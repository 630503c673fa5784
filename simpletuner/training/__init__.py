"""The training loop and what it is built from."""
