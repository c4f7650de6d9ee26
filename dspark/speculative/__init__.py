"""Speculative decoding: drafters, lossless verification, confidence-scheduled budgets (issues 3 and 4)."""
