"""The compile cache through S3 (moto's server on loopback, reached by s3fs and boto3): a real
`gemmax serve` compiles and fills a cache, `gemmax cache export s3://...` pushes it, a fresh cache
directory is restored from S3 with `gemmax cache import` (the user-data script's step), and the
next server started on it, deployed as an aws deployment whose address is that server, reports only
cache hits in its boot timeline. Also: s3:// without s3fs is a clear error in the CLI and over MCP.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from mcp import Client

from deploy_support import moto_server
from gemmax.mcp import server as ops
from gemmax.rigs.registry import free_port, wait_healthy
from mcp_support import error, ok
from tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.timeout(120)
SERVE = ["--dtype", "float32", "--max-model-len", "64", "--max-batch", "1"]
URL = "s3://gemmax-cache/tiny/xla.tar.gz"



@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with moto_server() as env, pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.setenv("GEMMAX_STATE_DIR", str(tmp_path_factory.mktemp("deploy-cache-state")))
        boto3.client("s3").create_bucket(Bucket="gemmax-cache")
        yield env


def gemmax(*args: str, cache: Path):
    """`gemmax ARGS` with the compile cache at CACHE (the CLI in this process: no second JAX start-up)."""
    from typer.testing import CliRunner

    from gemmax.cli import app

    result = CliRunner().invoke(app, list(args), env={"GEMMAX_COMPILE_CACHE": str(cache)})
    assert result.exit_code == 0, result.output
    return result


def serve(model: Path, port: int, cache: Path, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "gemmax.cli", "serve", "--model", str(model), "--port", str(port),
                                 *SERVE], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "GEMMAX_COMPILE_CACHE": str(cache)})


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_cache_round_trips_through_s3_and_the_next_start_hits_it(s3, tmp_path):
    model = write_tiny_checkpoint(tmp_path / "ckpt")
    cold_cache = fresh_cache = tmp_path / "cache"
    port = free_port()
    proc = serve(model, port, cold_cache, tmp_path / "cold.log")
    try:
        cold = wait_healthy(f"http://127.0.0.1:{port}", 240, proc)["warmup"]
    finally:
        stop(proc)
    assert cold["cache_misses"] > 0 and cold["cache_hits"] == 0

    pushed = gemmax("cache", "export", URL, cache=cold_cache)
    assert f"to {URL}" in pushed.stdout
    size = boto3.client("s3").head_object(Bucket="gemmax-cache", Key="tiny/xla.tar.gz")["ContentLength"]
    assert pushed.stdout.startswith(f"wrote {size} bytes")
    # A fresh instance: nothing at the cache path until the user-data step restores it from S3. (The
    # path must be the same: JAX's cache key includes the XLA autotune-cache directory under it.)
    entries = sorted(p.name for p in (cold_cache / "xla").glob("*-cache"))
    shutil.rmtree(cold_cache)
    restored = gemmax("cache", "import", URL, cache=fresh_cache)
    assert entries and sorted(p.name for p in (fresh_cache / "xla").glob("*-cache")) == entries
    assert restored.stdout.startswith("restored ")

    ec2 = boto3.client("ec2")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    port = free_port()
    proc = serve(model, port, fresh_cache, tmp_path / "warm.log")  # the instance's server
    try:
        async with Client(ops.build_server()) as client:
            launched = ok(await client.call_tool("deploy_launch", {
                "target": "aws", "name": "warm", "model": str(model), "cache_url": URL, "timeout_s": 200,
                "aws": {"instance_type": "g4dn.xlarge", "zones": ["us-east-1a"], "image_id": image,
                        "market": "on-demand", "endpoint": f"http://127.0.0.1:{port}"}}))["remote"]
            timeline = launched["timeline"]
            # every compiled shape came from the restored cache: hits, no misses
            assert timeline["cache_hits"] == cold["cache_misses"] and timeline["cache_misses"] == 0
            assert launched["aws"]["price_per_hour"] == 0.526  # g4dn.xlarge on demand
            done = ok(await client.call_tool("deploy_terminate", {"name": "warm", "push_cache": False}))
            assert done["deployment"]["state"] == "terminated" and done["cache_push"] is None
    finally:
        stop(proc)


@pytest.fixture
def no_s3fs(monkeypatch):
    """This process as if s3fs were not installed: importing it fails, and fsspec forgets it."""
    import fsspec  # noqa: F401  (loads fsspec.registry, whose name the package rebinds to a mapping)

    loaded = sys.modules["fsspec.registry"]._registry
    monkeypatch.setitem(sys.modules, "s3fs", None)
    for protocol in ("s3", "s3a"):
        if protocol in loaded:
            monkeypatch.delitem(loaded, protocol)


async def test_s3_without_s3fs_is_a_clear_error(s3, no_s3fs, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from gemmax.cli import app

    monkeypatch.setenv(ops.ALLOW_URLS_ENV, "1")
    cache = tmp_path / "xla"
    cache.mkdir()
    (cache / "a-cache").write_bytes(b"compiled")
    monkeypatch.setenv("GEMMAX_COMPILE_CACHE", str(tmp_path))
    fix = "pip install 'gemmax[aws]'"
    async with Client(ops.build_server()) as client:
        for tool, arguments in (("compile_cache_export", {"dest": URL}), ("compile_cache_import", {"src": URL}),
                                ("deploy_launch", {"target": "aws", "name": "x", "model": "m", "cache_url": URL,
                                                   "aws": {"instance_type": "g6.xlarge", "zones": ["us-east-1a"],
                                                           "image_id": "ami-1"}})):
            message = error(await client.call_tool(tool, arguments))
            # the SDK's prefix, then our message (an ImportError would have reached the client as an opaque crash)
            assert message.startswith(f"Error executing tool {tool}: s3:// URLs need a filesystem package that is "
                                      "not installed (Install s3fs to access S3)"), message
            assert message.endswith(fix)
    result = CliRunner().invoke(app, ["cache", "export", URL])
    assert result.exit_code == 2 and fix in result.output


async def test_a_damaged_or_missing_tarball_is_one_clear_line_and_writes_nothing(s3, tmp_path):
    """`gemmax cache import` of a truncated, non-gzip or missing tarball (a file or an S3 key) and
    `cache export` of a missing directory end with `error: ...` and status 1, not a traceback, and an
    import writes no file; the MCP tool answers with the same reason."""
    from typer.testing import CliRunner

    from gemmax.cli import app
    from gemmax.engine.compile_cache import export_cache

    source = tmp_path / "source"
    source.mkdir()
    (source / "a-cache").write_bytes(os.urandom(50_000))
    export_cache(str(tmp_path / "good.tar.gz"), source)
    good = (tmp_path / "good.tar.gz").read_bytes()
    (tmp_path / "truncated.tar.gz").write_bytes(good[: len(good) // 2])
    (tmp_path / "plain.txt").write_bytes(b"not a tarball")
    boto3.client("s3").put_object(Bucket="gemmax-cache", Key="truncated.tar.gz", Body=good[: len(good) // 2])
    target = tmp_path / "target"
    runner = CliRunner()
    for src, reason in ((str(tmp_path / "truncated.tar.gz"), "not a complete compile-cache tarball"),
                        (str(tmp_path / "plain.txt"), "not a complete compile-cache tarball"),
                        ("s3://gemmax-cache/truncated.tar.gz", "not a complete compile-cache tarball"),
                        (str(tmp_path / "missing.tar.gz"), "missing.tar.gz"),
                        ("s3://gemmax-cache/missing.tar.gz", "missing.tar.gz")):
        result = runner.invoke(app, ["cache", "import", src, "--cache-dir", str(target)])
        assert result.exit_code == 1 and "Traceback" not in result.output, (src, result.output)
        assert result.output.startswith("error: ") and reason in result.output, (src, result.output)
        assert not [p for p in target.rglob("*") if p.is_file()], src
    result = runner.invoke(app, ["cache", "export", str(tmp_path / "out.tar.gz"), "--cache-dir", str(tmp_path / "none")])
    assert result.exit_code == 1 and result.output.startswith("error: no compilation cache at")
    buckets = sorted(b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"])
    result = runner.invoke(app, ["cache", "export", "s3://no-such-bucket/c.tar.gz", "--cache-dir", str(source)])
    assert result.exit_code == 1 and result.output.startswith("error: ") and "Traceback" not in result.output
    assert sorted(b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]) == buckets  # none created

    state = Path(os.environ["GEMMAX_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    (state / "truncated.tar.gz").write_bytes(good[: len(good) // 2])
    async with Client(ops.build_server()) as client:
        message = error(await client.call_tool("compile_cache_import", {"src": "truncated.tar.gz",
                                                                        "cache_dir": str(state / "restored")}))
    assert "not a complete compile-cache tarball" in message
