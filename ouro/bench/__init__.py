"""Benchmarks: measured side by side in one process, medians, with the machine's roofline."""
