"""Two local processes joined by `jax.distributed` (CPU collectives through gloo), 2 host devices each,
one tp=4 mesh over both: `gemmax generate --mesh tp=4 --coordinator ...` gives the greedy tokens of one
process on one device, and only process 0 prints."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp

from gemmax.engine.generate import generate
from gemmax.weights.load import load_checkpoint
from hf_reference import FAMILY_CONFIGS, build_gemma4

HERE = Path(__file__).parent
PROMPT = [2, 17, 33, 5, 61, 8, 40]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_greedy_tokens_of_one(tmp_path):
    directory = tmp_path / "31b_like"
    build_gemma4("31b_like", directory, seed=3, configs=FAMILY_CONFIGS)
    ck = load_checkpoint(directory, weight_dtype=jnp.float32)
    expected = generate(ck.params, ck.config, PROMPT, 16, stop_ids=())

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "gemmax.cli", "generate", "--model", str(directory), "--dtype", "float32",
         "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "16", "--json", "--mesh", "dp=1,tp=4",
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    printed = [[line for line in out.splitlines() if line.startswith("{")] for out, _ in outs]
    assert printed[1] == [], "only process 0 answers"
    assert json.loads(printed[0][-1])["token_ids"] == expected
