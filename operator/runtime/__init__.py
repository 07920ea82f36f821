"""The operator's runtime: the apply layer (tolerant of 404/409), the cache of what was
applied, fault handling, the operator's own metrics and periodic resync."""
