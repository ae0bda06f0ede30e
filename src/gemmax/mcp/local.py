"""The local deployment manager of this MCP server (one per state directory: it remembers the
processes this server started, to reap them)."""

from __future__ import annotations

import functools
from pathlib import Path

from gemmax.mcp.deployments import Deployments, state_dir


@functools.cache
def _manager(root: Path) -> Deployments:
    return Deployments(root)


def deployments() -> Deployments:
    return _manager(state_dir())
