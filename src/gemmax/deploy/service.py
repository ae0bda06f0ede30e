"""One interface over the remote targets, used by the MCP tools and `gemmax deploy`.

Every operation takes a deployment name and dispatches on the recorded target; results are
pydantic models (the MCP tools return them as structured output). The API key a deployment's server
was given is kept in the registry and used by the benchmark, never returned.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from gemmax.deploy import cost, timeline
from gemmax.deploy.aws import AwsSpec, AwsTarget
from gemmax.deploy.cache import check_url
from gemmax.deploy.errors import DeployError
from gemmax.deploy.registry import Registry, RemoteDeployment, SshHost, check_name, state_dir
from gemmax.deploy.ssh import SshTarget, connect, tunnel


class RemoteStatus(BaseModel):
    deployment: RemoteDeployment
    instance_state: str | None = Field(None, description="aws: the EC2 state now; ssh: running / dead / ended")
    health_status: int | None = None
    health: dict[str, Any] | None = None
    cost: dict[str, Any]


class TerminateResult(BaseModel):
    deployment: RemoteDeployment
    cache_push: dict[str, Any] | None = Field(None, description="the compile-cache push before teardown, if any")


class Deployer:
    def __init__(self, root: Path | None = None):
        self.registry = Registry(root)
        self.aws = AwsTarget(self.registry)
        self.ssh = SshTarget(self.registry)

    # ------------------------------------------------------------------ launch

    def launch_aws(self, name: str, spec: AwsSpec, **options: Any) -> RemoteDeployment:
        if options.get("cache_url"):
            check_url(options["cache_url"])
        return self.aws.launch(name, spec, **options)

    def launch_ssh(self, name: str, host: SshHost, install: str | None = None, python: str = "python3",
                   venv: str = ".gemmax/venv", **options: Any) -> RemoteDeployment:
        check_name(name)  # before an install that can take minutes

        async def go():
            if install:
                await self.ssh.install(host, install, python, venv)
            return await self.ssh.start(name, host, **options)

        return timeline.run_sync(go())

    # ------------------------------------------------------------------ inspect

    def records(self) -> list[RemoteDeployment]:
        return self.registry.records()

    def status(self, name: str) -> RemoteStatus:
        record = self.registry.get(name)
        if record.target == "aws":
            instance = self.aws.describe(record) if record.aws.instance_id else None
            state = instance["State"]["Name"] if instance else None
            if record.aws.instance_id:  # ended outside gemmax (a spot interruption): recorded as ended
                record = self.aws.reconcile(record, instance)
            code = health = None
            if record.active and record.base_url and state == "running":
                code, health = timeline.run_sync(timeline.probe(record.base_url, record.api_key))
                if record.state == "booting" and code is not None:  # a launch without wait, completed here
                    self.registry.event(name, "reachable")
                    if code == 200:
                        self.registry.event(name, "healthy", **timeline.cache_figures(health or {}))
                        record = self.registry.update(name, state="ready")
        else:
            found = timeline.run_sync(self.ssh.status(record))
            state, code, health = found["process"], found["health_status"], found["health"]
            record = self.registry.get(name)
        return RemoteStatus(deployment=record, instance_state=state, health_status=code, health=health,
                            cost=cost.cost_of(record))

    def logs(self, name: str, tail: int = 100) -> list[str]:
        record = self.registry.get(name)
        if record.target == "ssh":
            return timeline.run_sync(self.ssh.logs(record, tail))
        return self.aws.console(record, tail)

    # ------------------------------------------------------------------ reach it

    @contextlib.asynccontextmanager
    async def endpoint(self, name: str) -> AsyncIterator[tuple[RemoteDeployment, str]]:
        """(record, base URL reachable from here): the recorded address, or an SSH tunnel to it."""
        record = self.registry.get(name)
        if not record.active:
            raise DeployError(f"deployment {name!r} is {record.state}")
        if record.target == "ssh":
            async with connect(record.ssh) as conn, tunnel(conn, record.port) as url:
                yield record, url
        else:
            yield record, record.base_url

    async def benchmark(self, name: str, out: Path | None = None, **given: Any) -> tuple[Path, dict[str, Any]]:
        """The harness (`gemmax bench`) from this machine against the deployment; the result is written
        to OUT (default: under the state directory) and returned."""
        from gemmax.bench.report import write_json
        from gemmax.bench.sweep import Sweep, SweepConfig

        async with self.endpoint(name) as (record, url):
            price = record.aws.price_per_hour if record.aws else None
            config = SweepConfig(base_url=url, label=given.pop("label", None) or name, api_key=record.api_key,
                                 price_per_hour=price, **given)
            result = await Sweep(config).run()
        path = out or state_dir() / "results" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        write_json(result, path)
        return path, result

    # ------------------------------------------------------------------ compile cache

    def push_cache(self, name: str) -> dict[str, Any]:
        record = self.registry.get(name)
        if not record.cache_url:
            raise DeployError(f"deployment {name!r} has no cache URL")
        if record.target == "aws":
            return self.aws.push_cache(record)
        out = timeline.run_sync(self.ssh.run_gemmax(record, ["cache", "export", record.cache_url]))
        return {"pushed": True, "method": "ssh", "output": out.strip()}

    def restore_cache(self, name: str) -> dict[str, Any]:
        record = self.registry.get(name)
        if not record.cache_url:
            raise DeployError(f"deployment {name!r} has no cache URL")
        if record.target == "aws":
            raise DeployError("an aws deployment restores its cache at boot (user data); to restore into a "
                              "running instance, terminate and launch again")
        out = timeline.run_sync(self.ssh.run_gemmax(record, ["cache", "import", record.cache_url]))
        return {"restored": True, "method": "ssh", "output": out.strip()}

    # ------------------------------------------------------------------ teardown, cleanup, cost

    def terminate(self, name: str, push_cache: bool = True, timeout_s: float = 600.0) -> TerminateResult:
        record = self.registry.get(name)
        if record.target == "aws":
            done = self.aws.terminate(name, push_cache=push_cache, timeout_s=timeout_s)
            return TerminateResult(deployment=done, cache_push=done.timeline.get("cache_push"))
        push = None
        if push_cache and record.cache_url and record.active:
            try:
                push = self.push_cache(name)
            except DeployError as exc:  # reported, as on aws; the server is stopped all the same
                push = {"pushed": False, "method": "ssh", "error": str(exc)}
        if record.active:
            timeline.run_sync(self.ssh.stop(name, timeout_s))
        return TerminateResult(deployment=self.registry.get(name), cache_push=push)

    def cleanup(self, region: str | None = None, terminate: bool = True) -> list[dict[str, Any]]:
        return self.aws.cleanup(region, terminate)

    def cost(self, name: str | None = None) -> dict[str, Any]:
        records = [self.registry.get(name)] if name else [r for r in self.records() if r.target == "aws"]
        rows = [cost.cost_of(r) for r in records]
        known = [r["cost_usd"] for r in rows if r["cost_usd"] is not None]
        return {"deployments": rows, "instance_hours": round(sum(r["instance_hours"] for r in rows), 4),
                "cost_usd": round(sum(known), 4), "unpriced": [r["name"] for r in rows if r["cost_usd"] is None],
                "caps": vars(cost.Caps.from_env())}
