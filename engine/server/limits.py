"""How much of a client's request the server will read, and for how long. `kvpilot serve`
generates its flags from these fields; BodyGuard (body_guard.py), the h11 protocol in
runner.py and write_deadline.py enforce them. No fastapi here: the CLI parses flags before loading the server."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.engine import setting
from ..config.quantity import parse_bytes


@dataclass
class ServerLimits:
    max_request_body_bytes: int | str = setting(
        "8Mi", "largest request body (8Mi, 512k or bytes); a larger one gets 413, refused on its "
               "Content-Length before it is read, or as soon as a chunked body passes the limit")
    header_read_timeout: float = setting(
        10.0, "seconds a connection has to deliver a request's headers (from connecting, or "
              "from the previous response); then it is closed")
    body_read_timeout: float = setting(
        30.0, "seconds a request has to deliver its body once its headers are in; then 408")
    write_timeout: float = setting(
        30.0, "seconds a client may leave its response unread (the server's write buffer full) "
              "before it is dropped and its request aborted")

    def __post_init__(self) -> None:
        self.max_request_body_bytes = parse_bytes("max_request_body_bytes", self.max_request_body_bytes)
        for name in ("header_read_timeout", "body_read_timeout", "write_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {value!r}")
