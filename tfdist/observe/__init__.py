"""Observability: progress, logs and the run summary."""
