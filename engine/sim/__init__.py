"""The GPU regime without a GPU: accelerator and model descriptions, a timing model of
one engine step, a simulated executor for the real engine, and a virtual-clock
simulator of replicas. Nothing here imports torch."""
