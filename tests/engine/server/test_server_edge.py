"""The server's side of the engine's one request edge: the engine's add_request checks a
request and resolves max_tokens once; the server only maps its refusal to a 400 naming
the field the client sent (chat's max_completion_tokens) and counts length refusals."""

from __future__ import annotations

import httpx
import pytest

from server_harness import SHARED_API_KEY, SHARED_MODEL, envelope, shared_server


@pytest.fixture(scope="module", params=["real", "simulated"])
def server(request):
    return shared_server(request.param)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [20] * 2000, "max_tokens": 100}, "max_tokens"),
    ("/v1/completions", {"prompt": [20] * 2100, "max_tokens": None}, "prompt"),
    ("/v1/completions", {"prompt": [20, 99999]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 5000}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 5000}, "max_tokens"),
])
def test_a_refusal_at_the_engine_edge_names_the_field_the_client_sent(server, path, body, param):
    r = httpx.post(server.url + path, json={"model": SHARED_MODEL, **body},
                   headers={"Authorization": f"Bearer {SHARED_API_KEY}"}, timeout=30)
    assert envelope(r, 400)["param"] == param

