"""A host you already have, over SSH (asyncssh): install or update gemmax, start, stop, status, logs,
and a tunnel to the server's port.

The server runs on the host under `setsid nohup`, detached from the SSH session, its pid and log in
the deployment's directory on the host (`.gemmax/deployments/NAME`: paths on the host are relative to
the login directory, as an SSH command starts there); it binds the host's loopback,
and this machine reaches it through an SSH tunnel (a local port forwarded to it), so nothing is
exposed on the host's network. The host key is checked against known_hosts (yours, or the file
given); keys come from the file given, the SSH agent or ~/.ssh.
"""

from __future__ import annotations

import contextlib
import shlex
import time
from collections.abc import AsyncIterator
from typing import Any

from gemmax.deploy.errors import DeployError
from gemmax.deploy.registry import Registry, RemoteDeployment, SshHost
from gemmax.deploy.userdata import model_args


def _asyncssh():
    try:
        import asyncssh
    except ImportError:
        raise DeployError("the ssh target needs asyncssh: pip install 'gemmax[ssh]'") from None
    return asyncssh


@contextlib.asynccontextmanager
async def connect(host: SshHost):
    asyncssh = _asyncssh()
    options: dict[str, Any] = {"port": host.port}
    if host.username:
        options["username"] = host.username
    if host.client_key:
        options["client_keys"] = [host.client_key]
    if host.known_hosts:
        options["known_hosts"] = host.known_hosts
    try:
        async with asyncssh.connect(host.host, **options) as conn:
            yield conn
    except (OSError, asyncssh.Error) as exc:
        user = f"{host.username}@" if host.username else ""
        raise DeployError(f"ssh {user}{host.host}:{host.port}: {exc}") from None


async def run(conn, command: str, check: bool = True, timeout_s: float = 600.0) -> tuple[int, str, str]:
    result = await conn.run(command, check=False, timeout=timeout_s)
    status = result.exit_status if result.exit_status is not None else -1
    if check and status != 0:
        raise DeployError(f"on the host, `{command}` exited with {status}: {str(result.stderr).strip()[-2000:]}")
    return status, str(result.stdout), str(result.stderr)


@contextlib.asynccontextmanager
async def tunnel(conn, port: int) -> AsyncIterator[str]:
    """A local port on this machine forwarded to the host's 127.0.0.1:PORT; yields its URL."""
    listener = await conn.forward_local_port("127.0.0.1", 0, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{listener.get_port()}"
    finally:
        listener.close()


def _paths(host: SshHost) -> tuple[str, str]:
    return f"{host.remote_dir}/pid", f"{host.remote_dir}/serve.log"


def _started_file(host: SshHost) -> str:
    return f"{host.remote_dir}/pid.started"  # the server's start time, `started_at` below


# `started_at $pid`: the process's start time in clock ticks after boot (field 22 of /proc/PID/stat;
# the fields after the command name, which may hold spaces, start at field 3). Unlike `ps -o lstart`
# it does not move when the wall clock is stepped (NTP, a VM resumed). Empty where there is no /proc.
STARTED_AT = 'started_at() { [ -r "/proc/$1/stat" ] && sed "s/^.*) //" "/proc/$1/stat" | cut -d" " -f20; }; '


def _running(host: SshHost) -> str:
    """Shell function `running $pid`: the process exists, is not a zombie (an exited server whose
    parent, init in a container that does not reap, never collected it still answers `kill -0`) and
    started when the server did (a pid the host has since given to another process is not the
    server's: it is never signalled). Without a recorded start time (no /proc on the host, or a
    deployment started before it was recorded) the pid alone decides."""
    started = shlex.quote(_started_file(host))
    return (STARTED_AT + 'running() { kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" | cut -c1)" != Z ] && '
            f'{{ [ ! -s {started} ] || [ "$(started_at "$1")" = "$(cat {started})" ]; }}; }}; ')


def _exports(host: SshHost) -> str:
    """The launch's compile-cache directory for every later gemmax command on the host (cache push,
    restore): they must read the directory the server wrote."""
    return f"export GEMMAX_COMPILE_CACHE={shlex.quote(host.compile_cache)}; " if host.compile_cache else ""


class SshTarget:
    def __init__(self, registry: Registry):
        self.registry = registry

    async def install(self, host: SshHost, package: str = "gemmax", python: str = "python3",
                      venv: str = ".gemmax/venv") -> dict[str, Any]:
        """Create VENV on the host if missing, then `pip install --upgrade PACKAGE` into it."""
        py = shlex.quote(f"{venv}/bin/python")
        command = (f"test -x {py} || {shlex.quote(python)} -m venv {shlex.quote(venv)}; "
                   f"{py} -m pip install --upgrade --disable-pip-version-check {shlex.quote(package)}")
        async with connect(host) as conn:
            status, out, err = await run(conn, command, check=False)
        if status != 0:
            raise DeployError(f"install of {package!r} on {host.host} failed ({status}):\n{err.strip()[-2000:]}")
        return {"host": host.host, "package": package, "venv": venv, "gemmax": f"{venv}/bin/gemmax",
                "output_tail": out.strip().splitlines()[-3:]}

    async def start(self, name: str, host: SshHost, *, model: str, port: int, serve_args: list[str],
                    command: list[str] | None = None, env: dict[str, str] | None = None,
                    cache_url: str | None = None, wait: bool = True, timeout_s: float = 600.0) -> RemoteDeployment:
        """Restore the compile cache from CACHE_URL (if given), start `gemmax serve` (or COMMAND) on the
        host, detached; with `wait`, time its boot through a tunnel."""
        from gemmax.deploy import timeline

        argv = command or [*shlex.split(host.gemmax), "serve", "--host", "127.0.0.1", "--port", str(port),
                           *model_args(model), *serve_args]
        if (env or {}).get("GEMMAX_COMPILE_CACHE"):  # kept (the rest of env is not: it may hold secrets)
            host = host.model_copy(update={"compile_cache": env["GEMMAX_COMPILE_CACHE"]})
        record = RemoteDeployment(name=name, target="ssh", state="launching", model=model, port=port,
                                  created=time.time(), ssh=host, cache_url=cache_url, timeline={"requested": 0.0})
        self.registry.add(record)
        pid_file, log = _paths(host)
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items())
        script = (f"mkdir -p {shlex.quote(host.remote_dir)} && {exports}"
                  f"(setsid nohup {shlex.join(argv)} >> {shlex.quote(log)} 2>&1 < /dev/null & echo $! > {shlex.quote(pid_file)})"
                  f" && {{ {STARTED_AT}started_at $(cat {shlex.quote(pid_file)}) > {shlex.quote(_started_file(host))}; true; }}"
                  f" && cat {shlex.quote(pid_file)}")
        try:
            async with connect(host) as conn:
                if cache_url:
                    restore = shlex.join([*shlex.split(host.gemmax), "cache", "import", cache_url])
                    status, _, err = await run(conn, exports + restore, check=False)
                    self.registry.event(name, "cache_restored" if status == 0 else "cache_restore_failed",
                                        **({} if status == 0 else {"cache_restore_error": err.strip()[-500:]}))
                _, out, _ = await run(conn, script)
                self.registry.event(name, "running", pid=int(out.strip()))
                record = self.registry.update(name, state="booting", base_url=f"http://127.0.0.1:{port}")
                if not wait:
                    return record
                async with tunnel(conn, port) as url:
                    try:
                        await timeline.wait_healthy(self.registry, name, url, timeout_s)
                    except TimeoutError as exc:
                        await self._stop(conn, host, 10.0)
                        tail = (await run(conn, f"tail -n 30 {shlex.quote(log)}", check=False))[1]
                        record = self.registry.update(name, state="failed", ended=time.time(), error=str(exc))
                        raise DeployError(f"deployment {name!r} on {host.host} failed: {exc}; it was stopped. "
                                          f"Log ends with:\n{tail}") from None
        except DeployError as exc:
            current = self.registry.get(name)
            if current.active and "running" in current.timeline:  # the server was started: stop it anew
                try:
                    async with connect(host) as conn:
                        await self._stop(conn, host, 10.0)
                except DeployError as stop_failed:  # still live: `terminate` retries the stop
                    self.registry.update(name, error=f"{exc}; stopping it failed too ({stop_failed}): the server "
                                                     "may still run, terminate stops it")
                    raise exc from None
            if current.active:
                self.registry.update(name, state="failed", ended=time.time(), error=str(exc))
            raise
        return self.registry.update(name, state="ready")

    async def _stop(self, conn, host: SshHost, timeout_s: float) -> str:
        pid_file, _ = _paths(host)
        steps = max(int(timeout_s / 0.2), 1)
        script = (f"pid=$(cat {shlex.quote(pid_file)} 2>/dev/null) || {{ echo none; exit 0; }}; "
                  f"{_running(host)}running $pid || {{ echo already-dead; exit 0; }}; kill -TERM -$pid 2>/dev/null || kill -TERM $pid; "
                  f"for i in $(seq {steps}); do running $pid || {{ echo sigterm; exit 0; }}; sleep 0.2; done; "
                  f"kill -KILL -$pid 2>/dev/null || kill -KILL $pid; echo sigkill")
        return (await run(conn, script))[1].strip()

    async def stop(self, name: str, timeout_s: float = 30.0) -> dict[str, Any]:
        record = self.registry.get(name)
        async with connect(record.ssh) as conn:
            how = await self._stop(conn, record.ssh, timeout_s)
        self.registry.update(name, state="stopped", ended=time.time(),
                             timeline=dict(record.timeline, stopped=round(time.time() - record.created, 3), stop=how))
        return {"name": name, "how": how}

    async def alive(self, conn, record: RemoteDeployment) -> bool:
        pid_file, _ = _paths(record.ssh)
        status, _, _ = await run(conn, f"{_running(record.ssh)}running $(cat {shlex.quote(pid_file)})", check=False)
        return status == 0

    async def status(self, record: RemoteDeployment) -> dict[str, Any]:
        from gemmax.deploy import timeline

        if not record.active:
            return {"process": "ended", "health_status": None, "health": None}
        async with connect(record.ssh) as conn:
            if not await self.alive(conn, record):
                return {"process": "dead", "health_status": None, "health": None}
            async with tunnel(conn, record.port) as url:
                code, health = await timeline.probe(url, record.api_key)
        if code == 200 and "healthy" not in record.timeline:
            self.registry.event(record.name, "healthy", **timeline.cache_figures(health or {}))
            self.registry.update(record.name, state="ready")
        return {"process": "running", "health_status": code, "health": health}

    async def logs(self, record: RemoteDeployment, tail: int) -> list[str]:
        _, log = _paths(record.ssh)
        async with connect(record.ssh) as conn:
            return (await run(conn, f"tail -n {int(tail)} {shlex.quote(log)}", check=False))[1].splitlines()

    async def run_gemmax(self, record: RemoteDeployment, args: list[str]) -> str:
        async with connect(record.ssh) as conn:
            return (await run(conn, _exports(record.ssh) + shlex.join([*shlex.split(record.ssh.gemmax), *args])))[1]
