"""What the autotuner reads from Prometheus: the PromQL (queries.py), the HTTP client and the
shape of its answers (client.py), one deployment's MetricsSnapshot (reader.py), one grouped read
for a resync pass (fleet.py), and the MetricsAvailable condition (condition.py)."""
