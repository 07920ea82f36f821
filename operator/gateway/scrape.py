"""Each replica's load, read from its /metrics every `interval` seconds (all replicas
at once, each with a short timeout, so one slow pod delays nobody)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

from .replicas import Replica, parse_load

log = logging.getLogger("kvpilot.gateway")


async def scrape_once(client: httpx.AsyncClient, replica: Replica, timeout: float) -> None:
    try:
        resp = await client.get(f"{replica.url}/metrics", timeout=timeout)
        if resp.status_code == 200:
            replica.load = parse_load(resp.text, time.monotonic())
    except httpx.HTTPError as e:  # the pod may be starting or gone: keep its last load
        log.debug("scrape %s: %s", replica.url, e)


async def scrape_loop(client: httpx.AsyncClient, replicas: Callable[[], list[Replica]],
                      interval: float) -> None:
    while True:
        current = replicas()
        if current:
            await asyncio.gather(*(scrape_once(client, r, timeout=interval) for r in current))
        await asyncio.sleep(interval)
