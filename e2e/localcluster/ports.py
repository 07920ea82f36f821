"""Free ports, chosen at run time so that several local clusters (say
`make cluster-up` and a test run) can coexist."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
