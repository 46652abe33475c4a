"""Bridges to transformers and accelerate; the core never imports these."""
