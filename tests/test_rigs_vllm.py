"""The vLLM rig through its real code paths, against a fake vLLM (tests/fake_vllm: the module
`python -m vllm.entrypoints.openai.api_server` runs, with vLLM's empty-body 200 on /health and its
stream shape), given to the rig as its interpreter the way `--python` / $GEMMAX_VLLM_PYTHON gives one:
the registry starts it, waits for health and sweeps it; `gemmax rig vllm` execs it; the MCP tools start,
sweep and stop it, and stop and remove one that fails while starting (dies, or never becomes healthy).
The real vLLM runs in benchmarks/rigs_run.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mcp import Client
from typer.testing import CliRunner

from gemmax.bench.sweep import SweepConfig, run_sweep
from gemmax.cli import app
from gemmax.mcp import server as ops
from gemmax.mcp.server import build_server
from gemmax.rigs.registry import RigOptions, free_port, get_rig, wait_healthy
from gemmax.rigs.vllm import PYTHON_ENV, SERVER_MODULE

FAKE = Path(__file__).parent / "fake_vllm"


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """The fake vLLM as the rig's interpreter; a private MCP registry; a model directory."""
    monkeypatch.setenv(PYTHON_ENV, sys.executable)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("GEMMAX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("FAKE_VLLM_MODE", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    yield model
    for status in ops.deployments().statuses():
        ops.deployments().stop(status.deployment.name, timeout_s=10)


def stop(process: subprocess.Popen) -> int:
    process.terminate()
    return process.wait(30)


def test_registry_starts_waits_sweeps_and_stops(fake_vllm):
    rig = get_rig("vllm")
    assert rig.available()
    options = RigOptions(model=str(fake_vllm), port=free_port(), max_model_len=1024, max_batch=2)
    argv = rig.command(options)
    assert argv[:3] == [sys.executable, "-m", SERVER_MODULE] and argv[argv.index("--dtype") + 1] == "bfloat16"
    process = rig.start(options, prepare=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{options.port}"
        assert wait_healthy(url, timeout_s=60, process=process) == {}  # vLLM's 200 has an empty body
        result = run_sweep(SweepConfig(base_url=url, input_lens=(17,), output_len=6, repeats=1, concurrency=(1, 2)))
    finally:
        code = stop(process)
    assert code in (0, -15)
    assert result["prompt_mode"] == "server" and result["forced_output"] is True
    assert [(c["input_len"], c["concurrency"]) for c in result["cells"]] == [(17, 1), (17, 2)]
    for cell in result["cells"]:
        assert cell["stream"]["median"] > 0
    assert all(r["success"] and r["usage"]["completion_tokens"] == 6 and r["usage"]["prompt_tokens"] == 17
               for c in result["cells"] for r in c["requests"])


def test_cli_execs_vllm_from_the_given_interpreter(fake_vllm):
    port = free_port()
    cli = [sys.executable, "-m", "gemmax.cli", "rig", "vllm", "--model", str(fake_vllm), "--port", str(port),
           "--python", sys.executable, "--dtype", "float32"]
    setup = CliRunner().invoke(app, [*cli[3:], "--setup"])
    assert setup.exit_code == 0 and setup.stdout.strip() == sys.executable, setup.output
    missing = CliRunner().invoke(app, [*cli[3:-4], "--python", "/nonexistent/python", "--setup"])
    assert missing.exit_code == 2 and "/nonexistent/python cannot run vLLM" in missing.output
    process = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout_s=60, process=process)
    finally:
        stop(process)
    first = process.stdout.readline()  # the fake prints the argv it was given: the same process, exec'd
    assert first.startswith("fake vllm: --model") and "--dtype float32" in first and f"--port {port}" in first


async def test_mcp_starts_sweeps_and_stops_vllm(fake_vllm):
    port = free_port()
    async with Client(build_server()) as client:
        started = await client.call_tool("start_deployment", {"rig": "vllm", "model": str(fake_vllm), "port": port,
                                                              "options": {"max_batch": 2, "timeout_s": 60}})
        assert not started.is_error, started.content[0].text
        name = started.structured_content["deployment"]["name"]
        assert started.structured_content["state"] == "ready"
        assert started.structured_content["deployment"]["command"][1:3] == ["-m", SERVER_MODULE]
        sweep = await client.call_tool("run_sweep", {"deployment": name, "input_lens": [9], "output_len": 4,
                                                     "repeats": 1, "concurrency": [1]})
        assert not sweep.is_error, sweep.content[0].text
        assert sweep.structured_content["cells"][0]["decode_tok_s"] > 0
        stopped = await client.call_tool("stop_deployment", {"name": name})
        assert (stopped.structured_content["state_before"], stopped.structured_content["how"]) == ("ready", "sigterm")
        assert (await client.call_tool("list_deployments", {})).structured_content["result"] == []


@pytest.mark.parametrize(("mode", "says"), [("exit", "exited with status 1"), ("hang", "not ready after 3 s")])
async def test_mcp_stops_and_removes_a_vllm_that_fails_while_starting(fake_vllm, monkeypatch, mode, says):
    monkeypatch.setenv("FAKE_VLLM_MODE", mode)
    port = free_port()
    async with Client(build_server()) as client:
        failed = await client.call_tool("start_deployment", {"rig": "vllm", "model": str(fake_vllm), "port": port,
                                                             "options": {"timeout_s": 3}})
        assert failed.is_error
        message = failed.content[0].text
        assert says in message and "it was stopped and removed" in message and "fake vllm: --model" in message
        assert (await client.call_tool("list_deployments", {})).structured_content["result"] == []
    with socket.socket() as sock:  # nothing is left listening, nor holding the port
        sock.bind(("127.0.0.1", port))
