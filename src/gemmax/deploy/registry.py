"""The registry of remote deployments: one JSON file under the state directory.

Every remote resource is written here before anything else happens to it (an EC2 instance id is
recorded the moment `RunInstances` answers, before the boot is waited for), so a crash, a restarted
MCP server or a second process still sees it and can terminate it. Ended deployments stay (their
instance-hours count against the guard rails and `cost` reports them); a new launch of the same name
moves the ended record to the key NAME@CREATED (`archived_key`), where it still counts.
Writes go through `records.RecordFile` (a lock, an atomic replace, owner-only: it holds API keys).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from gemmax.deploy.errors import DeployError
from gemmax.deploy.records import RecordFile, state_dir

Target = Literal["ssh", "aws"]
State = Literal["launching", "booting", "ready", "failed", "stopped", "terminated"]
ENDED = ("failed", "stopped", "terminated")
NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,62}")  # also a directory on an ssh host and an EC2 tag value


class Attempt(BaseModel):
    """One RunInstances call: where, which market, and how it ended."""

    zone: str
    market: Literal["spot", "on-demand"]
    ok: bool
    error_code: str | None = None
    message: str | None = None
    seconds: float


class SshHost(BaseModel):
    host: str
    port: int = 22
    username: str | None = None
    client_key: str | None = Field(None, description="private key file; default: the SSH agent and ~/.ssh keys")
    known_hosts: str | None = Field(None, description="known_hosts file; default ~/.ssh/known_hosts")
    remote_dir: str = Field(description="the deployment's directory on the host: pid file and log")
    gemmax: str = Field(description="the gemmax command on the host")
    compile_cache: str | None = Field(None, description="the server's GEMMAX_COMPILE_CACHE, for cache push / restore")


class AwsInstance(BaseModel):
    region: str
    instance_type: str
    market: Literal["spot", "on-demand"]
    zone: str | None = None
    instance_id: str | None = None
    image_id: str
    attempts: list[Attempt] = []
    price_per_hour: float | None = Field(None, description="USD: on-demand list price, or the zone's spot price at launch")
    price_source: str | None = None


class RemoteDeployment(BaseModel):
    name: str
    target: Target
    state: State
    model: str
    port: int
    base_url: str | None = Field(None, description="where /health and the API answer (for ssh: on the host)")
    cache_url: str | None = Field(None, description="the compile cache tarball (s3://...) restored at boot, pushed at teardown")
    created: float = Field(description="epoch seconds: the launch was requested")
    ended: float | None = None
    planned_hours: float = Field(1.0, description="instance-hours this deployment was allowed at launch")
    timeline: dict[str, Any] = Field(default_factory=dict, description="boot events: seconds after `requested`, and compile-cache hits / misses")
    error: str | None = None
    archived_as: str | None = Field(None, description="the registry key an ended record moved to when its name was launched again")
    ssh: SshHost | None = None
    aws: AwsInstance | None = None
    api_key: str | None = Field(None, exclude=True, repr=False, description="the server's API key: kept on disk, never returned")

    @property
    def active(self) -> bool:
        return self.state not in ENDED

    def hours(self, now: float | None = None) -> float:
        """Instance-hours so far (from the launch request to the end, or to now)."""
        end = self.ended if self.ended is not None else (now or time.time())
        return max(end - self.created, 0.0) / 3600.0


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise DeployError(f"deployment name {name!r}: start with a letter or digit, then letters, digits, "
                          "'.', '_' or '-' (at most 63)")


def archived_key(record: RemoteDeployment) -> str:
    """Where an ended record is kept once its name is launched again: NAME@CREATED (epoch seconds)."""
    return f"{record.name}@{record.created:.0f}"


class Registry:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else state_dir()
        self.file = self.root / "remote.json"
        self._records = RecordFile(self.file, RemoteDeployment, private=True,
                                   dump=lambda r: r.model_dump() | {"api_key": r.api_key})

    def records(self) -> list[RemoteDeployment]:
        return sorted(self._records.read().values(), key=lambda r: r.created)

    def get(self, name: str) -> RemoteDeployment:
        records = self._records.read()
        if name not in records:
            raise DeployError(f"no remote deployment named {name!r} (known: {', '.join(sorted(records)) or 'none'})")
        return records[name]

    def add(self, record: RemoteDeployment, guard: Callable[[list[RemoteDeployment]], None] | None = None) -> None:
        """Record a new deployment; `guard` sees every record under the lock first and may refuse (the
        caps are checked here, so two launches at once cannot both pass them)."""
        check_name(record.name)
        with self._records.locked() as records:
            if guard is not None:
                guard(list(records.values()))
            if (name_taken := records.get(record.name)) and name_taken.active:
                raise DeployError(f"deployment {record.name!r} exists and is {name_taken.state}: "
                                  "terminate it first or pick another name")
            if name_taken is not None:  # ended: kept under NAME@CREATED, its hours still counted
                key, n = archived_key(name_taken), 1
                while key in records:  # two ended launches within a second
                    n += 1
                    key = f"{archived_key(name_taken)}-{n}"
                records[key] = name_taken.model_copy(update={"archived_as": key})
            records[record.name] = record

    def update(self, name: str, if_created: float | None = None, **changes: Any) -> RemoteDeployment:
        """Change a record. An ended record stays ended: its `state` and `ended` are not changed again
        (a launch still waiting for its boot when another process terminated it must not mark it
        ready, nor move its end). `if_created`: change it only if NAME still holds the launch of that
        time (else the record NAME holds now is returned unchanged)."""
        with self._records.locked() as records:
            if name not in records:
                raise DeployError(f"no remote deployment named {name!r}")
            if if_created is not None and records[name].created != if_created:
                return records[name]
            if not records[name].active:
                changes = {key: value for key, value in changes.items() if key not in ("state", "ended")}
            record = records[name].model_copy(update=changes)
            records[name] = record
        return record

    def event(self, name: str, event: str, **extra: Any) -> RemoteDeployment:
        """Record a boot event at now, in seconds after the launch request."""
        with self._records.locked() as records:
            record = records[name]
            record.timeline.setdefault(event, round(time.time() - record.created, 3))
            record.timeline.update(extra)
            records[name] = record
        return record
