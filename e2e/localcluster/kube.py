"""A very small Kubernetes REST client on httpx (raw JSON dicts, as in YAML),
used by the start-up health checks and the tests."""
from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx


class ApiError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Credentials:
    server: str
    ca: Path
    cert: Path
    key: Path

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx

    def to_json(self) -> dict[str, str]:
        return {"server": self.server, "ca": str(self.ca), "cert": str(self.cert), "key": str(self.key)}

    @classmethod
    def from_json(cls, d: dict[str, str]) -> "Credentials":
        return cls(d["server"], Path(d["ca"]), Path(d["cert"]), Path(d["key"]))


class Kube:
    def __init__(self, creds: Credentials, timeout: float = 30.0):
        self.creds = creds
        self.http = httpx.Client(base_url=creds.server, verify=creds.ssl_context(), timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, *, body: Any = None, params: dict | None = None,
                content_type: str = "application/json", ok404: bool = False) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        r = self.http.request(method, path, content=data, params=params, headers=headers)
        if r.status_code == 404 and ok404:
            return None
        if r.status_code >= 400:
            raise ApiError(r.status_code, r.text)
        return r.json() if r.content else None

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any, **kw: Any) -> Any:
        return self.request("POST", path, body=body, **kw)

    def delete(self, path: str, body: Any = None, **kw: Any) -> Any:
        return self.request("DELETE", path, body=body, **kw)

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body=body, content_type="application/merge-patch+json")

    def watch(self, path: str, params: dict | None = None, timeout_s: int = 300) -> Iterator[dict]:
        """Yields watch events ({type, object}) until the server ends the watch."""
        params = dict(params or {}, watch="1", allowWatchBookmarks="true",
                      timeoutSeconds=str(timeout_s))
        timeout = httpx.Timeout(10.0, read=timeout_s + 30)
        with self.http.stream("GET", path, params=params, timeout=timeout) as r:
            if r.status_code >= 400:
                r.read()
                raise ApiError(r.status_code, r.text)
            for line in r.iter_lines():
                if line.strip():
                    yield json.loads(line)


def pod_path(ns: str, name: str, sub: str = "") -> str:
    return f"/api/v1/namespaces/{ns}/pods/{name}" + (f"/{sub}" if sub else "")
