"""Start-up (/health 503 -> 200), client disconnects (slot freed within a second), SIGTERM (in-flight
requests drain, clean exit), and a model that fails to load (exit status 1)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from fake_engine import fake_server, read_metric
from gemmax.rigs.registry import free_port
from gemmax.server.app import ServerSettings
from gemmax.server.serve import serve
from gemmax.weights.tokenizer import load_tokenizer
from tiny_checkpoint import write_tokenizer

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def wait_for_slots(url: str, value: float, within: float) -> float:
    """Seconds until gemmax:kv_slots_in_use == value; fails after `within` seconds."""
    start = time.perf_counter()
    while read_metric(url, "gemmax:kv_slots_in_use") != value:
        elapsed = time.perf_counter() - start
        assert elapsed < within, f"kv_slots_in_use still {read_metric(url, 'gemmax:kv_slots_in_use')} after {elapsed:.2f}s"
        time.sleep(0.02)
    return time.perf_counter() - start


def test_stream_disconnect_frees_the_slot(tokenizer):
    with fake_server(tokenizer, token_delay=0.02, max_model_len=100_000) as (url, engine, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="ab", max_tokens=50_000, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        for i, _chunk in enumerate(stream):
            if i == 3:
                break
        assert read_metric(url, "gemmax:kv_slots_in_use") == 1
        stream.close()  # the client goes away mid-stream
        assert wait_for_slots(url, 0, within=1.0) < 1.0
        assert read_metric(url, "gemmax:requests_total", {"endpoint": "/v1/completions", "status": "499"}) == 1
        assert len(engine.submitted) == 1


def test_non_stream_disconnect_frees_the_slot(tokenizer):
    with fake_server(tokenizer, token_delay=0.02, max_model_len=100_000) as (url, _, _):
        body = {"prompt": "ab", "max_tokens": 50_000, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
        assert wait_for_slots(url, 0, within=1.0) < 1.0
        assert read_metric(url, "gemmax:requests_total", {"endpoint": "/v1/completions", "status": "499"}) == 1


def test_sigterm_drains_in_flight_requests_and_exits(tokenizer_dir):
    """The real `serve()` path in a subprocess: /health goes 503 -> 200 while the (fake) engine warms
    up; on SIGTERM a running stream still completes, then the process exits with status 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, str(TESTS / "fake_engine.py"), "--tokenizer", str(tokenizer_dir),
                             "--port", str(port), "--token-delay", "0.02", "--warmup-seconds", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        statuses = []
        deadline = time.time() + 60
        while not statuses or statuses[-1] != 200:
            assert time.time() < deadline and proc.poll() is None, "server did not become ready"
            with contextlib.suppress(httpx.TransportError):
                statuses.append(httpx.get(f"{url}/health", timeout=2).status_code)
            time.sleep(0.05)
        assert statuses[0] == 503 and set(statuses) == {503, 200}

        body = {"prompt": "ab", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
        events: list[str] = []
        signalled = threading.Event()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                if len(events) == 2 and not signalled.is_set():
                    proc.send_signal(signal.SIGTERM)
                    signalled.set()
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # ignore_eos: the fake's cycle a, b, <eos> goes on; <eos> is emitted but has no text
        assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(("a", "b", "")[i % 3] for i in range(40))
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    assert "Shutting down" in output or "Finished server process" in output


def test_serve_and_bench_over_a_unix_socket(tokenizer_dir, tmp_path):
    """`serve(uds=...)` (what `gemmax serve --uds` calls) listens on a Unix socket and opens no TCP
    port (the TPU machines refuse TCP, loopback included); `gemmax bench --uds` times it from the wire
    through that socket; the socket is served as a loopback bind, so a foreign Host is refused. One
    repeat per cell: no run-to-run spread, so no gauge is flagged as coarser than it."""
    import psutil
    from typer.testing import CliRunner

    from gemmax.cli import app

    sock, out = tmp_path / "gemmax.sock", tmp_path / "bench.json"
    proc = subprocess.Popen([sys.executable, str(TESTS / "fake_engine.py"), "--tokenizer", str(tokenizer_dir),
                             "--uds", str(sock), "--token-delay", "0.005"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://localhost")
    try:
        deadline = time.time() + 60
        while True:
            assert time.time() < deadline and proc.poll() is None, "server did not become ready"
            with contextlib.suppress(httpx.TransportError):
                if client.get("/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.05)
        server = psutil.Process(proc.pid)
        connections = getattr(server, "net_connections", server.connections)  # psutil < 6.0: connections
        assert connections(kind="inet") == []  # no TCP or UDP socket at all
        refused = client.get("/health", headers={"Host": "attacker.example"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_host"

        result = CliRunner().invoke(app, ["bench", "--uds", str(sock),  # --base-url: http://localhost
                                          "--input-lens", "24", "--output-len", "5", "--repeats", "1",
                                          "--concurrency", "1,2", "--out", str(out)])
        assert result.exit_code == 0, result.output
        run = json.loads(out.read_text())
        assert run["label"] == f"fake@{sock}" and run["config"]["uds"] == str(sock)
        assert run["base_url"] == "http://localhost"
        assert [c["concurrency"] for c in run["cells"]] == [1, 2]
        for cell in run["cells"]:
            assert cell["flags"] == [] and cell["output_len_verified"] and cell["input_len_verified"]
            assert all(r["success"] and r["output_tokens"] == 5 for r in cell["requests"])
            assert cell["decode_tok_s"] > 0 and cell["ttft"]["median"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_failed_load_exits_with_status_1(caplog):
    def load():
        raise FileNotFoundError("no checkpoint at /nowhere")

    with caplog.at_level("ERROR", logger="gemmax.server"):
        status = serve(load, ServerSettings(served_model_name="x"), port=free_port(), log_level="warning")
    assert status == 1
    assert any("loading the model failed" in r.message for r in caplog.records)
