"""vLLM-compatible metrics: histogram buckets and label values (the contract the operator
reads), the Prometheus exporter, per-request and speculative-decoding series."""
