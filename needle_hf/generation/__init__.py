"""Decoding beyond the models' own `generate`: constrained tool-call decoding (grammar) and the
engine's sliding KV window."""
