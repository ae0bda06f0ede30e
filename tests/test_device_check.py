"""benchmarks/device_check.py in its reduced CPU mode, end to end: every section runs and its JSON says
what the GPU run would report (the same code, a small model), so the script cannot rot between runs on
real hardware. The profile runs in a child process with XLA:GPU command buffers off, as on a GPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_check  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    # LLVM at -O0 in the script and its profile child: its time goes to compiling (decode and quant at
    # two batches and three stored forms, twice in the profile child) and -O0 cuts a compile's CPU by a
    # quarter or more. What is checked here is that every section runs and reports, with numbers compared
    # within one run (parity against transformers is 1e-4 in float32, far above what the LLVM level
    # changes); speed is measured on real devices, not here.
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--reduced", "--out", str(out), "--steps", "2", "--repeats", "1",
         "--context", "32", "--profile-subprocess", "yes"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "80", "XLA_FLAGS": flags})
    return proc, out


def test_every_section_passes_and_the_last_line_is_the_report(run):
    proc, out = run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    on_disk = json.loads((out / "device_check.json").read_text())
    assert last["schema"] == on_disk["schema"] == device_check.SCHEMA
    assert last["sections"].keys() == on_disk["sections"].keys() == set(device_check.SECTIONS)
    assert {name: s["status"] for name, s in last["sections"].items()} == dict.fromkeys(device_check.SECTIONS, "ok")
    assert last["reduced"] is True and last["platform"] == "cpu" and last["ok"] is True
    from gemmax.engine.executables import code_hash

    assert last["code"] == code_hash()[:12]  # which source ran, for results copied off a device
    table = (out / "device_check.md").read_text()
    assert "| section | what | value |" in table and table.strip() in proc.stdout


def test_sections_report_what_the_issue_asks(run):
    _, out = run
    s = {name: v["result"] for name, v in json.loads((out / "device_check.json").read_text())["sections"].items()}
    policy = s["policy"]
    assert policy["line"].startswith("gemmax device policy: platform=cpu")
    assert policy["w4a16_plan"]["kernel"] == "cpu" and policy["jax"]  # CPU: the measured XLA form, no probe
    assert s["parity"]["passed"] and s["parity"]["max_abs_diff_highest"] <= device_check.PARITY_TOL
    # /health reports the policy's dtypes and a request was served
    assert s["serve"]["precision"]["compute_dtype"] == policy["compute_dtype"] == s["serve"]["policy_compute_dtype"]
    assert s["serve"]["chat_status"] == 200 and s["serve"]["completion_tokens"] > 0
    bandwidth = s["bandwidth"]["roofline_gb_s"]
    assert bandwidth == max(s["bandwidth"]["read_gb_s"], s["bandwidth"]["cpu_all_core_read_gb_s"]) > 0
    decode = s["decode"]
    assert decode["policy"]["dtype"] == "bfloat16" and decode["wrong"]["dtype"] == "float16"
    for role in ("policy", "wrong"):
        for b in ("b1", "b8"):
            row = decode[role][b]
            assert row["tok_s"] > 0 and row["bytes_per_step"] > 0
            assert math.isclose(row["roofline_share"], row["achieved_gb_s"] / bandwidth)
    assert decode["wrong"]["override_warning"]  # the policy warns about the emulated dtype
    assert math.isclose(decode["policy_over_wrong_b1"], decode["policy"]["b1"]["tok_s"] / decode["wrong"]["b1"]["tok_s"])
    profile = s["profile"]
    assert "xla_gpu_enable_command_buffer=" in profile["xla_flags"]
    for role in ("policy", "wrong"):
        assert 0 <= profile[role]["conversion_percent"] <= 100 and profile[role]["device_ms_per_step"] > 0
    w4 = s["w4a16"]
    assert w4["interpret"] is True and w4["passed"] and w4["max_rel_err"] <= device_check.W4A16_TOL
    assert all(m["pallas_us"] > 0 and m["xla_us"] > 0 for shape in w4["shapes"].values() for m in shape.values())
    quant = s["quant"]
    assert quant["w4a16_pallas"]["kernel"] == "pallas_interpret" and quant["w4a16_xla"]["kernel"] == "xla"
    assert all(quant[v][b]["tok_s"] > 0 for v in ("int8", "w4a16_xla", "w4a16_pallas") for b in ("b1", "b8"))


def test_a_failing_section_keeps_the_others(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("no such device")

    monkeypatch.setitem(device_check.RUNNERS, "parity", broken)
    report = device_check.run(["--reduced", "--sections", "policy,parity", "--out", str(tmp_path)])
    assert report["sections"]["parity"]["status"] == "error" and "no such device" in report["sections"]["parity"]["error"]
    assert report["sections"]["policy"]["status"] == "ok" and report["ok"] is False
    assert json.loads((tmp_path / "device_check.json").read_text())["sections"]["parity"]["status"] == "error"
    assert "ERROR: RuntimeError: no such device" in (tmp_path / "device_check.md").read_text()


def test_sections_past_the_budget_are_skipped(tmp_path):
    report = device_check.run(["--reduced", "--sections", "policy,parity", "--budget-s", "0", "--out", str(tmp_path)])
    assert {s["status"] for s in report["sections"].values()} == {"skipped"}


def test_committed_gpu_results_render():
    committed = json.loads((ROOT / "benchmarks" / "results" / "device_check_h200.json").read_text())
    assert committed["device"] == "NVIDIA H200" and committed["sections"].keys() == set(device_check.SECTIONS)
    assert device_check.render(committed) + "\n" == (ROOT / "benchmarks" / "results" / "device_check_h200.md").read_text()
