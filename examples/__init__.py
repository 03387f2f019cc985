"""Example services built on tickler."""
