"""The process-backed node (a stand-in kubelet that runs pods as local processes)."""
