"""Two local processes joined by `jax.distributed` (CPU collectives through gloo), 2 host devices each,
one mesh over both: `gemmax serve --mesh dp=2,tp=2` (each process one dp group, tp within it). Process 0
serves HTTP on loopback and schedules; process 1 follows its schedule (gemmax.engine.schedule). The
official `openai` client sends concurrent requests of different lengths (one cut short by max_tokens)
and gets one process's greedy tokens; at SIGTERM process 0 drains and process 1 exits 0 with it.

`gemmax generate --coordinator ...` joins processes the same way (`cli._join_processes`); its own
two-process test was folded into this one (it cost 95-175 s on the shared machine).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from gemmax.model.forward import forward
from gemmax.model.kv_cache import init_cache
from gemmax.weights.load import load_checkpoint
from hf_reference import FAMILY_CONFIGS, build_gemma4

HERE = Path(__file__).parent
# (prompt, max_tokens): different lengths, one cut short by max_tokens.
REQUESTS = [([2, 17, 33, 5, 61, 8, 40], 12), ([2, 9, 14], 10), ([2, *range(40, 60)], 3), ([2, 77, 3, 91, 12], 11)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("multihost") / "31b_like"
    build_gemma4("31b_like", directory, seed=3, configs=FAMILY_CONFIGS)
    return directory


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    """One process, one device: the greedy tokens of REQUESTS, all rows of one plain `forward` (a
    prefill of the prompts padded to the longest, then one-token steps), so two programs compile."""
    ck = load_checkpoint(checkpoint, weight_dtype=jnp.float32)
    step = jax.jit(forward, static_argnames=("config",), donate_argnames=("cache",))
    longest, rows = max(len(p) for p, _ in REQUESTS), len(REQUESTS)
    tokens = np.zeros((rows, longest), np.int32)
    for row, (prompt, _) in enumerate(REQUESTS):
        tokens[row, : len(prompt)] = prompt
    lengths = np.asarray([len(p) for p, _ in REQUESTS], np.int32)
    cache = init_cache(ck.config, rows, 64)
    logits, cache = step(ck.params, cache, tokens, np.zeros(rows, np.int32), lengths, config=ck.config)
    out = []
    for _ in range(max(n for _, n in REQUESTS)):
        out.append(np.argmax(np.asarray(logits), -1).astype(np.int32))
        logits, cache = step(ck.params, cache, out[-1][:, None], lengths, np.ones(rows, np.int32), config=ck.config)
        lengths = lengths + 1
    return [[int(t[row]) for t in out[:n]] for row, (_, n) in enumerate(REQUESTS)]


def _processes(args: list[str], stdout, stderr: list) -> list[subprocess.Popen]:
    """`gemmax ARGS` as processes 0 and 1 of two, 2 forced host devices each (stderr[i]: process i's)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    coordinator = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2"]
    return [subprocess.Popen([sys.executable, "-m", "gemmax.cli", *args, *coordinator, "--process-id", str(i)],
                             env=env, text=True, stdout=stdout, stderr=stderr[i]) for i in range(2)]


def test_serve_across_two_processes_answers_from_process_0_with_one_process_tokens(checkpoint, expected, tmp_path):
    directory = checkpoint
    port = _free_port()
    logs = [open(tmp_path / f"process{i}.log", "w+") for i in range(2)]  # noqa: SIM115
    procs = _processes(["serve", "--model", str(directory), "--dtype", "float32", "--port", str(port),
                        "--mesh", "dp=2,tp=2", "--max-batch", "4", "--max-model-len", "32"],
                       subprocess.DEVNULL, logs)

    def tails() -> str:
        return "\n".join(f"--- process {i}\n" + (tmp_path / f"process{i}.log").read_text()[-3000:] for i in range(2))

    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert all(p.poll() is None for p in procs), tails()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "process 0 never became ready\n" + tails()
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

        def complete(request):
            prompt, n = request
            r = client.completions.create(model=str(directory), prompt=prompt, max_tokens=n, temperature=0.0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
            return r.choices[0].model_extra["token_ids"], r.choices[0].finish_reason

        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
            got = list(pool.map(complete, REQUESTS))
        assert [ids for ids, _ in got] == expected
        assert all(reason == "length" for _, reason in got)
        # constrained decoding's split step is not replayed: refused with a 400, and nothing else is hurt
        with pytest.raises(openai.BadRequestError, match="not served across processes"):
            client.completions.create(model=str(directory), prompt=REQUESTS[0][0], max_tokens=4,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert complete(REQUESTS[0]) == got[0]
        procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(timeout=60) for p in procs] == [0, 0], tails()
        assert "device calls replayed" in (tmp_path / "process1.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()

