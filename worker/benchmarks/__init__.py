"""Benchmarks that run a model in this process (they import torch): offline throughput
of pagedserve and the transformers `generate` baseline."""
