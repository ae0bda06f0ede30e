"""`gemmax mcp` driven by the MCP SDK's own client, in-process and over stdio (and streamable HTTP):
the tool list and schemas; a gemmax deployment of a tiny random checkpoint started, queried, swept,
inspected and stopped; a second server process that sees and stops what the first started; a
killed deployment reported dead; the transformers rig started and stopped the same way; the device
check, the memory plan and the compile cache; bad arguments answered with clear tool errors.

One gemmax deployment serves the whole module (`gemmax_deployment`), and the stdio test that stops it
runs after the tests that use it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import psutil
import pytest
from mcp import Client, StdioServerParameters

import gemmax
from gemmax.mcp import server as ops
from gemmax.mcp.server import build_server
from gemmax.rigs.registry import free_port
from mcp_support import error, ok
from tiny_checkpoint import write_tiny_checkpoint

TOOLS = {"list_rigs", "start_deployment", "stop_deployment", "list_deployments", "deployment_status",
         "deployment_logs", "verify_device", "fit_check", "query_model", "run_sweep", "compare_results",
         "profile_decode", "compile_cache_export", "compile_cache_import", "deploy_launch", "deploy_list",
         "deploy_status", "deploy_logs", "deploy_benchmark", "deploy_cache_push", "deploy_cache_restore",
         "deploy_terminate", "deploy_cleanup", "deploy_cost"}
GEMMAX_OPTIONS = {"dtype": "float32", "max_model_len": 128, "max_batch": 2, "timeout_s": 400}
KEY = "mcp-test-key"  # the module's gemmax deployment requires it: query_model and run_sweep must send it



async def call(tool: str, **arguments) -> object:
    async with Client(build_server()) as client:
        return await client.call_tool(tool, arguments)


def deployment_names(listed: dict) -> list[str]:
    """The names in a `list_deployments` result."""
    return [status["deployment"]["name"] for status in listed["result"]]


def stdio_params(state: Path) -> StdioServerParameters:
    """A second server process, as an MCP client would launch it (it gets only the variables below plus
    the SDK's safe defaults: PATH, HOME, ...)."""
    return StdioServerParameters(command=sys.executable, args=["-m", "gemmax.cli", "mcp"],
                                 env={"GEMMAX_STATE_DIR": str(state)})


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    """A private registry for this module; whatever a failed test left running is stopped at the end."""
    root = tmp_path_factory.mktemp("mcp-state")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEMMAX_STATE_DIR", str(root))
        yield root
        for status in ops.deployments().statuses():
            ops.deployments().stop(status.deployment.name, timeout_s=10)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("mcp-tiny") / "ckpt")


@pytest.fixture(scope="module")
def gemmax_deployment(state, checkpoint) -> dict:
    """`start_deployment` of the gemmax rig, waited until /health is 200 (the structured result)."""
    port = free_port()
    result = anyio.run(lambda: call("start_deployment", rig="gemmax", model=str(checkpoint), port=port,
                                    options={**GEMMAX_OPTIONS, "api_key": KEY}))
    return ok(result)


async def test_lists_tools_with_schemas(state):
    async with Client(build_server()) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == TOOLS
    for name, tool in tools.items():
        assert tool.description == inspect.cleandoc({fn.__name__: fn for fn in ops.TOOLS}[name].__doc__)
        assert tool.output_schema is not None, name
    start = tools["start_deployment"].input_schema
    assert start["required"] == ["rig", "model", "port"]
    assert (start["properties"]["port"]["minimum"], start["properties"]["port"]["maximum"]) == (1, 65535)
    options = start["$defs"]["DeploymentOptions"]["properties"]
    assert {"host", "dtype", "max_model_len", "max_batch", "name", "wait", "timeout_s"} <= set(options)
    assert tools["deployment_status"].output_schema["properties"]["state"]["enum"] == [
        "ready", "loading", "unreachable", "dead"]
    assert tools["verify_device"].input_schema["properties"]["dtype"]["enum"] == [
        "auto", "float32", "bfloat16", "float16"]
    rigs = ok(await call("list_rigs"))["result"]
    assert [r["name"] for r in rigs] == ["gemmax", "transformers", "vllm"]
    assert rigs[0]["available"] and rigs[1]["available"]  # torch + transformers are test dependencies


async def test_gemmax_deployment_query_sweep_status_logs(gemmax_deployment, checkpoint, state):
    started = gemmax_deployment
    name, port = started["deployment"]["name"], started["deployment"]["port"]
    assert started["state"] == "ready" and name == f"gemmax-{port}"
    assert started["deployment"]["model"] == str(checkpoint)
    assert started["deployment"]["command"][-6:] == ["--dtype", "float32", "--max-model-len", "128", "--max-batch", "2"]

    async with Client(build_server()) as client:
        status = ok(await client.call_tool("deployment_status", {"name": name}))
        assert status["state"] == "ready" and status["health_status"] == 200 and status["uptime_s"] > 0
        assert status["version"] == gemmax.__version__
        assert status["policy"]["platform"] == "cpu"
        assert status["precision"]["weights"] == "float32" and status["precision"]["kv_cache"] == "float32"
        assert status["weight_bytes"] == status["health"]["weight_bytes"] > 0

        query = ok(await client.call_tool("query_model", {"deployment": name, "prompt": "Hello world",
                                                          "max_tokens": 8}))
        assert query["endpoint"] == "/v1/completions" and query["model"] == str(checkpoint)
        assert 1 <= query["usage"]["completion_tokens"] <= 8 and query["finish_reason"] in ("stop", "length")
        assert isinstance(query["degeneracy"]["degenerate"], bool)
        # the counter moves by exactly this response's verdict
        assert query["degenerate_responses_delta"] == (1.0 if query["degeneracy"]["degenerate"] else 0.0)
        # the same request straight over HTTP gives the same greedy text, with the key the tool sent
        body = {"prompt": "Hello world", "max_tokens": 8, "temperature": 0}
        assert httpx.post(f"{status['base_url']}/v1/completions", timeout=60, json=body).status_code == 401
        direct = httpx.post(f"{status['base_url']}/v1/completions", timeout=60, json=body,
                            headers={"Authorization": f"Bearer {KEY}"}).json()
        assert query["text"] == direct["choices"][0]["text"]

        chat = ok(await client.call_tool("query_model", {"deployment": name, "prompt": "Hi", "max_tokens": 4,
                                                         "chat": True}))
        assert chat["endpoint"] == "/v1/chat/completions" and chat["usage"]["completion_tokens"] <= 4

        out = state / "sweep.json"
        sweep = ok(await client.call_tool("run_sweep", {
            "deployment": name, "input_lens": [16], "output_len": 4, "repeats": 1, "concurrency": [1],
            "out": str(out)}))
        assert sweep["path"] == str(out) and sweep["label"] == name and sweep["forced_output"] is True
        (cell,) = sweep["cells"]
        assert (cell["input_len"], cell["concurrency"], cell["completed"], cell["failed"]) == (16, 1, 1, 0)
        assert cell["decode_tok_s"] > 0 and sweep["flags"] == []
        written = json.loads(out.read_text())
        assert written["schema"] == "gemmax-bench/1" and written["cells"][0]["output_len_verified"] is True

        compared = ok(await client.call_tool("compare_results", {"files": [str(out), str(out)]}))
        assert len(compared["rows"]) == 1 and compared["rows"][0][:3] == ["16", "4", "c=1"]
        assert f"{name} #2/{name} #1 tok/s" in compared["columns"]
        assert compared["markdown"].startswith("| input | output | load |")

        logs = ok(await client.call_tool("deployment_logs", {"name": name, "tail": 1000}))
        assert logs["log"] == started["deployment"]["log"]
        assert any("gemmax device policy: platform=cpu" in line for line in logs["lines"])
        assert any("warm-up:" in line for line in logs["lines"])
        assert len(ok(await client.call_tool("deployment_logs", {"name": name, "tail": 3}))["lines"]) == 3

        # a second start on the same port names the deployment that holds it
        busy = error(await client.call_tool("start_deployment", {"rig": "gemmax", "model": str(checkpoint),
                                                                 "port": port}))
        assert f"deployment {name!r}" in busy and f"runs on port {port}" in busy


async def test_bad_arguments_are_tool_errors(state, checkpoint, tmp_path):
    refused = []
    async with Client(build_server()) as client:
        async def start(**arguments) -> str:
            refused.append(arguments["port"])
            return error(await client.call_tool("start_deployment", arguments))

        assert "unknown rig 'tgi'; known: gemmax, transformers, vllm" in await start(
            rig="tgi", model=str(checkpoint), port=free_port())
        assert "model '/no/such/checkpoint' not found" in await start(
            rig="gemmax", model="/no/such/checkpoint", port=free_port())
        assert "less than or equal to 65535" in await start(rig="gemmax", model=str(checkpoint), port=70000)
        assert "deployment name '../x'" in await start(rig="gemmax", model=str(checkpoint), port=free_port(),
                                                       options={"name": "../x"})
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            busy = listener.getsockname()[1]
            assert f"port {busy} on 127.0.0.1 is busy" in await start(rig="gemmax", model=str(checkpoint), port=busy)
        assert "no deployment named 'ghost'" in error(await client.call_tool("stop_deployment", {"name": "ghost"}))
        assert "no deployment named 'ghost'" in error(await client.call_tool("deployment_logs", {"name": "ghost"}))
        assert "no deployment named 'ghost'" in error(await client.call_tool("query_model", {
            "deployment": "ghost", "prompt": "x"}))
        not_a_run = state / "other.json"
        not_a_run.write_text(json.dumps({"schema": "something-else"}))
        assert "is not a gemmax bench result" in error(await client.call_tool("compare_results", {
            "files": [str(not_a_run), str(not_a_run)]}))
        assert "no compilation cache at" in error(await client.call_tool("compile_cache_export", {
            "dest": str(state / "c.tar.gz"), "cache_dir": str(state / "missing")}))
        # nothing was recorded by the refused starts
        recorded = ok(await client.call_tool("list_deployments", {}))["result"]
        assert all(d["deployment"]["port"] not in refused for d in recorded)

async def test_second_server_over_stdio_sees_killed_and_stops(gemmax_deployment, state, checkpoint):
    """A deployment started without waiting and then SIGKILLed is dead for the server that started
    it (its parent) and for a second server process; the second server also stops the running one."""
    running = gemmax_deployment["deployment"]["name"]
    port = free_port()
    started = ok(await call("start_deployment", rig="gemmax", model=str(checkpoint), port=port,
                            options={"wait": False, "name": "doomed"}))
    assert started["state"] in ("unreachable", "loading")
    os.kill(started["deployment"]["pid"], signal.SIGKILL)
    with anyio.fail_after(30):
        while (status := ok(await call("deployment_status", name="doomed")))["state"] != "dead":
            await anyio.sleep(0.2)
    assert status["exit_code"] == -signal.SIGKILL  # known here: this process is its parent

    async with Client(stdio_params(state)) as second:
        listed = {d["deployment"]["name"]: d for d in ok(await second.call_tool("list_deployments", {}))["result"]}
        assert set(listed) == {running, "doomed"}
        assert listed[running]["state"] == "ready" and listed["doomed"]["state"] == "dead"
        assert listed["doomed"]["exit_code"] is None  # not its child: the status is unknown there
        logs = ok(await second.call_tool("deployment_logs", {"name": running, "tail": 1000}))["lines"]
        assert any("gemmax device policy" in line for line in logs)

        gone = ok(await second.call_tool("stop_deployment", {"name": "doomed"}))
        assert (gone["state_before"], gone["how"]) == ("dead", "already dead")
        stopped = ok(await second.call_tool("stop_deployment", {"name": running}))
        assert (stopped["state_before"], stopped["how"]) == ("ready", "sigterm")
        assert "Application shutdown complete" in Path(stopped["log"]).read_text()  # drained, not killed
        assert ok(await second.call_tool("list_deployments", {}))["result"] == []

    assert ok(await call("list_deployments"))["result"] == []  # the first server reads the same registry
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{gemmax_deployment['base_url']}/health", timeout=2)


async def test_transformers_rig_start_query_stop(state, checkpoint):
    port = free_port()
    async with Client(build_server()) as client:
        started = ok(await client.call_tool("start_deployment", {
            "rig": "transformers", "model": str(checkpoint), "port": port,
            "options": {"dtype": "float32", "timeout_s": 300}}))
        name = started["deployment"]["name"]
        assert name == f"transformers-{port}" and started["state"] == "ready"
        assert started["deployment"]["command"][3:5] == ["rig", "transformers"]
        assert started["precision"] == {"weights": "float32", "activations": "float32", "kv_cache": "float32"}
        query = ok(await client.call_tool("query_model", {"deployment": name, "prompt": "Hello world",
                                                          "max_tokens": 4}))
        assert 1 <= query["usage"]["completion_tokens"] <= 4
        assert query["degeneracy"] is None and query["degenerate_responses_delta"] is None  # no such figures
        stopped = ok(await client.call_tool("stop_deployment", {"name": name}))
        assert (stopped["state_before"], stopped["how"]) == ("ready", "sigterm")
        # exited on the SIGTERM (uvicorn shuts down, then re-raises the signal it caught)
        assert stopped["exit_code"] in (0, -signal.SIGTERM)
        # gone from the registry (the module's gemmax deployment may still be listed: under `pytest -n`
        # without loadfile this test can run while it lives)
        assert name not in deployment_names(ok(await client.call_tool("list_deployments", {})))


def test_a_child_that_exits_just_after_a_wait_timed_out_keeps_its_exit_status(monkeypatch):
    """The race behind a stop that returned exit_code None: the deployment exited between a wait that
    timed out and the zombie check; it must be reaped with its status, not counted as another's zombie."""
    from gemmax.mcp import deployments

    # a child without a Popen object, so only psutil reaps it
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", "raise SystemExit(3)"], os.environ)
    proc = psutil.Process(pid)
    deadline = time.monotonic() + 30
    while proc.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.status() == psutil.STATUS_ZOMBIE
    real_wait_procs = psutil.wait_procs
    waits: list[float | None] = []

    def first_wait_times_out(procs, timeout=None):
        waits.append(timeout)
        return ([], list(procs)) if len(waits) == 1 else real_wait_procs(procs, timeout=timeout)

    monkeypatch.setattr(psutil, "wait_procs", first_wait_times_out)
    exited, alive = deployments._wait_exited([proc], 5.0)
    assert (exited, alive) == ([proc], [])
    assert getattr(exited[0], "returncode", None) == 3  # set only where psutil reaped it


async def test_stop_keeps_the_exit_status_when_a_status_reaped_the_deployment_first(state, checkpoint,
                                                                                     monkeypatch):
    """The other way a stop lost the status: a concurrent `deployment_status` of the same server polls
    the deployment's Popen, which reaps it once the SIGTERM ended it, before psutil's wait does; psutil
    then reads no status, and the stop must take the Popen's."""
    started = ok(await call("start_deployment", rig="gemmax", model=str(checkpoint), port=free_port(),
                            options={"wait": False, "name": "reaped-first"}))
    registry = ops.deployments()
    with registry._lock:
        child = registry._children[started["deployment"]["pid"]]
    real_wait_procs = psutil.wait_procs

    def popen_reaps_first(procs, timeout=None):
        child.wait(30)  # as the concurrent status's poll would, once the process ended
        return real_wait_procs(procs, timeout=timeout)

    monkeypatch.setattr(psutil, "wait_procs", popen_reaps_first)
    stopped = ok(await call("stop_deployment", name="reaped-first"))
    assert stopped["how"] == "sigterm" and stopped["exit_code"] in (0, -signal.SIGTERM)


async def test_verify_device_and_fit_check(state, checkpoint):
    from gemmax.engine.memory import GiB, plan_memory
    from gemmax.engine.policy import DTYPES, device_policy
    from gemmax.weights.load import open_source

    policy = device_policy("auto")
    async with Client(build_server()) as client:
        report = ok(await client.call_tool("verify_device", {}))
        assert report["ok"] and report["platform"] == policy.platform == "cpu"
        assert report["policy"] == policy.as_dict()
        assert [c["name"] for c in report["checks"]] == ["decode_row", "batch_rows", "large_sums"]
        for check in report["checks"]:
            assert check["finite"] and check["max_rel_error"] <= check["tolerance"]
            assert check["dtypes"] == f"{policy.activations} x {policy.weights}"
        assert report["checks"][2]["max_abs_reference"] > 65504  # past float16's range

        fit = ok(await client.call_tool("fit_check", {"model": str(checkpoint), "max_model_len": 128,
                                                      "max_batch": 2, "device_memory_gib": 1.0}))
        expected = plan_memory(open_source(str(checkpoint), weights=False).config, 128, 2, GiB, weight_dtype=policy.weight_dtype,
                               kv_dtype=DTYPES[policy.kv_cache], activation_dtype=DTYPES[policy.activations],
                               prefill_tokens=policy.prefill_buckets[-1], model=str(checkpoint),
                               prefix_cache_bytes=None)  # fit's default, as serve's
        # the memory plan's own fields, plus `gemmax fit`'s quantisation summary
        assert {k: v for k, v in fit["plan"].items() if k in expected.as_dict()} == expected.as_dict()
        assert fit["fits"] is True and fit["plan"]["quant"] == "none"
        assert fit["plan"]["weight_bytes_by_option"]["none"] == expected.weights
        assert fit["explanation"] == expected.explain()
        plan = fit["plan"]
        assert plan["required"] == plan["weights"] + plan["kv_cache"] + plan["workspace"] + plan["prefix_cache"]

        tight = ok(await client.call_tool("fit_check", {"model": str(checkpoint), "max_model_len": 128,
                                                        "max_batch": 2, "device_memory_gib": 0.0005}))
        assert tight["fits"] is False and "DOES NOT FIT" in tight["explanation"]
        assert "gemmax fit failed" in error(await client.call_tool("fit_check", {"model": "/no/such/model"}))


async def test_profile_decode(state, checkpoint):
    from gemmax.profile.report import load

    out = state / "profile"
    async with Client(build_server()) as client:
        result = ok(await client.call_tool("profile_decode", {
            "model": str(checkpoint), "steps": 2, "warmup": 1, "context": 16, "peak_bandwidth_gbs": 30.0,
            "out": str(out)}))
        assert "gemmax profile failed" in error(await client.call_tool("profile_decode", {
            "model": str(checkpoint), "context": 10**6, "out": str(state / "bad")}))
    assert result["report_path"] == str(out / "profile.json") and result["trace_dir"] == str(out)
    report = result["report"]
    assert report == load(out / "profile.json")
    assert (report["steps"], report["traced_steps_seen"], report["context"]) == (2, 2, 16)
    assert report["peak_bandwidth_gbs"] == 30.0 and report["tokens_per_second"] > 0
    assert report["model"] in result["text"]


async def test_compile_cache_export_import(state, monkeypatch):
    monkeypatch.setenv(ops.ALLOW_URLS_ENV, "1")
    tmp_path = state / "cache-test"
    source = tmp_path / "cache"
    (source / "sub").mkdir(parents=True)
    files = {"a-cache": os.urandom(3000), "sub/b-cache": b"compiled"}
    for rel, data in files.items():
        (source / rel).write_bytes(data)
    async with Client(build_server()) as client:
        for url in (str(tmp_path / "out" / "cache.tar.gz"), "memory://gemmax-test/cache.tar.gz"):
            exported = ok(await client.call_tool("compile_cache_export", {"dest": url, "cache_dir": str(source)}))
            assert exported["bytes_written"] > 0 and exported["cache_dir"] == str(source)
            target = tmp_path / f"restored-{len(url)}"
            imported = ok(await client.call_tool("compile_cache_import", {"src": url, "cache_dir": str(target)}))
            assert imported["files_restored"] == len(files)
            assert {rel: (target / rel).read_bytes() for rel in files} == files


async def test_file_arguments_are_confined_and_urls_are_opt_in(state, checkpoint, tmp_path, monkeypatch):
    """compile_cache_export packed any directory into any file or URL, compile_cache_import unpacked
    anywhere, run_sweep / profile_decode wrote anywhere, compare_results read anything, and
    start_deployment bound 0.0.0.0 without a key: each is refused with a message that says why."""
    monkeypatch.delenv(ops.ALLOW_URLS_ENV, raising=False)
    secret = tmp_path / "ssh"
    secret.mkdir()
    (secret / "authorized_keys").write_text("ssh-ed25519 AAAA original")
    (state / "escape").symlink_to(secret)
    inside_cache = state / "xla-cache"
    inside_cache.mkdir(exist_ok=True)
    (inside_cache / "a-cache").write_bytes(b"compiled")
    outside = "outside gemmax's own directories"
    async with Client(build_server()) as client:
        async def refused(tool: str, **arguments) -> str:
            return error(await client.call_tool(tool, arguments))

        assert outside in await refused("compile_cache_export", dest=str(tmp_path / "out.tar.gz"),
                                        cache_dir=str(inside_cache))
        assert outside in await refused("compile_cache_export", dest=str(state / "ok.tar.gz"), cache_dir=str(secret))
        assert outside in await refused("compile_cache_export", dest=str(state / ".." / "up.tar.gz"),
                                        cache_dir=str(inside_cache))
        assert outside in await refused("compile_cache_export", dest=str(state / "escape" / "authorized_keys"),
                                        cache_dir=str(inside_cache))
        assert "URL destinations are off" in await refused("compile_cache_export", dest="memory://x/c.tar.gz",
                                                           cache_dir=str(inside_cache))
        ok(await client.call_tool("compile_cache_export", {"dest": "c.tar.gz", "cache_dir": str(inside_cache)}))
        assert (state / "c.tar.gz").is_file()  # a relative path lands in the state directory
        assert outside in await refused("compile_cache_import", src="c.tar.gz", cache_dir=str(secret))
        assert outside in await refused("compile_cache_import", src="c.tar.gz", cache_dir=str(state / "escape"))
        assert outside in await refused("compile_cache_import", src=str(tmp_path / "c.tar.gz"))
        assert "URL destinations are off" in await refused("compile_cache_import", src="s3://bucket/c.tar.gz")
        assert outside in await refused("compare_results", files=[str(secret / "authorized_keys")] * 2)
        assert outside in await refused("profile_decode", model=str(checkpoint), out=str(tmp_path / "profile"))
        assert outside in await refused("run_sweep", deployment="ghost", out=str(tmp_path / "sweep.json"))
        assert "needs an API key" in await refused("start_deployment", rig="gemmax", model=str(checkpoint),
                                                   port=free_port(), options={"host": "0.0.0.0"})
        assert "cannot be given an API key" in await refused(
            "start_deployment", rig="transformers", model=str(checkpoint), port=free_port(),
            options={"host": "0.0.0.0", "api_key": "k"})
    assert (secret / "authorized_keys").read_text() == "ssh-ed25519 AAAA original"
    assert sorted(p.name for p in secret.iterdir()) == ["authorized_keys"]


def test_cache_import_never_writes_through_a_symlink(tmp_path):
    from gemmax.engine.compile_cache import export_cache, import_cache

    source = tmp_path / "src"
    source.mkdir()
    (source / "authorized_keys").write_bytes(b"compiled")
    export_cache(str(tmp_path / "c.tar.gz"), source)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "cache"
    target.mkdir()
    (target / "authorized_keys").symlink_to(victim)
    assert import_cache(str(tmp_path / "c.tar.gz"), target) == 1
    assert victim.read_text() == "precious" and (target / "authorized_keys").read_bytes() == b"compiled"


async def test_streamable_http_transport(state, checkpoint):
    # a record in the shared registry: a deployment started without waiting, then killed (dead, listed)
    started = ok(await call("start_deployment", rig="gemmax", model=str(checkpoint), port=free_port(),
                            options={"wait": False, "name": "seen-over-http"}))
    os.kill(started["deployment"]["pid"], signal.SIGKILL)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gemmax.cli", "mcp", "--transport", "http", "--port", str(port)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the HTTP MCP server did not start"
            await anyio.sleep(0.2)
        async with Client(f"http://127.0.0.1:{port}/mcp") as client:
            assert {t.name for t in (await client.list_tools()).tools} == TOOLS
            # the registry the in-process server reads, both ways
            listed = deployment_names(ok(await client.call_tool("list_deployments", {})))
            assert "seen-over-http" in listed and listed == deployment_names(ok(await call("list_deployments")))
            stopped = ok(await client.call_tool("stop_deployment", {"name": "seen-over-http"}))
            assert (stopped["state_before"], stopped["how"]) == ("dead", "already dead")
            assert "seen-over-http" not in deployment_names(ok(await call("list_deployments")))
    finally:
        proc.terminate()
        proc.wait(30)
