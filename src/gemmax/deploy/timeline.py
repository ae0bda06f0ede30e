"""The boot timeline: from the launch request to `/health` 200, each step stamped in the registry.

  requested   the launch was asked for (t = 0, the record's `created`)
  running     the instance (aws) or the process (ssh) runs
  reachable   the server's port accepts a TCP connection (through the SSH tunnel for ssh)
  healthy     GET /health answers 200; its `warmup` block gives the compile-cache hits and misses
              (hits and no misses: the restored cache saved the compilation)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from gemmax.deploy.registry import Registry

T = TypeVar("T")


def run_sync(coro: Awaitable[T]) -> T:
    """Run a coroutine to completion from synchronous code, in a thread of its own (the caller may
    itself be inside an event loop, as an MCP tool is)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _tcp_open(url: str) -> bool:
    parts = urlsplit(url)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port or 80), 3.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


def cache_figures(health: dict[str, Any]) -> dict[str, Any]:
    warmup = health.get("warmup") or {}
    return {k: warmup[k] for k in ("cache_hits", "cache_misses", "compile_seconds") if k in warmup}


async def wait_healthy(registry: Registry, name: str, base_url: str, timeout_s: float,
                       api_key: str | None = None, poll_s: float = 0.5) -> dict[str, Any]:
    """Poll until /health is 200 (recording `reachable` and `healthy` with the compile-cache figures);
    TimeoutError after `timeout_s` naming the last thing seen."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    last = "no TCP connection"
    reachable = False
    async with httpx.AsyncClient(timeout=5.0, headers=headers) as client:
        while time.monotonic() < deadline:
            if not reachable and await _tcp_open(base_url):
                reachable = True
                registry.event(name, "reachable")
            if reachable:
                try:
                    response = await client.get(f"{base_url}/health")
                    if response.status_code == 200:
                        health = response.json()
                        registry.event(name, "healthy", **cache_figures(health))
                        return health
                    last = f"/health answered HTTP {response.status_code}"
                except httpx.HTTPError as exc:
                    last = f"/health: {type(exc).__name__}"
            await asyncio.sleep(poll_s)
    raise TimeoutError(f"{base_url} not healthy after {timeout_s:.0f} s (last: {last})")


async def probe(base_url: str, api_key: str | None = None) -> tuple[int | None, dict[str, Any] | None]:
    """One GET /health: (status, JSON) or (None, None) when nothing answers."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=5.0, headers=headers) as client:
            response = await client.get(f"{base_url}/health")
    except httpx.HTTPError:
        return None, None
    try:
        body = response.json()
    except ValueError:
        body = None
    return response.status_code, body if isinstance(body, dict) else None
