"""Constrained decoding: constraints, grammar compilation and per-row matchers (llguidance)."""
