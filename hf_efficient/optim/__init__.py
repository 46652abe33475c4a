"""Optimizers this package implements itself, one module per family."""
