"""High availability: leader election over a Lease, health endpoints, and the leader's run loop."""
