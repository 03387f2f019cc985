"""tickler's benchmark suite: ``python -m bench``."""
