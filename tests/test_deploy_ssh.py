"""The ssh target through a real SSH server on loopback (asyncssh's server, throwaway keys, the host
key checked against a known_hosts file) that runs each command with bash on this machine, in a
private home directory, as a remote host would.

What gets installed on the "host" is a small wheel whose `gemmax` console script runs the fake-engine
server for `serve` (tests/fake_engine.py, the real HTTP app over a rule-based engine: a full `gemmax
serve` compiles for ~40 s) and the real `gemmax` CLI for everything else (`cache export/import`). So
the deployment goes: venv + pip install over SSH, cache restore, detached start, boot timeline through
the SSH tunnel, status, logs, the benchmark harness through the tunnel, cache push, stop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path
from types import SimpleNamespace

import anyio
import asyncssh
import httpx
import psutil
import pytest
from mcp import Client

from gemmax.mcp.server import build_server
from gemmax.rigs.registry import free_port
from mcp_support import error, ok
from tiny_checkpoint import write_tokenizer

pytestmark = pytest.mark.timeout(150)
TESTS = Path(__file__).parent


def shim_wheel(directory: Path, tokenizer: Path) -> Path:
    """A wheel providing a `gemmax` console script: `serve` -> the fake-engine server, else the real CLI."""
    module = f'''import os, sys
PY, FAKE, TOK = {sys.executable!r}, {str(TESTS / "fake_engine.py")!r}, {str(tokenizer)!r}
def main():
    args = sys.argv[1:]
    if args and args[0] == "serve":
        port = args[args.index("--port") + 1]
        os.execv(PY, [PY, FAKE, "--tokenizer", TOK, "--port", port])
    os.execv(PY, [PY, "-m", "gemmax.cli", *args])
'''
    info = "gemmax_hostshim-0.1.dist-info"
    files = {
        "gemmax_hostshim.py": module,
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gemmax-hostshim\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": "[console_scripts]\ngemmax = gemmax_hostshim:main\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = directory / "gemmax_hostshim-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return path


class Host(asyncssh.SSHServer):
    def connection_requested(self, dest_host, dest_port, orig_host, orig_port):
        return dest_host in ("127.0.0.1", "localhost")  # tunnels to the host's loopback only


@pytest.fixture(scope="module")
def ssh_host(tmp_path_factory):
    """An SSH server on 127.0.0.1 in a thread of its own; commands run with bash in HOME."""
    root = tmp_path_factory.mktemp("ssh-host")
    home, state = root / "home", root / "state"
    home.mkdir()
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    client_key = asyncssh.generate_private_key("ssh-ed25519")
    (root / "id_ed25519").write_bytes(client_key.export_private_key())
    (root / "id_ed25519").chmod(0o600)
    env = {**os.environ, "HOME": str(home), "GEMMAX_COMPILE_CACHE": str(home / "cache")}

    async def run_command(process: asyncssh.SSHServerProcess) -> None:
        proc = await asyncio.create_subprocess_exec("bash", "-c", process.command, cwd=home, env=env,
                                                    stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        process.stdout.write(out.decode(errors="replace"))
        process.stderr.write(err.decode(errors="replace"))
        process.exit(proc.returncode)

    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def serve():
        holder["server"] = await asyncssh.create_server(
            Host, "127.0.0.1", 0, server_host_keys=[host_key], process_factory=run_command,
            authorized_client_keys=asyncssh.import_authorized_keys(client_key.export_public_key().decode()))
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(30)
    port = holder["server"].sockets[0].getsockname()[1]
    (root / "known_hosts").write_bytes(f"[127.0.0.1]:{port} ".encode() + host_key.export_public_key())
    tokenizer = write_tokenizer(root / "tok")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEMMAX_STATE_DIR", str(state))
        yield SimpleNamespace(port=port, home=home, state=state, root=root, wheel=shim_wheel(root, tokenizer),
                              options={"host": "127.0.0.1", "port": port, "client_key": str(root / "id_ed25519"),
                                       "known_hosts": str(root / "known_hosts")})
        from gemmax.deploy.service import Deployer

        deployer = Deployer(state)  # whatever a failed test left running on the "host" is stopped
        for record in deployer.records():
            if record.active:
                deployer.terminate(record.name, push_cache=False, timeout_s=10)
    loop.call_soon_threadsafe(holder["server"].close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def cache_files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


async def test_install_start_status_logs_bench_cache_stop_over_ssh(ssh_host):
    xla = ssh_host.home / "cache" / "xla"
    xla.mkdir(parents=True)
    entries = {"k1-cache": os.urandom(2000), "k2-cache": b"compiled"}
    for name, data in entries.items():
        (xla / name).write_bytes(data)
    tarball = ssh_host.root / "pushed.tar.gz"
    async with Client(build_server()) as client:
        launched = ok(await client.call_tool("deploy_launch", {
            "target": "ssh", "name": "box", "model": "/models/tiny", "port": free_port(),
            "cache_url": str(tarball), "timeout_s": 90,
            "ssh": {**ssh_host.options, "install": str(ssh_host.wheel), "python": sys.executable}}))["remote"]
        assert launched["state"] == "ready" and launched["ssh"]["gemmax"] == ".gemmax/venv/bin/gemmax"
        t = launched["timeline"]
        assert t["requested"] == 0.0 <= t["running"] <= t["reachable"] <= t["healthy"]
        assert "cache_restore_failed" in t  # nothing pushed yet: the first start compiles
        assert (ssh_host.home / ".gemmax/venv/bin/gemmax").is_file()  # installed over SSH
        pid = t["pid"]
        assert psutil.Process(pid).is_running()

        status = ok(await client.call_tool("deploy_status", {"name": "box"}))
        assert status["instance_state"] == "running" and status["health_status"] == 200  # through the tunnel
        assert status["health"]["model"] == "fake"

        logs = ok(await client.call_tool("deploy_logs", {"name": "box", "tail": 200}))["result"]
        assert any("Uvicorn running on http://127.0.0.1" in line for line in logs)

        bench = ok(await client.call_tool("deploy_benchmark", {"name": "box", "input_lens": [32], "output_len": 4,
                                                               "repeats": 1}))
        (cell,) = bench["cells"]
        assert (cell["completed"], cell["failed"]) == (1, 0) and bench["model"] == "fake"

        pushed = ok(await client.call_tool("deploy_cache_push", {"name": "box"}))
        assert pushed["result"]["method"] == "ssh" and tarball.is_file()
        with tarfile.open(tarball) as tar:
            assert sorted(m.name for m in tar.getmembers() if m.isfile()) == [f"xla/{n}" for n in sorted(entries)]
        for name in entries:
            (xla / name).unlink()
        restored = ok(await client.call_tool("deploy_cache_restore", {"name": "box"}))
        assert "restored 2 files" in restored["result"]["output"]
        assert {k: v for k, v in cache_files(xla).items()} == entries

        tunnel = subprocess.Popen([sys.executable, "-m", "gemmax.cli", "deploy", "tunnel", "box"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            with anyio.fail_after(60):
                url = (await anyio.to_thread.run_sync(tunnel.stdout.readline)).strip()
            assert url.startswith("http://127.0.0.1:"), tunnel.stderr.read() if tunnel.poll() is not None else url
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"{url}/v1/models")).json()["data"][0]["id"] == "fake"
        finally:
            tunnel.terminate()
            tunnel.wait(10)

        done = ok(await client.call_tool("deploy_terminate", {"name": "box"}))
        assert done["deployment"]["state"] == "stopped" and done["cache_push"]["pushed"] is True
        assert done["deployment"]["timeline"]["stopped"] > t["healthy"]
        assert done["deployment"]["timeline"]["stop"] == "sigterm"  # it exited on SIGTERM, no SIGKILL needed
    with contextlib.suppress(psutil.NoSuchProcess):  # gone, or exited and not reaped by its parent (init)
        assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_a_server_that_dies_at_start_is_reported_failed(ssh_host):
    async with Client(build_server()) as client:
        message = error(await client.call_tool("deploy_launch", {
            "target": "ssh", "name": "broken", "model": "m", "port": free_port(), "timeout_s": 3,
            "ssh": {**ssh_host.options, "command": ["bash", "-c", "echo cannot load the model >&2; exit 3"]}}))
        assert "deployment 'broken' on 127.0.0.1 failed" in message and "cannot load the model" in message
        listed = {r["name"]: r for r in ok(await client.call_tool("deploy_list", {}))["remote"]}
    assert listed["broken"]["state"] == "failed" and "not healthy after 3 s" in listed["broken"]["error"]


async def test_unknown_host_key_is_refused(ssh_host, tmp_path):
    (tmp_path / "known_hosts").write_text("")
    async with Client(build_server()) as client:
        bad_name = error(await client.call_tool("deploy_launch", {
            "target": "ssh", "name": "../escape", "model": "m", "ssh": ssh_host.options}))
        assert "deployment name '../escape'" in bad_name
        message = error(await client.call_tool("deploy_launch", {
            "target": "ssh", "name": "spoofed", "model": "m", "port": free_port(), "timeout_s": 3,
            "ssh": {**ssh_host.options, "known_hosts": str(tmp_path / "known_hosts")}}))
        listed = {r["name"]: r for r in ok(await client.call_tool("deploy_list", {}))["remote"]}
    assert f"ssh 127.0.0.1:{ssh_host.port}: Host key is not trusted for host 127.0.0.1" in message
    assert listed["spoofed"]["state"] == "failed" and "running" not in listed["spoofed"]["timeline"]




def test_cache_push_reads_the_launch_cache_a_failed_push_still_stops_and_a_reused_pid_is_spared(ssh_host):
    """The launch's GEMMAX_COMPILE_CACHE is the one later cache pushes read (not the host's default); a
    push that fails at terminate is reported and the server is stopped all the same; and a pid the host
    has given to another process since the server died is never signalled."""
    from gemmax.deploy.registry import SshHost
    from gemmax.deploy.service import Deployer

    deployer = Deployer(ssh_host.state)
    home = ssh_host.home
    for cache, entry in (("cache", "default-entry"), ("launch-cache", "launch-entry")):
        (home / cache / "xla").mkdir(parents=True, exist_ok=True)
        (home / cache / "xla" / entry).write_bytes(b"compiled")

    def launch(name: str, **options):
        port = free_port()
        host = SshHost(host="127.0.0.1", port=ssh_host.port, client_key=ssh_host.options["client_key"],
                       known_hosts=ssh_host.options["known_hosts"], remote_dir=f".gemmax/deployments/{name}",
                       gemmax=f"{sys.executable} -m gemmax.cli")
        command = [sys.executable, str(TESTS / "fake_engine.py"), "--tokenizer", str(ssh_host.root / "tok"),
                   "--port", str(port)]
        return deployer.launch_ssh(name, host, model="m", port=port, serve_args=[], command=command,
                                   timeout_s=60, **options)

    tarball = ssh_host.root / "launch-cache.tar.gz"
    record = launch("own-cache", env={"GEMMAX_COMPILE_CACHE": str(home / "launch-cache")}, cache_url=str(tarball))
    assert record.state == "ready" and record.ssh.compile_cache == str(home / "launch-cache")
    assert deployer.push_cache("own-cache")["pushed"] is True
    with tarfile.open(tarball) as tar:
        assert [m.name for m in tar.getmembers() if m.isfile()] == ["xla/launch-entry"]

    pid = record.timeline["pid"]
    deployer.registry.update("own-cache", cache_url="/dev/null/cannot/be/written.tar.gz")
    done = deployer.terminate("own-cache")
    assert done.cache_push["pushed"] is False and "/dev/null/cannot" in done.cache_push["error"]
    assert done.deployment.state == "stopped" and done.deployment.timeline["stop"] == "sigterm"
    with contextlib.suppress(psutil.NoSuchProcess):
        assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    record = launch("reused")
    server = psutil.Process(record.timeline["pid"])
    server.kill()
    server.wait(10)
    bystander = subprocess.Popen(["setsid", "sleep", "600"], stdin=subprocess.DEVNULL)
    try:
        (home / record.ssh.remote_dir / "pid").write_text(f"{bystander.pid}\n")  # as if the host reused the pid
        done = deployer.terminate("reused", push_cache=False)
        assert done.deployment.state == "stopped" and done.deployment.timeline["stop"] == "already-dead"
        assert bystander.poll() is None  # not signalled
    finally:
        bystander.kill()
        bystander.wait()


def test_a_launch_whose_connection_drops_leaves_the_server_to_terminate(ssh_host, monkeypatch):
    """The server started, then the SSH connection failed while the boot was waited for (its stop on
    that connection fails too: `_stop` raising stands in for the dropped connection): the stop is tried
    again on a new connection; when that fails as well, the record stays live with the error, so a
    later terminate stops the server instead of leaving it orphaned."""
    from gemmax.deploy.errors import DeployError
    from gemmax.deploy.registry import SshHost
    from gemmax.deploy.service import Deployer
    from gemmax.deploy.ssh import SshTarget

    deployer = Deployer(ssh_host.state)
    stop = SshTarget._stop
    failing = {"left": 2}

    async def dropped(self, conn, host, timeout_s):
        if failing["left"]:
            failing["left"] -= 1
            raise DeployError("ssh 127.0.0.1: connection lost")
        return await stop(self, conn, host, timeout_s)

    monkeypatch.setattr(SshTarget, "_stop", dropped)
    host = SshHost(host="127.0.0.1", port=ssh_host.port, client_key=ssh_host.options["client_key"],
                   known_hosts=ssh_host.options["known_hosts"], remote_dir=".gemmax/deployments/dropped",
                   gemmax=f"{sys.executable} -m gemmax.cli")
    with pytest.raises(DeployError):  # never healthy: a server that only sleeps
        deployer.launch_ssh("dropped", host, model="m", port=free_port(), serve_args=[],
                            command=["sleep", "600"], timeout_s=2)
    record = deployer.registry.get("dropped")
    assert record.active and "terminate stops it" in record.error
    server = psutil.Process(record.timeline["pid"])
    assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
    done = deployer.terminate("dropped", push_cache=False)
    assert done.deployment.state == "stopped" and done.deployment.timeline["stop"] == "sigterm"
    with contextlib.suppress(psutil.NoSuchProcess):
        assert server.status() == psutil.STATUS_ZOMBIE
