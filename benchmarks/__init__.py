"""Benchmarks of tritonllm: the offline engine (`offline`), the served stack (`online`) and the
bandwidth bound both are measured against (`bandwidth`). Results go to BENCHMARKS.md."""
