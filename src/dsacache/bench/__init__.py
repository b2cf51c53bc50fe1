"""GPU benchmarks with a correctness gate: ``python -m dsacache.bench --help``."""
