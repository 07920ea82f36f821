"""The engine's core: requests, the scheduler (one token-count rule), the KV cache manager and
its block pool, the executor interface, output processing and detokenization. Nothing here
imports torch, the server or the fleet simulator."""
