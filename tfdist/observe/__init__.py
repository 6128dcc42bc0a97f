"""Observability: hardware, FLOPs and peaks, progress lines, per-rank logs,
TensorBoard and the profiler, and the run summary."""
