"""EC2 deployments through boto3.

Credentials and region come only from boto3's standard chain (environment, shared config and
credentials files, SSO, the instance or container role; `AWS_ENDPOINT_URL` points it elsewhere, as
the tests do at a local moto server). Nothing here reads, logs or returns a credential.

Launch: the guard rails first (`cost.check_caps`), then `RunInstances` zone by zone (spot by
default, on-demand on request); a capacity error (`CAPACITY_ERRORS`) moves to the next zone, any
other error stops. Every attempt is reported. The instance, its volumes and its spot request carry
the `gemmax:deployment` tag, and the instance id is in the registry as soon as EC2 answers. Then the
boot is timed (`timeline`): running, reachable, /health 200 with the compile-cache figures. A launch
that does not become healthy within its timeout is terminated and recorded as failed.

Terminate: push the compile cache first (SSM Run Command on the instance, unless told not to; the
unit's ExecStopPost pushes it again at shutdown), terminate, wait for `terminated`. Cleanup: every
instance tagged `gemmax:deployment` that the registry does not know as live is an orphan.
"""

from __future__ import annotations

import calendar
import contextlib
import functools
import re
import secrets
import shlex
import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from gemmax.deploy import cost, timeline
from gemmax.deploy.errors import DeployError
from gemmax.deploy.registry import Attempt, AwsInstance, Registry, RemoteDeployment
from gemmax.deploy.userdata import CACHE_DIR, VENV, user_data

TAG = "gemmax:deployment"
CAPACITY_ERRORS = frozenset({
    "InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity", "InsufficientReservedInstanceCapacity",
    "SpotMaxPriceTooLow", "MaxSpotInstanceCountExceeded", "InsufficientFreeAddressesInSubnet", "Unsupported",
})
LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


def _boto3():
    try:
        import boto3
    except ImportError:
        raise DeployError("the aws target needs boto3: pip install 'gemmax[aws]'") from None
    return boto3


def client(service: str, region: str | None):
    """A boto3 client from the standard credential chain (no credential is ever passed in here)."""
    boto3 = _boto3()
    session = boto3.session.Session(region_name=region)
    if session.region_name is None:
        raise DeployError("no AWS region: give region=, or set AWS_REGION / a profile's region")
    return session.client(service)


def _error(exc: Exception) -> tuple[str, str]:
    response = getattr(exc, "response", None) or {}
    err = response.get("Error", {})
    return err.get("Code", type(exc).__name__), err.get("Message", str(exc))


def aws_errors(fn):
    """Turn the AWS SDK's errors (an API error, no credentials, no endpoint) into a DeployError that
    says what AWS answered; never the credentials, which the SDK does not put in its messages."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DeployError:
            raise
        except Exception as exc:
            if not type(exc).__module__.startswith("botocore"):
                raise
            code, message = _error(exc)
            if code == "NoCredentialsError":
                message += " (gemmax uses boto3's standard chain: aws sso login / AWS_PROFILE / environment / role)"
            raise DeployError(f"AWS: {code}: {message}") from None

    return wrapped


def _transition_time(reason: str) -> float | None:
    """Epoch seconds from EC2's StateTransitionReason ("User initiated (2026-12-07 21:00:00 GMT)"; moto
    writes UTC), or None."""
    found = re.search(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) (?:GMT|UTC)\)", reason or "")
    if not found:
        return None
    return calendar.timegm(time.strptime(found.group(1), "%Y-%m-%d %H:%M:%S"))


def _tags(name: str) -> list[dict[str, str]]:
    return [{"Key": TAG, "Value": name}, {"Key": "Name", "Value": f"gemmax-{name}"}]


class AwsSpec(BaseModel):
    """Where and how to launch on EC2."""

    instance_type: str = Field(description="e.g. g6.xlarge (L4), g4dn.xlarge (T4), p5.48xlarge (H100)")
    zones: list[str] = Field(min_length=1, description="availability zones tried in order; a capacity error moves to the next")
    image_id: str = Field(description="AMI with NVIDIA drivers and python3 (e.g. an AWS Deep Learning Base AMI)")
    region: str | None = Field(None, description="default: boto3's configured region")
    market: Literal["spot", "on-demand"] = "spot"
    package: str = Field("gemmax[cuda,aws]", description="what the instance pip-installs")
    key_name: str | None = None
    security_group_ids: list[str] | None = None
    subnet_ids: dict[str, str] | None = Field(None, description="zone -> subnet id (default: the zone's default subnet)")
    instance_profile: str | None = Field(None, description="IAM instance profile: S3 access to the cache URL, SSM")
    endpoint: str | None = Field(None, description="reach the server at this URL instead of http://PUBLIC_IP:PORT")
    planned_hours: float = Field(1.0, gt=0, description="instance-hours this launch counts against the cap")


def _run_request(name: str, spec: AwsSpec, zone: str, user_data_script: str) -> dict[str, Any]:
    """RunInstances arguments for one zone: every resource it creates tagged gemmax:deployment=NAME."""
    kinds = ("instance", "volume") + (("spot-instances-request",) if spec.market == "spot" else ())
    request: dict[str, Any] = {
        "ImageId": spec.image_id, "InstanceType": spec.instance_type, "MinCount": 1, "MaxCount": 1,
        "UserData": user_data_script,
        "TagSpecifications": [{"ResourceType": kind, "Tags": _tags(name)} for kind in kinds],
    }
    if spec.subnet_ids and zone in spec.subnet_ids:
        request["SubnetId"] = spec.subnet_ids[zone]
    else:
        request["Placement"] = {"AvailabilityZone": zone}
    if spec.market == "spot":
        request["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
            "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
    if spec.key_name:
        request["KeyName"] = spec.key_name
    if spec.security_group_ids:
        request["SecurityGroupIds"] = spec.security_group_ids
    if spec.instance_profile:
        request["IamInstanceProfile"] = {"Name": spec.instance_profile}
    return request


class AwsTarget:
    def __init__(self, registry: Registry, ec2_client=None, ssm_client=None):
        self.registry = registry
        self._ec2 = ec2_client
        self._ssm = ssm_client

    def ec2(self, region: str):
        return self._ec2 if self._ec2 is not None else client("ec2", region)

    def ssm(self, region: str):
        return self._ssm if self._ssm is not None else client("ssm", region)

    # ------------------------------------------------------------------ launch

    @aws_errors
    def launch(self, name: str, spec: AwsSpec, *, model: str, port: int = 8000, cache_url: str | None = None,
               serve_args: list[str] | None = None, caps: cost.Caps | None = None, wait: bool = True,
               timeout_s: float = 1200.0) -> RemoteDeployment:
        """Launch SPEC serving MODEL on PORT, zone by zone; with `wait`, return once /health is 200."""
        ec2 = self.ec2(spec.region)
        caps = caps or cost.Caps.from_env()
        api_key = secrets.token_urlsafe(24)
        script = user_data(model=model, port=port, package=spec.package, cache_url=cache_url,
                           serve_args=list(serve_args or []), api_key_env=api_key)
        record = RemoteDeployment(
            name=name, target="aws", state="launching", model=model, port=port, cache_url=cache_url,
            created=time.time(), planned_hours=spec.planned_hours, api_key=api_key, timeline={"requested": 0.0},
            aws=AwsInstance(region=ec2.meta.region_name, instance_type=spec.instance_type, market=spec.market,
                            image_id=spec.image_id))
        for live in self.registry.records():  # an interrupted instance frees its cap slot first
            if live.target == "aws" and live.active and live.aws.instance_id:
                with contextlib.suppress(DeployError):  # not seen now (throttled, another region's rights): counted
                    self.reconcile(live)
        self.registry.add(record, guard=lambda records: cost.check_caps(records, spec.planned_hours, caps))
        instance_type, market, zones = spec.instance_type, spec.market, spec.zones
        attempts: list[Attempt] = []
        instance = None
        for zone in zones:
            request = _run_request(name, spec, zone, script)
            t0 = time.monotonic()
            try:
                instance = ec2.run_instances(**request)["Instances"][0]
            except Exception as exc:  # botocore ClientError (and its transport errors)
                code, message = _error(exc)
                attempts.append(Attempt(zone=zone, market=market, ok=False, error_code=code, message=message,
                                        seconds=round(time.monotonic() - t0, 3)))
                self.registry.update(name, aws=record.aws.model_copy(update={"attempts": attempts}))
                if code in CAPACITY_ERRORS:
                    continue
                self.registry.update(name, state="failed", ended=time.time(), error=f"{code}: {message}")
                raise DeployError(f"RunInstances in {zone} failed: {code}: {message}; attempts: "
                                  f"{_attempts_text(attempts)}") from None
            attempts.append(Attempt(zone=zone, market=market, ok=True, seconds=round(time.monotonic() - t0, 3)))
            break
        if instance is None:
            self.registry.update(name, state="failed", ended=time.time(),
                                 error=f"no capacity in any zone: {_attempts_text(attempts)}")
            raise DeployError(f"no {market} capacity for {instance_type} in {', '.join(zones)}: {_attempts_text(attempts)}")
        zone = instance["Placement"]["AvailabilityZone"]
        price, source = cost.on_demand_price(instance_type), "on-demand list price (us-east-1 table)"
        if market == "spot":
            try:
                spot = cost.spot_price(ec2, instance_type, zone)
            except Exception as exc:  # no permission for the history: priced at on demand, and said so
                spot, source = None, f"on-demand list price (spot price history unavailable: {_error(exc)[0]})"
            if spot is not None:
                price, source = spot, f"spot price history, {zone}, at launch"
        aws = record.aws.model_copy(update={"attempts": attempts, "zone": zone, "instance_id": instance["InstanceId"],
                                            "price_per_hour": price, "price_source": source})
        record = self.registry.update(name, aws=aws, state="booting")
        try:
            running = self._wait_state(ec2, instance["InstanceId"], "running", timeout_s)
        except (TimeoutError, DeployError) as exc:
            return self._fail(record, f"instance never ran: {exc}")
        self.registry.event(name, "running")
        address = running.get("PublicIpAddress") or running.get("PrivateIpAddress")
        base_url = spec.endpoint.rstrip("/") if spec.endpoint else f"http://{address}:{port}"
        record = self.registry.update(name, base_url=base_url)
        if not wait:
            return record
        return self.wait_ready(name, timeout_s)

    @aws_errors
    def wait_ready(self, name: str, timeout_s: float) -> RemoteDeployment:
        record = self.registry.get(name)
        left = max(timeout_s - (time.time() - record.created), 1.0)
        try:
            timeline.run_sync(timeline.wait_healthy(self.registry, name, record.base_url, left, record.api_key))
        except TimeoutError as exc:
            return self._fail(record, str(exc))
        return self.registry.update(name, state="ready")

    def _fail(self, record: RemoteDeployment, why: str) -> RemoteDeployment:
        """Terminate a launch that did not come up, record it failed, and raise with the timeline."""
        ended = self.terminate(record.name, push_cache=False, wait=True, timeout_s=300.0, state="failed")
        self.registry.update(record.name, error=why)
        raise DeployError(f"deployment {record.name!r} failed: {why}; instance {ended.aws.instance_id} was "
                          f"terminated. Timeline (s after request): {ended.timeline}")

    @staticmethod
    def _wait_state(ec2, instance_id: str, state: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                (reservation,) = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
            except Exception as exc:  # EC2 is eventually consistent: a new id may be unknown for seconds
                if _error(exc)[0] == "InvalidInstanceID.NotFound" and state == "terminated":
                    return {}  # EC2 forgets a terminated instance within about an hour
                if _error(exc)[0] != "InvalidInstanceID.NotFound" or time.monotonic() > deadline:
                    raise
                time.sleep(2.0)
                continue
            instance = reservation["Instances"][0]
            now = instance["State"]["Name"]
            if now == state:
                return instance
            if state == "running" and now in ("shutting-down", "terminated"):
                reason = instance.get("StateReason", {}).get("Message", "")
                raise DeployError(f"instance {instance_id} is {now} ({reason})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"instance {instance_id} still {now} after {timeout_s:.0f} s")
            time.sleep(2.0)

    # ------------------------------------------------------------------ status, cache, terminate

    @aws_errors
    def describe(self, record: RemoteDeployment) -> dict[str, Any] | None:
        ec2 = self.ec2(record.aws.region)
        try:
            reservations = ec2.describe_instances(InstanceIds=[record.aws.instance_id])["Reservations"]
        except Exception as exc:
            code, message = _error(exc)
            if code == "InvalidInstanceID.NotFound":
                return None
            raise DeployError(f"DescribeInstances: {code}: {message}") from None
        return reservations[0]["Instances"][0] if reservations else None

    @aws_errors
    def console(self, record: RemoteDeployment, tail: int) -> list[str]:
        """The last TAIL lines of the instance's console output (user data, then the service)."""
        if not record.aws.instance_id:
            raise DeployError(f"deployment {record.name!r} has no instance (no zone launched one: its attempts "
                              "are in its record), so no console output")
        output = self.ec2(record.aws.region).get_console_output(InstanceId=record.aws.instance_id,
                                                                Latest=True).get("Output") or ""
        return output.splitlines()[-tail:]

    @aws_errors
    def push_cache(self, record: RemoteDeployment, timeout_s: float = 600.0) -> dict[str, Any]:
        """Run `gemmax cache export CACHE_URL` on the instance through SSM Run Command and wait for it."""
        if not record.cache_url:
            raise DeployError(f"deployment {record.name!r} has no cache URL")
        ssm = self.ssm(record.aws.region)
        command = f"GEMMAX_COMPILE_CACHE={CACHE_DIR} {VENV}/bin/gemmax cache export {shlex.quote(record.cache_url)}"
        try:
            sent = ssm.send_command(InstanceIds=[record.aws.instance_id], DocumentName="AWS-RunShellScript",
                                    Comment=f"gemmax: push the compile cache of {record.name}",
                                    Parameters={"commands": [command]}, TimeoutSeconds=int(timeout_s))
        except Exception as exc:
            code, message = _error(exc)
            return {"pushed": False, "method": "ssm", "error": f"{code}: {message}", "command": command}
        command_id = sent["Command"]["CommandId"]
        deadline = time.monotonic() + timeout_s
        status = "Pending"
        while time.monotonic() < deadline:
            try:
                status = ssm.get_command_invocation(CommandId=command_id, InstanceId=record.aws.instance_id)["Status"]
            except Exception as exc:  # InvocationDoesNotExist right after sending
                status = _error(exc)[0]
            if status in ("Success", "Failed", "Cancelled", "TimedOut"):
                break
            time.sleep(2.0)
        return {"pushed": status == "Success", "method": "ssm", "command_id": command_id, "status": status,
                "command": command}

    @aws_errors
    def reconcile(self, record: RemoteDeployment, instance: dict[str, Any] | None = None,
                  state: str = "terminated") -> RemoteDeployment:
        """A live record whose instance ended outside gemmax (a spot interruption, the console, EC2
        having forgotten it) is ended: state terminated, `ended` at EC2's transition time when it
        gives one (else now), an `ended_outside` event with EC2's reason. Its hours stop there and
        its cap slot is free. `instance`: from a `describe` just made (else described here); `state`:
        the ended state to record (a failed launch's is "failed")."""
        if not (record.active and record.aws and record.aws.instance_id):
            return record
        if instance is None:
            instance = self.describe(record)
        if instance is None and "running" not in record.timeline:
            return record  # EC2 answers NotFound for a new id for a few seconds: only a seen instance is gone
        seen = instance["State"]["Name"] if instance else "unknown to EC2"
        if instance and seen not in ("shutting-down", "terminated"):
            return record
        reason = (instance or {}).get("StateReason", {}).get("Message") or (instance or {}).get("StateTransitionReason")
        ended = _transition_time((instance or {}).get("StateTransitionReason", "")) or time.time()
        timeline_ = dict(record.timeline, ended_outside=round(ended - record.created, 3),
                         ended_outside_reason=f"{seen}: {reason}" if reason else seen)
        # only if NAME still holds this launch (another process may have terminated and relaunched it)
        return self.registry.update(record.name, if_created=record.created, state=state,
                                    ended=max(ended, record.created), timeline=timeline_)

    @aws_errors
    def terminate(self, name: str, push_cache: bool = True, wait: bool = True, timeout_s: float = 600.0,
                  state: str = "terminated") -> RemoteDeployment:
        record = self.registry.get(name)
        if record.active and record.aws.instance_id:
            record = self.reconcile(record, state=state)  # gone already: ended when it went, nothing to push
        if not record.active:
            return record
        push = None
        if push_cache and record.cache_url and record.state == "ready":
            push = self.push_cache(record, timeout_s)
        if record.aws.instance_id:
            ec2 = self.ec2(record.aws.region)
            try:
                ec2.terminate_instances(InstanceIds=[record.aws.instance_id])
            except Exception as exc:
                if _error(exc)[0] != "InvalidInstanceID.NotFound":  # forgotten since the reconcile: gone
                    raise
            if wait:
                try:
                    self._wait_state(ec2, record.aws.instance_id, "terminated", timeout_s)
                except TimeoutError as exc:
                    raise DeployError(f"terminate {name!r}: {exc}; it stays in the registry as live") from None
        timeline_ = dict(record.timeline, terminated=round(time.time() - record.created, 3))
        if push is not None:
            timeline_["cache_push"] = push
        return self.registry.update(name, state=state, ended=time.time(), timeline=timeline_)

    @aws_errors
    def cleanup(self, region: str | None, terminate: bool = True) -> list[dict[str, Any]]:
        """Instances tagged gemmax:deployment that the registry does not know as live (orphans): listed,
        and terminated unless `terminate` is false."""
        ec2 = self.ec2(region)
        known = {r.aws.instance_id for r in self.registry.records() if r.target == "aws" and r.active and r.aws}
        orphans = []
        paginator = ec2.get_paginator("describe_instances")
        for page in paginator.paginate(Filters=[{"Name": "tag-key", "Values": [TAG]},
                                                {"Name": "instance-state-name", "Values": LIVE_STATES}]):
            for reservation in page["Reservations"]:
                for instance in reservation["Instances"]:
                    if instance["InstanceId"] in known:
                        continue
                    tags = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
                    orphans.append({"instance_id": instance["InstanceId"], "deployment": tags.get(TAG),
                                    "instance_type": instance["InstanceType"], "state": instance["State"]["Name"],
                                    "zone": instance["Placement"]["AvailabilityZone"], "terminated": False})
        if terminate and orphans:
            ec2.terminate_instances(InstanceIds=[o["instance_id"] for o in orphans])
            for orphan in orphans:
                orphan["terminated"] = True
        return orphans


def _attempts_text(attempts: list[Attempt]) -> str:
    return "; ".join(f"{a.zone} ({a.market}): {'ok' if a.ok else f'{a.error_code}: {a.message}'}" for a in attempts)
