"""The aws target against moto's server on loopback (EC2, SSM and the spot price history speak the
real wire protocol; boto3 reaches them through AWS_ENDPOINT_URL), driven through the MCP SDK's client
as an operator's agent would, and through the library where a test injects capacity errors.

The instance's "server" is a scripted OpenAI-compatible endpoint on loopback (tests/bench_fake_server)
whose address the deployment records, so the boot timeline, /health polling and the benchmark run end
to end; tests/test_deploy_cache.py does the same with a real `gemmax serve` for the compile cache.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import boto3
import pytest
from mcp import Client, StdioServerParameters

from bench_fake_server import FakeServer, Script
from deploy_support import SECRET, inherited_pythonpath, inject_capacity_errors, moto_server
from gemmax.deploy.aws import TAG, AwsSpec, AwsTarget
from gemmax.deploy.errors import DeployError
from gemmax.deploy.registry import Registry
from gemmax.mcp.server import build_server
from gemmax.rigs.registry import free_port
from gemmax.weights import builtin
from mcp_support import error, ok

pytestmark = pytest.mark.timeout(120)
ZONES = ["us-east-1a", "us-east-1b", "us-east-1c"]


@contextlib.asynccontextmanager
async def serving(app, port: int):
    """`app` under uvicorn on 127.0.0.1:PORT while the block runs."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        await task


@pytest.fixture(scope="module")
def aws(tmp_path_factory):
    with moto_server() as env, pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        state = tmp_path_factory.mktemp("deploy-aws-state")
        mp.setenv("GEMMAX_STATE_DIR", str(state))
        mp.setenv("GEMMAX_DEPLOY_MAX_INSTANCES", "10")
        mp.setenv("GEMMAX_DEPLOY_MAX_INSTANCE_HOURS", "100")
        ec2 = boto3.client("ec2")
        image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        yield SimpleNamespace(env=env, state=state, ec2=ec2, image=image)


def aws_options(aws, **extra) -> dict:
    return {"instance_type": "g6.xlarge", "zones": ZONES, "image_id": aws.image, **extra}


def instance(aws, instance_id: str) -> dict:
    return aws.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]


def tagged(aws, name: str) -> list[dict]:
    reservations = aws.ec2.describe_instances(Filters=[{"Name": f"tag:{TAG}", "Values": [name]}])["Reservations"]
    return [i for r in reservations for i in r["Instances"]]


def test_zone_fallback_boot_timeline_benchmark_terminate(aws):
    """Capacity errors in two zones, the third wins; the instance is tagged, spot, carries the user
    data; the boot is timed to /health 200; the harness runs against it through MCP; terminate pushes
    the cache (SSM) and waits for terminated; the secret is nowhere in what the tools returned."""
    ec2 = boto3.client("ec2")
    asked = inject_capacity_errors(ec2, {"us-east-1a": "InsufficientInstanceCapacity",
                                         "us-east-1b": "SpotMaxPriceTooLow"})
    target = AwsTarget(Registry(aws.state), ec2_client=ec2)
    with FakeServer(Script(ttft=0.01, itl=0.002)).in_thread() as fake:
        spec = AwsSpec(instance_type="g6.xlarge", zones=ZONES, image_id=aws.image, endpoint=fake.base_url)
        record = target.launch("l4-spot", spec, model="google/gemma-3-270m", cache_url="s3://gemmax-cache/g6.tar.gz",
                               serve_args=["--max-batch", "4"], timeout_s=60)
        assert asked == ZONES
        attempts = [(a.zone, a.ok, a.error_code) for a in record.aws.attempts]
        assert attempts == [("us-east-1a", False, "InsufficientInstanceCapacity"),
                            ("us-east-1b", False, "SpotMaxPriceTooLow"), ("us-east-1c", True, None)]
        assert record.state == "ready" and record.aws.zone == "us-east-1c" and record.base_url == fake.base_url
        t = record.timeline
        assert t["requested"] == 0.0 <= t["running"] <= t["reachable"] <= t["healthy"]
        assert record.aws.price_source.startswith("spot price history, us-east-1c")
        assert record.aws.price_per_hour is not None and record.aws.price_per_hour > 0

        ec2_view = instance(aws, record.aws.instance_id)
        assert ec2_view["State"]["Name"] == "running" and ec2_view["InstanceLifecycle"] == "spot"
        assert ec2_view["Placement"]["AvailabilityZone"] == "us-east-1c"
        assert {"Key": TAG, "Value": "l4-spot"} in ec2_view["Tags"]
        volume_ids = [m["Ebs"]["VolumeId"] for m in ec2_view["BlockDeviceMappings"]]
        for volume in aws.ec2.describe_volumes(VolumeIds=volume_ids)["Volumes"]:
            assert {"Key": TAG, "Value": "l4-spot"} in volume["Tags"]
        script = base64.b64decode(aws.ec2.describe_instance_attribute(
            InstanceId=record.aws.instance_id, Attribute="userData")["UserData"]["Value"]).decode()
        assert "gemmax cache import s3://gemmax-cache/g6.tar.gz" in script
        assert "ExecStopPost=-/opt/gemmax/bin/gemmax cache export s3://gemmax-cache/g6.tar.gz" in script
        assert "ExecStartPre=/opt/gemmax/bin/gemmax policy" in script  # the device policy, logged first
        assert "serve --host 0.0.0.0 --port 8000 --model google/gemma-3-270m --max-batch 4" in script
        assert "systemctl enable --now gemmax.service" in script and SECRET not in script
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # it parses

        outputs = []

        async def tools():
            async with Client(build_server()) as client:
                async def call(tool, **arguments):
                    result = ok(await client.call_tool(tool, arguments))
                    outputs.append(json.dumps(result))
                    return result

                status = await call("deploy_status", name="l4-spot")
                assert status["instance_state"] == "running" and status["health_status"] == 200
                assert status["deployment"]["timeline"]["healthy"] == t["healthy"]
                assert "api_key" not in status["deployment"]
                bench = await call("deploy_benchmark", name="l4-spot", input_lens=[8], output_len=4, repeats=1)
                (cell,) = bench["cells"]
                assert (cell["completed"], cell["failed"]) == (1, 0) and cell["decode_tok_s"] > 0
                assert json.loads(Path(bench["path"]).read_text())["config"]["price_per_hour"] == record.aws.price_per_hour
                cost = await call("deploy_cost", name="l4-spot")
                (row,) = cost["deployments"]
                assert row["gpu"] == "NVIDIA L4 24 GB"
                assert row["market"] == "spot" and row["cost_usd"] == pytest.approx(
                    row["instance_hours"] * record.aws.price_per_hour, abs=1e-4)
                console = await call("deploy_logs", name="l4-spot", tail=5)
                assert isinstance(console["result"], list) and 0 < len(console["result"]) <= 5
                listed = await call("deploy_list")
                assert [r["name"] for r in listed["remote"]] == ["l4-spot"]
                done = await call("deploy_terminate", name="l4-spot")
                return done

        import anyio

        done = anyio.run(tools)
    assert done["deployment"]["state"] == "terminated" and "terminated" in done["deployment"]["timeline"]
    assert done["cache_push"]["method"] == "ssm"
    assert instance(aws, record.aws.instance_id)["State"]["Name"] == "terminated"
    (command,) = boto3.client("ssm").list_commands(InstanceId=record.aws.instance_id)["Commands"]
    assert command["Parameters"]["commands"] == [
        "GEMMAX_COMPILE_CACHE=/var/cache/gemmax /opt/gemmax/bin/gemmax cache export s3://gemmax-cache/g6.tar.gz"]
    for text in [*outputs, (aws.state / "remote.json").read_text()]:
        assert SECRET not in text and "AKIATESTGEMMAX" not in text


def test_no_capacity_in_any_zone_is_reported_per_zone(aws):
    ec2 = boto3.client("ec2")
    inject_capacity_errors(ec2, {z: "InsufficientInstanceCapacity" for z in ZONES[:2]})
    registry = Registry(aws.state)
    with pytest.raises(DeployError) as raised:
        spec = AwsSpec(instance_type="g4dn.xlarge", zones=ZONES[:2], image_id=aws.image, market="on-demand")
        AwsTarget(registry, ec2_client=ec2).launch("t4-none", spec, model="m")
    message = str(raised.value)
    assert "no on-demand capacity for g4dn.xlarge in us-east-1a, us-east-1b" in message
    assert message.count("InsufficientInstanceCapacity") == 2
    record = registry.get("t4-none")
    assert record.state == "failed" and [a.zone for a in record.aws.attempts] == ZONES[:2]
    assert record.aws.instance_id is None and tagged(aws, "t4-none") == []
    with pytest.raises(DeployError, match="'t4-none' has no instance"):
        AwsTarget(registry, ec2_client=ec2).console(record, 10)


async def test_guard_rails_refuse_with_the_arithmetic(aws):
    async with Client(build_server()) as client:
        live = ok(await client.call_tool("deploy_launch", {
            "target": "aws", "name": "cap-live", "model": "m", "wait": False,
            "aws": aws_options(aws, endpoint=f"http://127.0.0.1:{free_port()}", planned_hours=2.0)}))
        assert live["remote"]["state"] == "booting"
        refused = error(await client.call_tool("deploy_launch", {
            "target": "aws", "name": "cap-2", "model": "m", "aws": aws_options(aws, max_instances=1)}))
        assert "launch refused: 1 instance(s) live (cap-live) + 1 requested = 2 > cap of 1 concurrent" in refused
        refused = error(await client.call_tool("deploy_launch", {
            "target": "aws", "name": "cap-3", "model": "m",
            "aws": aws_options(aws, planned_hours=3.0, max_instance_hours=4.0)}))
        numbers = re.search(r"([\d.]+) h used by ended deployments \(30 days\) \+ ([\d.]+) h allowed to 1 live \+ "
                            r"3\.00 h requested = ([\d.]+) instance-hours > cap of 4\.00", refused)
        assert numbers, refused
        ended, committed, total = map(float, numbers.groups())
        assert committed == 2.0 and total == pytest.approx(ended + committed + 3.0, abs=0.011)
        names = [r["name"] for r in ok(await client.call_tool("deploy_list", {}))["remote"]]
        assert "cap-2" not in names and "cap-3" not in names  # refused before anything was recorded
        assert len(tagged(aws, "cap-2") + tagged(aws, "cap-3")) == 0
        ok(await client.call_tool("deploy_terminate", {"name": "cap-live", "push_cache": False}))


async def test_never_reachable_times_out_is_terminated_and_failed(aws):
    async with Client(build_server()) as client:
        message = error(await client.call_tool("deploy_launch", {
            "target": "aws", "name": "dark", "model": "m", "timeout_s": 3,
            "aws": aws_options(aws, endpoint=f"http://127.0.0.1:{free_port()}")}))
        assert "deployment 'dark' failed:" in message and "not healthy after" in message
        assert "last: no TCP connection" in message and "was terminated" in message
        status = ok(await client.call_tool("deploy_status", {"name": "dark"}))
    record = status["deployment"]
    assert record["state"] == "failed" and "not healthy after" in record["error"]
    assert "reachable" not in record["timeline"] and "terminated" in record["timeline"]
    assert status["instance_state"] == "terminated"
    (only,) = tagged(aws, "dark")
    assert only["State"]["Name"] == "terminated"


async def test_restarted_server_lists_and_terminates_a_booting_deployment(aws):
    """A launch left booting by one MCP server (no wait) is listed by a fresh server process, whose
    status call completes the boot timeline once /health answers, and which terminates it."""
    port = free_port()  # nothing answers there while the first server launches
    async with Client(build_server()) as first:
        started = ok(await first.call_tool("deploy_launch", {
            "target": "aws", "name": "midway", "model": "m", "wait": False,
            "aws": aws_options(aws, endpoint=f"http://127.0.0.1:{port}")}))
    assert started["remote"]["state"] == "booting" and "reachable" not in started["remote"]["timeline"]
    instance_id = started["remote"]["aws"]["instance_id"]
    params = StdioServerParameters(command=sys.executable, args=["-m", "gemmax.cli", "mcp"],
                                   env={**aws.env, "GEMMAX_STATE_DIR": str(aws.state), **inherited_pythonpath()})
    async with Client(params) as second:
        listed = {r["name"]: r for r in ok(await second.call_tool("deploy_list", {}))["remote"]}
        assert listed["midway"]["state"] == "booting" and listed["midway"]["aws"]["instance_id"] == instance_id
        async with serving(FakeServer(Script()).app, port):  # the instance's server comes up
            status = ok(await second.call_tool("deploy_status", {"name": "midway"}))
        assert status["health_status"] == 200 and status["deployment"]["state"] == "ready"
        t = status["deployment"]["timeline"]
        assert t["running"] <= t["reachable"] <= t["healthy"]
        done = ok(await second.call_tool("deploy_terminate", {"name": "midway"}))
    assert done["deployment"]["state"] == "terminated"
    assert done["cache_push"] is None  # no cache URL: nothing to push
    assert instance(aws, instance_id)["State"]["Name"] == "terminated"


async def test_cleanup_terminates_orphans_only(aws):
    orphan = aws.ec2.run_instances(ImageId=aws.image, InstanceType="g4dn.xlarge", MinCount=1, MaxCount=1,
                                   TagSpecifications=[{"ResourceType": "instance",
                                                       "Tags": [{"Key": TAG, "Value": "lost"}]}])["Instances"][0]
    untagged = aws.ec2.run_instances(ImageId=aws.image, InstanceType="t3.micro", MinCount=1, MaxCount=1)["Instances"][0]
    async with Client(build_server()) as client:
        kept = ok(await client.call_tool("deploy_launch", {
            "target": "aws", "name": "kept", "model": "m", "wait": False,
            "aws": aws_options(aws, endpoint=f"http://127.0.0.1:{free_port()}")}))["remote"]["aws"]["instance_id"]
        seen = ok(await client.call_tool("deploy_cleanup", {"dry_run": True}))["orphans"]
        assert [(o["instance_id"], o["deployment"], o["terminated"]) for o in seen] == [
            (orphan["InstanceId"], "lost", False)]
        assert instance(aws, orphan["InstanceId"])["State"]["Name"] == "running"
        done = ok(await client.call_tool("deploy_cleanup", {}))["orphans"]
        assert [(o["instance_id"], o["terminated"]) for o in done] == [(orphan["InstanceId"], True)]
        ok(await client.call_tool("deploy_terminate", {"name": "kept"}))
    assert instance(aws, orphan["InstanceId"])["State"]["Name"] == "terminated"
    assert instance(aws, untagged["InstanceId"])["State"]["Name"] == "running"  # not ours: left alone
    assert instance(aws, kept)["State"]["Name"] == "terminated"


def test_cli_deploy_list_and_cost(aws):
    from typer.testing import CliRunner

    from gemmax.cli import app

    runner = CliRunner()
    launched = runner.invoke(app, ["deploy", "launch", "from-cli", "--target", "aws", "--instance-type", "g4dn.xlarge",
                                   "--zone", "us-east-1d", "--image-id", aws.image, "--on-demand", "--no-wait",
                                   "--endpoint", f"http://127.0.0.1:{free_port()}"])
    assert launched.exit_code == 0, launched.output
    record = json.loads(launched.stdout)["remote"]
    assert (record["model"], record["aws"]["market"], record["aws"]["zone"]) == ("builtin", "on-demand", "us-east-1d")
    assert record["aws"]["price_per_hour"] == 0.526 and "api_key" not in record
    terminated = runner.invoke(app, ["deploy", "terminate", "from-cli", "--no-push"])
    assert json.loads(terminated.stdout)["deployment"]["state"] == "terminated"
    assert instance(aws, record["aws"]["instance_id"])["State"]["Name"] == "terminated"
    listed = runner.invoke(app, ["deploy", "list"])
    assert listed.exit_code == 0, listed.output
    names = {r["name"]: r["state"] for r in json.loads(listed.stdout)["remote"]}
    assert names["from-cli"] == "terminated"
    cost = json.loads(runner.invoke(app, ["deploy", "cost"]).stdout)
    assert cost["instance_hours"] == pytest.approx(sum(r["instance_hours"] for r in cost["deployments"]), abs=1e-3)
    missing = runner.invoke(app, ["deploy", "status", "ghost"])
    assert missing.exit_code == 1 and "no remote deployment named 'ghost'" in missing.stderr
    # a refused option or a model that is not there: one line, no traceback
    for args, reason in ((["--zone", "us-east-1a", "--image-id", aws.image, "--hours", "0"], "planned_hours"),
                         (["--target", "local", "--model", "/no/such/model"], "model '/no/such/model' not found")):
        refused = runner.invoke(app, ["deploy", "launch", "refused", *args])
        assert refused.exit_code == 1 and refused.stderr.startswith("error: ") and reason in refused.stderr
        assert "Traceback" not in refused.output


async def test_local_target_is_the_local_manager(aws, tmp_path):
    """deploy_launch with target local starts a managed process here (the local manager's), listed
    beside the remote ones and stopped by stop_deployment. Whether it loads is test_mcp's business:
    the directory here is empty, so the server may exit before the stop."""
    model = tmp_path
    async with Client(build_server()) as client:
        started = ok(await client.call_tool("deploy_launch", {
            "target": "local", "name": "here", "model": str(model), "port": free_port(), "wait": False}))
        assert started["target"] == "local" and started["remote"] is None
        assert started["local"]["deployment"]["name"] == "here" and started["local"]["deployment"]["rig"] == "gemmax"
        listed = ok(await client.call_tool("deploy_list", {}))
        assert [d["deployment"]["name"] for d in listed["local"]] == ["here"]
        assert "here" not in [r["name"] for r in listed["remote"]]
        refused = error(await client.call_tool("deploy_launch", {
            "target": "local", "name": "there", "model": str(model), "cache_url": "s3://b/k"}))
        assert "serve_args, cache_url, aws and ssh are for remote targets" in refused
        stopped = ok(await client.call_tool("stop_deployment", {"name": "here", "timeout_s": 10}))
        assert stopped["name"] == "here" and ok(await client.call_tool("deploy_list", {}))["local"] == []
        # the default model, "builtin", is the built-in model's converted directory here
        started = ok(await client.call_tool("deploy_launch", {"target": "local", "name": "own", "port": free_port(),
                                                               "wait": False}))
        assert started["local"]["deployment"]["model"] == str(builtin.default_model_path())
        ok(await client.call_tool("stop_deployment", {"name": "own", "timeout_s": 10}))


async def test_missing_credentials_are_a_clear_error(aws, monkeypatch, tmp_path):
    """Credentials come only from boto3's chain; with none anywhere the tools say so (the instance
    metadata service is off in these tests, so the chain's last step stays on this machine)."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    async with Client(build_server()) as client:
        message = error(await client.call_tool("deploy_cleanup", {}))
        assert "AWS: NoCredentialsError: Unable to locate credentials" in message and "aws sso login" in message
        message = error(await client.call_tool("deploy_launch", {
            "target": "aws", "name": "nocreds", "model": "m", "aws": aws_options(aws)}))
        assert "NoCredentialsError" in message
        listed = {r["name"]: r for r in ok(await client.call_tool("deploy_list", {}))["remote"]}
    assert listed["nocreds"]["state"] == "failed" and listed["nocreds"]["aws"]["instance_id"] is None


def test_an_instance_ended_outside_gemmax_ends_its_record_and_a_relaunch_keeps_its_hours(aws, tmp_path):
    """A spot interruption (an instance terminated outside gemmax) ends its record when the next launch,
    a status or a terminate sees it, at EC2's time, freeing its cap slot and stopping its hours; an
    instance EC2 has forgotten is ended by terminate instead of failing it; a new launch under an ended
    name keeps the ended record (NAME@CREATED), whose hours still count in cost and the caps."""
    from gemmax.deploy import cost
    from gemmax.deploy.registry import archived_key
    from gemmax.deploy.service import Deployer

    deployer = Deployer(tmp_path)  # a registry of its own: the caps below count this test's records only
    spec = AwsSpec(**aws_options(aws, endpoint=f"http://127.0.0.1:{free_port()}"))
    one = cost.Caps(max_instances=1, max_instance_hours=100)
    first = deployer.launch_aws("gone", spec, model="m", caps=one, wait=False)
    aws.ec2.terminate_instances(InstanceIds=[first.aws.instance_id])  # as a spot interruption does
    second = deployer.launch_aws("next", spec, model="m", caps=one, wait=False)  # its slot is free
    ended = deployer.registry.get("gone")
    assert ended.state == "terminated" and ended.timeline["ended_outside_reason"].startswith("terminated")
    assert first.created <= ended.ended <= second.created + 1
    assert deployer.status("gone").deployment.ended == ended.ended  # ended once, not again at each look
    # a launch still waiting when another process ended it cannot mark it ready again
    assert deployer.registry.update("gone", state="ready", ended=None).state == "terminated"
    assert deployer.registry.get("gone").ended == ended.ended

    # an id EC2 does not know yet (for seconds after RunInstances) is not taken for a gone instance
    forged = second.aws.model_copy(update={"instance_id": "i-0123456789abcdef0"})
    deployer.registry.update("next", aws=forged, timeline={"requested": 0.0})
    assert deployer.status("next").deployment.state == "booting"
    # EC2 no longer knows an instance it had running: terminate ends the record
    deployer.registry.update("next", timeline=second.timeline)
    done = deployer.terminate("next").deployment
    assert done.state == "terminated" and done.timeline["ended_outside_reason"] == "unknown to EC2"
    aws.ec2.terminate_instances(InstanceIds=[second.aws.instance_id])

    # a relaunch of "gone" after it ran (as recorded) three hours: those hours stay counted
    deployer.registry.update("gone", created=ended.ended - 3 * 3600)
    hours = deployer.cost()["instance_hours"]
    assert hours == pytest.approx(3.0, abs=0.01)
    again = deployer.launch_aws("gone", spec, model="m", caps=one, wait=False)
    key = archived_key(ended.model_copy(update={"created": ended.ended - 3 * 3600}))
    kept = deployer.registry.get(key)
    assert kept.state == "terminated" and kept.hours() == pytest.approx(3.0, abs=0.01) and kept.archived_as == key
    assert deployer.status(key).deployment.archived_as == key  # listed with its key, and looked up by it
    assert deployer.cost()["instance_hours"] >= hours
    deployer.terminate("gone", push_cache=False)
    assert again.aws.instance_id != first.aws.instance_id
    with pytest.raises(DeployError, match=r"([\d.]+) h used by ended deployments"):
        deployer.launch_aws("gone", spec, model="m", caps=cost.Caps(max_instances=1, max_instance_hours=3.5),
                            wait=False)


def test_user_data_keeps_quotes_percent_and_dollar_signs_intact():
    """A cache URL or serve argument holding ', % or $ leaves the boot script valid bash, and the unit's
    Exec lines give systemd's word splitting the original words once it has undone its `%%` and `$$`
    (a lone % is a systemd specifier, a lone $ a variable: systemd would rewrite or drop the line)."""
    from gemmax.deploy.userdata import user_data

    url = "s3://bucket/it's g6%2Dcache$HOME.tar.gz"
    script = user_data(model="builtin", port=8000, package="gemmax", cache_url=url,
                       serve_args=["--served-model-name", "50%$off\\b"])
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    restore = next(line for line in script.splitlines() if " cache import " in line)
    echoed = subprocess.run(["bash", "-c", restore.split("|| ", 1)[1]], capture_output=True, text=True, check=True)
    assert echoed.stdout == f"no compile cache at {url} yet\n"
    unit = script.split("<<'UNIT'\n", 1)[1].split("\nUNIT\n", 1)[0]
    execs = dict(line.split("=", 1) for line in unit.splitlines() if line.startswith("Exec"))
    for value in execs.values():
        assert not re.search(r"(?<!%)%(?:%%)*(?!%)|(?<!\$)\$(?:\$\$)*(?!\$)", value), value  # every % and $ doubled

    def systemd_words(value: str) -> list[str]:  # systemd: specifiers, variables, then C escapes in quotes
        value = value.removeprefix("-").replace("%%", "%").replace("$$", "$")
        return [word.replace("\\\\", "\\") for word in shlex.split(value)]

    assert systemd_words(execs["ExecStopPost"]) == ["/opt/gemmax/bin/gemmax", "cache", "export", url]
    assert systemd_words(execs["ExecStart"])[-2:] == ["--served-model-name", "50%$off\\b"]


def test_ec2_transition_times_are_read_as_utc(monkeypatch):
    """EC2's StateTransitionReason carries the time an instance ended in GMT (moto writes UTC): read
    as UTC whatever the local time zone."""
    import time as time_module

    from gemmax.deploy.aws import _transition_time

    monkeypatch.setenv("TZ", "America/New_York")
    time_module.tzset()
    try:
        for zone in ("GMT", "UTC"):
            assert _transition_time(f"User initiated (2026-12-07 21:00:00 {zone})") == 1796677200
        assert _transition_time("Server.SpotInstanceTermination") is None and _transition_time("") is None
    finally:
        monkeypatch.undo()
        time_module.tzset()
