"""Benchmarks: ratios against peers measured in one run (``python -m attnkit.bench.<name>``)."""
