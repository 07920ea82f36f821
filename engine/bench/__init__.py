"""Benchmarks: `kvpilot bench throughput|serve|soak|...`, vLLM-style result blocks, and the
processes and peers they drive. A benchmark measures; tests assert behaviour elsewhere."""
