"""The DSpark drafter: a parallel block drafter with a low-rank Markov head and a confidence head."""
