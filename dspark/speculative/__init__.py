"""Speculative decoding: drafters, lossless verification, confidence-scheduled budgets (docs/scheduling.md)."""
