"""Managed deployments: rig processes started in the background, remembered on disk.

A deployment is one rig (`gemmax.rigs.registry`: gemmax, transformers, vllm) serving one model on
one port, started from the rig's own command line as a detached process (its own session and
process group, stdin closed, stdout and stderr appended to a log file), so it outlives the MCP
server that started it. Each start is recorded in `deployments.json` under the state directory
(`platformdirs.user_state_dir("gemmax")`, or `$GEMMAX_STATE_DIR`): name, rig, model, host, port,
pid and the process's start time (a recycled pid is not mistaken for the deployment), the command
line, the log path and the start time. Any process reading that file (a restarted MCP server, a
second one) sees, inspects and stops the same deployments. Writes go through
`gemmax.deploy.records.RecordFile` (a lock, an atomic replace), so readers never see half a file.

State of a deployment, from the process first and HTTP second:
  dead         the process is gone (or is a zombie, or its pid now belongs to another process)
  ready        alive and `GET /health` answers 200
  loading      alive and `/health` answers another status (gemmax: 503 while it loads and warms up)
  unreachable  alive and nothing answers HTTP on its port yet

Stopping sends SIGTERM to the rig process (gemmax drains in-flight requests, then exits), waits,
then SIGKILLs whatever is left of it and of the children it had spawned (vLLM's engine workers).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import ipaddress
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil
from pydantic import BaseModel, Field

from gemmax.deploy.records import RecordFile, state_dir
from gemmax.rigs.registry import RigOptions, get_rig, wait_healthy

# gemmax.weights.checkpoint.HUB_ID, restated: importing the checkpoint layer would pull JAX into the MCP process.
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")

State = Literal["ready", "loading", "unreachable", "dead"]
NAME = re.compile(r"[\w.-]{1,100}")  # also the log file's name
LOG_TAIL_ON_ERROR = 40


class DeploymentError(Exception):
    """An anticipated failure (bad argument, busy port, a rig that died at start): the message says
    what happened and, where there is one, carries the tail of the rig's log."""


class DeploymentRecord(BaseModel):
    """What the registry keeps about one deployment."""

    name: str
    rig: str
    model: str
    host: str
    port: int
    pid: int
    process_started: float = Field(description="the process's start time (epoch seconds), tells a recycled pid apart")
    command: list[str]
    log: str
    started_at: str = Field(description="ISO 8601, UTC")
    options: dict[str, Any] = Field(description="dtype, max_model_len, max_batch as given (null: the rig's default)")

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


class DeploymentStatus(BaseModel):
    """A deployment's record with its live state and what its /health reports."""

    deployment: DeploymentRecord
    base_url: str
    state: State
    uptime_s: float = Field(description="seconds since the start")
    exit_code: int | None = Field(None, description="when dead and the exit status is known (this process started it)")
    health_status: int | None = Field(None, description="HTTP status of GET /health; null when nothing answered")
    health: dict[str, Any] | None = Field(None, description="the /health JSON as served")
    policy: dict[str, Any] | None = Field(None, description="device policy: platform, device kind, compute capability, memory, dtypes")
    precision: dict[str, Any] | None = Field(None, description="dtypes actually in use (weights, activations, KV cache)")
    weight_bytes: int | None = None
    version: str | None = None
    build: str | None = None


class StopResult(BaseModel):
    name: str
    state_before: State
    how: Literal["sigterm", "sigkill", "already dead"]
    exit_code: int | None = Field(None, description="known when this process started the deployment")
    seconds: float
    log: str = Field(description="the log file, kept after the stop")


def _now() -> tuple[float, str]:
    t = time.time()
    return t, datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")


def _tail(path: str | Path, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in collections.deque(f, maxlen=lines)]
    except FileNotFoundError:
        return []


KEYED_RIGS = ("gemmax", "vllm")  # rigs that read an API key from their environment


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _rig_env(api_key: str | None) -> dict[str, str]:
    """The rig's environment: ours, unbuffered output, and the API key (never an inherited one)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GEMMAX_API_KEY", "VLLM_API_KEY")}
    env["PYTHONUNBUFFERED"] = "1"
    if api_key:
        env["GEMMAX_API_KEY"] = env["VLLM_API_KEY"] = api_key
    return env


def _port_free(host: str, port: int) -> bool:
    """Whether a server could bind host:port now (SO_REUSEADDR as uvicorn binds: a port lingering in
    TIME_WAIT is free, one somebody listens on is not)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def check_model(model: str) -> str:
    """An existing local path (made absolute, so the record does not depend on a working directory)
    or a hub id (owner/name, resolved by the rig itself); anything else is refused here rather than
    after a rig has been started on it."""
    path = Path(model).expanduser()
    if path.exists():
        return str(path.resolve())
    if model.startswith(("/", ".", "~")) or path.suffix == ".gguf" or not HUB_ID.fullmatch(model):
        raise DeploymentError(f"model {model!r} not found: no such file or directory, and not a hub id (owner/name)")
    return model


def _wait_exited(procs: list[psutil.Process], timeout_s: float) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(exited, still running) after up to `timeout_s`. psutil reaps children of this process and
    sets their `returncode`; a zombie whose parent is another process has exited too, though only
    that parent can collect its status."""
    deadline = time.monotonic() + timeout_s
    exited: list[psutil.Process] = []
    alive = list(procs)
    while alive:
        gone, alive = psutil.wait_procs(alive, timeout=min(0.25, max(deadline - time.monotonic(), 0.0)))
        exited += gone
        zombies = [p for p in alive if _is_zombie(p)]
        # one that exited after the wait timed out: a child of ours is reaped now, keeping its status;
        # another's zombie only that parent can reap
        reaped, others = psutil.wait_procs(zombies, timeout=0)
        exited += reaped + others
        alive = [p for p in alive if p not in zombies]
        if time.monotonic() >= deadline:
            break
    return exited, alive


def _is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Deployments:
    """The registry file plus process control. Safe to use from several threads and processes."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else state_dir()
        self.file = self.root / "deployments.json"
        self._records = RecordFile(self.file, DeploymentRecord)
        self.logs = self.root / "logs"
        self._children: dict[int, subprocess.Popen] = {}  # pid -> Popen for processes started here
        self._keys: dict[str, str] = {}  # name -> the API key a deployment started here was given (never on disk)
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- registry file

    def records(self) -> list[DeploymentRecord]:
        records = self._records.read()
        with self._lock:  # forget (and reap) exited children whose record another server removed
            for pid, child in list(self._children.items()):
                if child.poll() is not None and all(r.pid != pid for r in records.values()):
                    del self._children[pid]
        return sorted(records.values(), key=lambda r: r.started_at)

    def get(self, name: str) -> DeploymentRecord:
        records = self._records.read()
        if name not in records:
            known = ", ".join(sorted(records)) or "none"
            raise DeploymentError(f"no deployment named {name!r} (known: {known})")
        return records[name]

    # ---------------------------------------------------------------- processes

    def _process(self, record: DeploymentRecord) -> psutil.Process | None:
        """The live process of `record`, or None when it is gone, a zombie or a recycled pid."""
        with self._lock:
            child = self._children.get(record.pid)
        if child is not None and child.poll() is not None:  # reaps our own exited child
            return None
        try:
            proc = psutil.Process(record.pid)
            if abs(proc.create_time() - record.process_started) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.NoSuchProcess:
            return None

    def _exit_code(self, record: DeploymentRecord) -> int | None:
        with self._lock:
            child = self._children.get(record.pid)
        return child.poll() if child is not None else None

    def status(self, name: str) -> DeploymentStatus:
        return self._status(self.get(name))

    def statuses(self) -> list[DeploymentStatus]:
        return [self._status(r) for r in self.records()]

    def _status(self, record: DeploymentRecord) -> DeploymentStatus:
        started = datetime.datetime.fromisoformat(record.started_at).timestamp()
        base = {"deployment": record, "base_url": record.base_url, "uptime_s": round(time.time() - started, 1)}
        if self._process(record) is None:
            return DeploymentStatus(**base, state="dead", exit_code=self._exit_code(record))
        try:
            response = httpx.get(f"{record.base_url}/health", timeout=5.0)
        except httpx.HTTPError:
            return DeploymentStatus(**base, state="unreachable")
        try:
            health = response.json()
        except ValueError:
            health = None
        health = health if isinstance(health, dict) else None
        info = health or {}
        return DeploymentStatus(
            **base, state="ready" if response.status_code == 200 else "loading",
            health_status=response.status_code, health=health, policy=info.get("policy"),
            precision=info.get("precision"), weight_bytes=info.get("weight_bytes"),
            version=info.get("version"), build=info.get("build"))

    def start(self, rig: str, model: str, port: int, host: str = "127.0.0.1", dtype: str | None = None,
              max_model_len: int | None = None, max_batch: int | None = None, name: str | None = None,
              wait: bool = True, timeout_s: float = 600.0, api_key: str | None = None) -> DeploymentStatus:
        """Start `rig` on `model` at host:port from the rig's command line; with `wait`, return once
        `/health` answers 200 (a rig that exits or stays unhealthy past `timeout_s` is stopped and
        reported with its log tail)."""
        try:
            spec = get_rig(rig)
        except ValueError as exc:
            raise DeploymentError(str(exc)) from None
        if not _loopback(host):
            if not api_key:
                raise DeploymentError(f"host {host!r} is not loopback: a deployment reachable from other machines "
                                      "needs an API key (options.api_key), or bind 127.0.0.1")
            if rig not in KEYED_RIGS:
                raise DeploymentError(f"rig {rig!r} cannot be given an API key here: it binds loopback only")
        options = RigOptions(model=check_model(model), port=port, host=host, dtype=dtype,
                             max_model_len=max_model_len, max_batch=max_batch)
        if not spec.available():
            raise DeploymentError(f"rig {rig!r} cannot run here (its runtime is not installed); "
                                  f"its command would be: {' '.join(spec.command(options))}")
        name = name or f"{rig}-{port}"
        if not NAME.fullmatch(name):
            raise DeploymentError(f"deployment name {name!r}: use letters, digits, '.', '_' and '-' only")
        self.logs.mkdir(parents=True, exist_ok=True)
        with self._records.locked() as records:
            for other in records.values():
                if self._process(other) is not None and (other.name == name or other.port == port):
                    raise DeploymentError(f"deployment {other.name!r} ({other.rig}, pid {other.pid}) already "
                                          f"runs on port {other.port}: stop it first or pick another port/name")
            if not _port_free(host, port):
                raise DeploymentError(f"port {port} on {host} is busy: another process is listening there")
            started, stamp = _now()
            log = self.logs / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(started))}.log"
            with open(log, "ab") as out:
                process = spec.start(options, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=_rig_env(api_key))
            with self._lock:
                self._children[process.pid] = process
                if api_key:
                    self._keys[name] = api_key
                else:
                    self._keys.pop(name, None)
            record = DeploymentRecord(
                name=name, rig=rig, model=options.model, host=host, port=port, pid=process.pid,
                process_started=psutil.Process(process.pid).create_time(), command=spec.command(options),
                log=str(log), started_at=stamp,
                options={"dtype": dtype, "max_model_len": max_model_len, "max_batch": max_batch})
            records[name] = record
        if wait:
            try:
                wait_healthy(record.base_url, timeout_s, process)
            except Exception as exc:  # whatever failed while it started, the rig is stopped and removed
                self.stop(name, timeout_s=10.0)
                tail = "\n".join(_tail(log, LOG_TAIL_ON_ERROR))
                raise DeploymentError(f"{rig} on port {port} did not become healthy: {exc}; it was stopped and "
                                      f"removed. Log {log} ends with:\n{tail}") from None
        return self._status(record)

    def api_key(self, name: str) -> str | None:
        """The API key deployment `name` was started with by this process (None: none, or started
        elsewhere: a key is kept in memory only, so another server process must be given it)."""
        with self._lock:
            return self._keys.get(name)

    def stop(self, name: str, timeout_s: float = 30.0) -> StopResult:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL what is left; the record is removed either way."""
        record = self.get(name)
        state = self._status(record).state
        t0 = time.monotonic()
        how: Literal["sigterm", "sigkill", "already dead"] = "already dead"
        with self._lock:
            child = self._children.get(record.pid)  # its Popen, when this process started it
        exit_code = child.poll() if child is not None else None
        proc = self._process(record)
        if proc is not None:
            try:
                family = [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                family = [proc]
            how = "sigterm"
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGTERM)
            if child is not None:
                # Started here: its Popen reaps it and keeps the status. (Waited through psutil, the
                # status was lost whenever anything else reaped it first, a concurrent status's poll
                # among them: stop returned exit_code None, a CI failure three times.)
                try:
                    child.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    how = "sigkill"
                    child.kill()
                    child.wait(10.0)
                exit_code = child.returncode
                family = family[1:]  # its children, if any, below
            gone, alive = _wait_exited(family, timeout_s if child is None else 1.0)
            if alive:
                how = "sigkill"
                for p in alive:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.kill()
                gone += _wait_exited(alive, 10.0)[0]
            if child is None:
                exit_code = next((getattr(p, "returncode", None) for p in gone if p.pid == record.pid), None)
        with self._lock:
            self._children.pop(record.pid, None)
            self._keys.pop(name, None)
        with self._records.locked() as records:
            if name in records and records[name].pid == record.pid:
                del records[name]
        return StopResult(name=name, state_before=state, how=how, exit_code=exit_code,
                          seconds=round(time.monotonic() - t0, 2), log=record.log)

    def logs_tail(self, name: str, tail: int = 100) -> tuple[DeploymentRecord, list[str]]:
        record = self.get(name)
        return record, _tail(record.log, tail)

