"""The autotuner's loop in virtual time, one set of defaults for `autotune simulate` and
`autotune contest` (and what the contest's replica-only autoscalers are timed by)."""

SCRAPE_S = 15.0  # Prometheus scrape interval
INTERVAL_S = 15.0  # a decision every interval
WINDOW_S = 60.0  # the metrics window each decision reads
COOLDOWN_S = 60.0  # no change within this long after the last one
REPLICA_STARTUP_S = 60.0  # a new GPU pod: scheduled, started, weights loaded
