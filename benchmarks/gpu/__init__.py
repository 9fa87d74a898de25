"""Benchmarks run on a GPU machine (``python -m benchmarks.gpu.probe``, ``python -m benchmarks.gpu.run_papers``)."""
