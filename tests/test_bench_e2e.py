"""End to end: `gemmax serve` and `gemmax rig transformers` on the same tiny checkpoint, both started
through the rig registry as real subprocesses, a short sweep against each through the CLI, then
`gemmax bench compare` prints them side by side."""

from __future__ import annotations

import subprocess

import pytest
from typer.testing import CliRunner

from gemmax.bench.report import load_run
from gemmax.cli import app
from gemmax.rigs.registry import RigOptions, free_port, get_rig, wait_healthy
from hf_reference import build_gemma4

runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("e2e") / "g4_shared"
    build_gemma4("g4_shared", directory)
    return directory


@pytest.fixture
def rigs(checkpoint, tmp_path):
    """{name: base_url} for gemmax and transformers serving the same weights in float32."""
    started: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name in ("gemmax", "transformers"):
            options = RigOptions(model=str(checkpoint), port=free_port(), dtype="float32", max_model_len=128,
                                 max_batch=2)
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process below)
            process = get_rig(name).start(options, stdout=log, stderr=subprocess.STDOUT)
            started[name] = (process, f"http://127.0.0.1:{options.port}")
        for name, (process, url) in started.items():
            try:
                wait_healthy(url, timeout_s=600, process=process)
            except (RuntimeError, TimeoutError) as exc:
                tail = (tmp_path / f"{name}.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"{name} did not come up: {exc}\n{tail}") from exc
        yield {name: url for name, (_, url) in started.items()}
    finally:
        for process, _ in started.values():
            process.terminate()
        for process, _ in started.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.mark.slow
def test_sweep_gemmax_and_transformers_then_compare(rigs, tmp_path):
    outputs = {}
    for name, url in rigs.items():
        out = tmp_path / f"{name}.json"
        result = runner.invoke(app, ["bench", "--base-url", url, "--input-lens", "12,40", "--output-len", "8",
                                     "--repeats", "2", "--concurrency", "1", "--vocab-size", "128",
                                     "--label", name, "--out", str(out)])
        assert result.exit_code == 0, result.output
        run = load_run(out)
        assert run["prompt_mode"] == "ids" and run["forced_output"] is True
        for cell in run["cells"]:
            assert cell["failed"] == 0, cell["errors"]
            assert cell["completed"] == 2
            assert cell["input_len_verified"] is True and cell["output_len_verified"] is True
            assert cell["stream"]["median"] > 0 and cell["median_ttft_ms"] > 0
        outputs[name] = out
    files = [str(outputs["gemmax"]), str(outputs["transformers"])]
    result = runner.invoke(app, ["bench", "compare", *files])
    assert result.exit_code == 0, result.output
    assert "gemmax" in result.stdout and "transformers" in result.stdout
    result = runner.invoke(app, ["bench", "compare", *files, "--markdown"])
    assert result.exit_code == 0, result.output
    header, _, *rows = result.stdout.splitlines()
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert {"gemmax tok/s", "transformers tok/s", "transformers/gemmax tok/s"} <= set(columns)
    ratio = columns.index("transformers/gemmax tok/s")
    assert all(row.split("|")[ratio + 1].strip().endswith("x") for row in rows[:2])
    assert "mixes precisions" not in result.stdout, result.stdout  # both serve float32 weights and KV
