"""MCP tools for deployments on any target: `local` (a process here), `ssh` (a host you have) and
`aws` (an EC2 instance). Thin wrappers over `gemmax.deploy.service.Deployer`, which `gemmax deploy`
runs too; the registry of remote resources is on disk, so a restarted server lists and terminates
what another started. Remote operations answer by deployment name; a local deployment is started
here and otherwise managed by the local tools (stop_deployment, deployment_status, ...).

AWS credentials come from boto3's standard chain in the server's environment; no tool takes,
logs or returns one. A deployment's server API key is kept in the registry, never returned.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from gemmax.deploy import cost
from gemmax.deploy.aws import AwsSpec
from gemmax.deploy.cache import check_url
from gemmax.deploy.errors import DeployError
from gemmax.deploy.registry import RemoteDeployment, SshHost, state_dir
from gemmax.deploy.service import Deployer, RemoteStatus, TerminateResult
from gemmax.deploy.userdata import BUILTIN
from gemmax.mcp.deployments import DeploymentStatus
from gemmax.mcp.local import deployments
from gemmax.weights import builtin

__all__ = ["DEPLOY_TOOLS", "DeployError", "check_url"]


def deployer() -> Deployer:
    return Deployer(state_dir())


class AwsOptions(AwsSpec):
    """Where and how to launch on EC2, and the caps for this call."""

    max_instances: int | None = Field(None, ge=1, description="cap on live instances (default $GEMMAX_DEPLOY_MAX_INSTANCES or 2)")
    max_instance_hours: float | None = Field(None, gt=0, description="cap on instance-hours (default $GEMMAX_DEPLOY_MAX_INSTANCE_HOURS or 24)")


class SshOptions(BaseModel):
    """The host and how to run gemmax there."""

    host: str
    port: int = Field(22, ge=1, le=65535)
    username: str | None = None
    client_key: str | None = Field(None, description="private key file (default: the agent, ~/.ssh)")
    known_hosts: str | None = Field(None, description="known_hosts file (default ~/.ssh/known_hosts)")
    install: str | None = Field(None, description="pip-install or update this package spec into VENV first (e.g. 'gemmax[cuda]')")
    python: str = Field("python3", description="the host's python, to create VENV")
    venv: str = Field(".gemmax/venv", description="where gemmax lives on the host (relative: to the login directory)")
    gemmax: str | None = Field(None, description="the gemmax command on the host (default VENV/bin/gemmax)")
    command: list[str] | None = Field(None, description="run this instead of `gemmax serve ...` (it must serve PORT on loopback)")
    env: dict[str, str] | None = Field(None, description="environment for the server on the host")


class LaunchResult(BaseModel):
    target: Literal["local", "ssh", "aws"]
    remote: RemoteDeployment | None = Field(None, description="ssh / aws: the registry record with its boot timeline")
    local: DeploymentStatus | None = Field(None, description="local: the deployment's status")


class DeploymentsList(BaseModel):
    local: list[DeploymentStatus]
    remote: list[RemoteDeployment]


class CacheResult(BaseModel):
    name: str
    cache_url: str
    result: dict[str, Any]


class BenchmarkResult(BaseModel):
    path: str
    label: str
    model: str
    cells: list[dict[str, Any]]
    flags: list[str]


def deploy_launch(target: Literal["local", "ssh", "aws"], name: str, model: str = "builtin",
                  port: Annotated[int, Field(ge=1, le=65535)] = 8000, serve_args: list[str] | None = None,
                  cache_url: str | None = None, aws: AwsOptions | None = None, ssh: SshOptions | None = None,
                  wait: bool = True, timeout_s: Annotated[float, Field(gt=0)] = 1200.0) -> LaunchResult:
    """Launch `gemmax serve` for MODEL (a path or hub id on the target; "builtin": the built-in Gemma 3
    270M, no download) on a target: local (a process here, as start_deployment), ssh (a
    host: optional install, then a detached server reached through an SSH tunnel) or aws (EC2, spot by
    default, zone by zone on capacity errors, each attempt reported; user data installs gemmax, restores
    the compile cache from CACHE_URL and serves under systemd). With WAIT, returns once /health is 200
    with the boot timeline; a launch that never gets there is terminated and recorded as failed."""
    if target == "local":
        if serve_args or cache_url or aws or ssh:
            raise DeployError("target local takes model, port, wait and timeout_s only (start_deployment has the "
                              "local options); serve_args, cache_url, aws and ssh are for remote targets")
        if model == BUILTIN:  # its converted directory here (converted on first use), as `serve` loads it
            model = str(builtin.default_model_path())
        status = deployments().start("gemmax", model, port, name=name, wait=wait, timeout_s=timeout_s)
        return LaunchResult(target="local", local=status)
    if cache_url:
        check_url(cache_url)
    if target == "aws":
        if aws is None:
            raise DeployError("target aws needs the aws options (instance_type, zones, image_id)")
        caps = cost.Caps.from_env(aws.max_instances, aws.max_instance_hours)
        spec = AwsSpec(**aws.model_dump(exclude={"max_instances", "max_instance_hours"}))
        record = deployer().launch_aws(name, spec, model=model, port=port, cache_url=cache_url,
                                       serve_args=serve_args or [], caps=caps, wait=wait, timeout_s=timeout_s)
        return LaunchResult(target="aws", remote=record)
    if ssh is None:
        raise DeployError("target ssh needs the ssh options (host, ...)")
    host = SshHost(host=ssh.host, port=ssh.port, username=ssh.username, client_key=ssh.client_key,
                   known_hosts=ssh.known_hosts, remote_dir=f".gemmax/deployments/{name}",
                   gemmax=ssh.gemmax or f"{ssh.venv}/bin/gemmax")
    record = deployer().launch_ssh(name, host, install=ssh.install, python=ssh.python, venv=ssh.venv, model=model, port=port,
                                   serve_args=serve_args or [], command=ssh.command, env=ssh.env,
                                   cache_url=cache_url, wait=wait, timeout_s=timeout_s)
    return LaunchResult(target="ssh", remote=record)


def deploy_list() -> DeploymentsList:
    """Every deployment: local processes with their live state, and every remote one in the registry
    (ssh and aws, live and ended) with its state, address, timeline and attempts."""
    return DeploymentsList(local=deployments().statuses(), remote=deployer().records())


def deploy_status(name: str) -> RemoteStatus:
    """A remote deployment now: the EC2 instance state (aws) or the process (ssh), /health, the boot
    timeline (requested, running, reachable, healthy with compile-cache hits / misses) and its cost so far."""
    return deployer().status(name)


def deploy_logs(name: str, tail: Annotated[int, Field(ge=1, le=10000)] = 100) -> list[str]:
    """The last TAIL lines of a remote deployment's log: the server's log on an ssh host, the console
    output (user data, then the service) of an aws instance."""
    return deployer().logs(name, tail)


async def deploy_benchmark(name: str, input_lens: list[int] | None = None, output_len: int | None = None,
                           repeats: int | None = None, concurrency: list[int] | None = None,
                           label: str | None = None) -> BenchmarkResult:
    """Run the benchmark harness from this machine against a remote deployment (through its SSH tunnel
    for ssh); writes the result JSON under the state directory (input for compare_results) and returns
    the headline figures. An aws deployment's result carries its price per hour."""
    import json

    from gemmax.bench.report import run_flags, summary_line

    given = {"input_lens": input_lens, "output_len": output_len, "repeats": repeats, "concurrency": concurrency}
    path, result = await deployer().benchmark(
        name, label=label, **{k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None})
    return BenchmarkResult(path=str(path), label=result["label"], model=result["model"],
                           cells=json.loads(summary_line(result))["cells"],
                           flags=run_flags(result))


def deploy_cache_push(name: str) -> CacheResult:
    """Push a remote deployment's compile cache to its CACHE_URL (aws: SSM Run Command on the instance;
    ssh: `gemmax cache export` on the host)."""
    d = deployer()
    result = d.push_cache(name)
    return CacheResult(name=name, cache_url=d.registry.get(name).cache_url, result=result)


def deploy_cache_restore(name: str) -> CacheResult:
    """Restore the compile cache from CACHE_URL on an ssh host (`gemmax cache import`); an aws instance
    restores it at boot."""
    d = deployer()
    result = d.restore_cache(name)
    return CacheResult(name=name, cache_url=d.registry.get(name).cache_url, result=result)


def deploy_terminate(name: str, push_cache: bool = True, timeout_s: Annotated[float, Field(gt=0)] = 600.0) -> TerminateResult:
    """Tear a remote deployment down: push its compile cache first (unless push_cache is false), then
    terminate the instance and wait for `terminated` (aws) or stop the server (ssh). The record stays
    in the registry as terminated, for cost and the instance-hours cap."""
    return deployer().terminate(name, push_cache=push_cache, timeout_s=timeout_s)


class CleanupResult(BaseModel):
    region: str | None
    orphans: list[dict[str, Any]] = Field(description="instances tagged gemmax:deployment the registry does not know as live")


def deploy_cleanup(region: str | None = None, dry_run: bool = False) -> CleanupResult:
    """Find EC2 instances tagged gemmax:deployment that the registry does not know as live (orphans of
    a crash or of another machine) and terminate them (dry_run: only list them)."""
    return CleanupResult(region=region or os.environ.get("AWS_DEFAULT_REGION"),
                         orphans=deployer().cleanup(region, terminate=not dry_run))


class CostReport(BaseModel):
    deployments: list[dict[str, Any]]
    instance_hours: float
    cost_usd: float
    unpriced: list[str]
    caps: dict[str, Any]


def deploy_cost(name: str | None = None) -> CostReport:
    """Instance-hours and cost of one remote deployment or of all aws ones (on-demand list price, or the
    zone's spot price at launch), with the guard-rail caps."""
    return CostReport(**deployer().cost(name))


DEPLOY_TOOLS = (deploy_launch, deploy_list, deploy_status, deploy_logs, deploy_benchmark, deploy_cache_push,
                deploy_cache_restore, deploy_terminate, deploy_cleanup, deploy_cost)
