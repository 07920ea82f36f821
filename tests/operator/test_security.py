"""Item 7 of issue 15, the parts that need no cluster (docs/security.md lists every
part and its test): the API key is compared in constant time, and engine pods get no
service-account token."""
from __future__ import annotations

import asyncio
import hmac

from kvpilot.operator.manifests.deployment import build_deployment
from kvpilot.operator.manifests.objects import Owner
from kvpilot.operator.reconcile import parse_spec


def test_the_api_key_is_compared_with_hmac_compare_digest(monkeypatch):
    from kvpilot.engine.server import app as server_app

    seen, real = [], hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)
    monkeypatch.setattr(server_app.hmac, "compare_digest", spy)
    reached, sent = [], []

    async def inner(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    edge = server_app.EdgeMiddleware(inner, "s3cret")
    for token in (b"Bearer s3cret", b"Bearer s3cre", b""):
        scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", token)] if token else []}
        asyncio.run(edge(scope, None, send))
    assert seen == [(b"s3cret", b"s3cret"), (b"s3cre", b"s3cret"), (b"", b"s3cret")]
    assert reached == ["/v1/models"]  # only the right key got through
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [401, 401]


def test_engine_pods_mount_no_service_account_token():
    spec = parse_spec({"spec": {"model": {"source": "builtin:tiny"}}})
    pod = build_deployment(Owner("tiny", "demo", "u"), spec, 1)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert not any("serviceaccount" in m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", []))
