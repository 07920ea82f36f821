"""`kvpilot gateway`: one OpenAI endpoint in front of many LLMDeployments, routing each
request by its `model` to that deployment's ready pods (prefix- and load-aware), with
tenants, rate limits and a priority queue. Pure parts (hashing, picking, limits) have no
I/O; discovery (the Kubernetes API) and load scraping (each pod's /metrics) feed them."""
