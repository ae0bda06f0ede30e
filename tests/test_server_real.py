"""The server over the real BatchEngine and a tiny random Gemma 4 checkpoint (tests/tiny_checkpoint.py):
greedy output equals `gemmax generate`, 16 concurrent streaming clients all get the reference answer,
a disconnect frees its slot within a second, and `gemmax serve` goes 503 -> 200 and drains on SIGTERM
(with `--no-warm-up`, ready with nothing compiled)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from typer.testing import CliRunner

from fake_engine import read_metric, running_server
from gemmax.cli import app as cli
from gemmax.engine.api import SamplingParams
from gemmax.engine.engine import BatchEngine
from gemmax.engine.generate import generate
from gemmax.engine.loading import load_model
from gemmax.rigs.registry import free_port
from gemmax.server.app import ServerSettings, create_app
from tiny_checkpoint import write_tiny_checkpoint

PROMPT = "Once upon a time there was a small server"
MAX_TOKENS = 16
DTYPE = "float32"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    # float32: with bf16 weights the tiny model's logits are bf16-rounded and exact ties between top
    # tokens are common, so greedy picks would hinge on summation order rather than on the server.
    return load_model(str(checkpoint), DTYPE)


@pytest.fixture(scope="module")
def server(checkpoint, loaded):
    # 1024 tokens: the disconnect test's stream must outlast its one-second window (256 did not fit it)
    engine = BatchEngine(loaded, max_model_len=1024, max_batch=4, buckets=(32, 128)).start()
    settings = ServerSettings(served_model_name="tiny", model_root=str(checkpoint))
    with running_server(create_app(engine, loaded.tokenizer, settings)) as url:
        assert engine.wait_ready(300)
        yield url, engine


def reference(loaded, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """gemmax.engine.generate: the single-request reference path behind `gemmax generate`."""
    ckpt = loaded.checkpoint
    return generate(ckpt.params, ckpt.config, ids, max_tokens, SamplingParams(), loaded.policy.precision())


def test_greedy_equals_gemmax_generate(server, checkpoint, loaded):
    url, _ = server
    result = CliRunner().invoke(cli, ["generate", "--model", str(checkpoint), "--prompt", PROMPT,
                                      "--max-tokens", str(MAX_TOKENS), "--dtype", DTYPE, "--json"])
    assert result.exit_code == 0, result.output
    expected = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(expected["token_ids"]) >= 4  # a real answer, not an immediate eos
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == expected["token_ids"]
    assert r.choices[0].text == expected["text"]
    assert r.usage.completion_tokens == len(expected["token_ids"])
    assert r.usage.prompt_tokens == len(loaded.tokenizer.encode(PROMPT))
    assert r.usage.model_extra["uncompiled_shape"] is False and r.usage.model_extra["prefill_bucket"] == 32

    text, ids = "", []
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"return_token_ids": True}):
        text += chunk.choices[0].text
        ids += chunk.choices[0].model_extra["token_ids"]
    assert ids == expected["token_ids"] and text == expected["text"]

    messages = [{"role": "user", "content": "Hello"}]
    chat_ids = loaded.tokenizer.encode_chat(messages)
    want = reference(loaded, chat_ids)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == chat_ids
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].message.content == loaded.tokenizer.decode(want)


def test_n_seeds_and_stop_strings(server, loaded):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    sampled = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"return_token_ids": True})
    r = client.completions.create(**sampled, n=3, seed=7)
    ids = [c.model_extra["token_ids"] for c in r.choices]
    assert len({tuple(i) for i in ids}) == 3  # three different samples
    for j in range(3):  # choice j is the request with seed 7 + j, alone in its own call
        alone = client.completions.create(**sampled, seed=7 + j)
        assert alone.choices[0].model_extra["token_ids"] == ids[j]
    assert r.usage.completion_tokens == sum(len(i) for i in ids)

    greedy = reference(loaded, loaded.tokenizer.encode(PROMPT))
    full = loaded.tokenizer.decode(greedy)
    stop = loaded.tokenizer.decode(greedy[4:6])
    assert stop and stop in full
    expected = full[: full.index(stop)]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=MAX_TOKENS, temperature=0, n=2,
        stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    want = loaded.tokenizer.decode(reference(loaded, loaded.tokenizer.encode_chat([{"role": "user", "content": "Hello"}])))
    assert texts == {0: want, 1: want} and chunks[-1].usage.completion_tokens > 0


async def test_sixteen_concurrent_streaming_clients(server, loaded):
    url, _ = server
    prompts = [[loaded.tokenizer.bos_token_id, *range(300 + 7 * i, 300 + 7 * i + 9)] for i in range(16)]
    expected = [reference(loaded, p) for p in prompts]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

    async def one(prompt):
        ids, text, finish, usage = [], "", None, None
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True})
        async for chunk in stream:
            if chunk.choices:
                ids += chunk.choices[0].model_extra["token_ids"]
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            else:
                usage = chunk.usage
        return ids, text, finish, usage

    results = await asyncio.gather(*(one(p) for p in prompts))
    await client.close()
    for want, (ids, text, finish, usage) in zip(expected, results, strict=True):
        assert ids == want and text == loaded.tokenizer.decode(want)
        assert finish == ("length" if len(want) == MAX_TOKENS else "stop")
        assert usage.completion_tokens == len(want)
    assert max(u.model_extra["queue_seconds"] for *_, u in results) > 0  # 16 clients, 4 slots: some waited
    assert read_metric(url, "gemmax:kv_slots_in_use") == 0


def test_disconnect_frees_the_slot(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="tiny", prompt="abc", max_tokens=1000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 2:
            break
    assert read_metric(url, "gemmax:kv_slots_in_use") == 1
    stream.close()
    start = time.perf_counter()
    while read_metric(url, "gemmax:kv_slots_in_use") != 0:
        assert time.perf_counter() - start < 1.0, "slot still in use a second after the client left"
        time.sleep(0.02)


@contextlib.contextmanager
def _serving(checkpoint, *flags: str):
    """`gemmax serve` of the tiny checkpoint in a subprocess: yields (base URL, the /health statuses seen
    until the first 200) once ready; on exit SIGTERM, which must end it with status 0, then checks its
    log names the device policy."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "gemmax.cli", "serve", "--model", str(checkpoint), "--port",
                             str(port), "--max-model-len", "64", "--max-batch", "2", "--served-model-name", "tiny",
                             *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        deadline = time.time() + 300
        while not seen or seen[-1][0] != 200:
            assert time.time() < deadline and proc.poll() is None, "gemmax serve did not become ready"
            with contextlib.suppress(httpx.TransportError):
                r = httpx.get(f"{url}/health", timeout=5)
                seen.append((r.status_code, r.json()["status"]))
            time.sleep(0.1)
        yield url, seen
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    assert "gemmax device policy" in output


def _chat(url: str):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 0
    return r


def test_gemmax_serve_health_and_sigterm(checkpoint):
    with _serving(checkpoint, "--batch-invariant") as (url, seen):
        assert seen[0][0] == 503 and seen[0][1] in ("loading", "warming")
        health = httpx.get(f"{url}/health").json()
        assert health["policy"]["platform"] == "cpu" and health["precision"]["weights"] == "bfloat16"
        assert health["weight_bytes"] > 0 and health["max_model_len"] == 64 and health["slots"]["total"] == 2
        assert health["batch_invariant"] is True  # the flag reached the engine
        assert health["warmup"]["warm_up"] is True and health["warmup"]["shapes"] > 0
        assert _chat(url).usage.model_extra["uncompiled_shape"] is False  # warmed up


def _unboxed(output: str) -> str:
    """A CLI error's text without the panel rich draws around it, its lines joined (rich wraps them
    at the terminal's width)."""
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", output).split())


def test_one_process_options_are_refused_with_several_before_anything_loads(checkpoint):
    """--draft-model and --no-warm-up run in one process: refused whichever way several are asked for
    (the flags, or JAX_COORDINATOR_ADDRESS as a launcher sets it), before the model loads."""
    asks = [(["--num-processes", "2"], {}), (["--coordinator", "127.0.0.1:1"], {}),
            ([], {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"})]
    for flags, env in asks:
        draft = CliRunner().invoke(cli, ["serve", "--model", str(checkpoint), "--speculative", "draft", "--draft-model",
                                         str(checkpoint), *flags], env=env)
        assert draft.exit_code == 2 and "--draft-model runs on one device and one process" in _unboxed(draft.output)
        lazy = CliRunner().invoke(cli, ["serve", "--model", str(checkpoint), "--no-warm-up", *flags], env=env)
        assert lazy.exit_code == 2 and "--no-warm-up runs in one process" in _unboxed(lazy.output)


def test_gemmax_serve_without_warm_up_compiles_on_first_use(checkpoint):
    """`--no-warm-up`: ready with no declared shape compiled; the first request compiles what it needs
    and says so, the same request again does not."""
    with _serving(checkpoint, "--no-warm-up") as (url, _):
        warmup = httpx.get(f"{url}/health").json()["warmup"]
        assert warmup["warm_up"] is False and warmup["executables"] == 0 and warmup["shapes_declared"] > 0
        assert _chat(url).usage.model_extra["uncompiled_shape"] is True
        assert _chat(url).usage.model_extra["uncompiled_shape"] is False
        health = httpx.get(f"{url}/health").json()
        assert health["warmup"]["executables"] == 0  # the report at ready
        assert health["executables_now"]["executables"] > 0  # what the requests compiled


async def test_a_request_the_engine_cannot_represent_hurts_no_other(server, loaded):
    """top_k = 2**31 used to overflow inside the engine step: every stream in flight failed and the
    offending request got a 500. Now it is a 400 and the streams finish with their reference text."""
    url, engine = server
    prompts = [[loaded.tokenizer.bos_token_id, *range(400 + 5 * i, 405 + 5 * i)] for i in range(3)]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

    async def one(prompt):
        ids = []
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True})
        async for chunk in stream:
            ids += chunk.choices[0].model_extra["token_ids"]
        return ids

    streams = [asyncio.create_task(one(p)) for p in prompts]
    while engine.stats().running == 0:
        await asyncio.sleep(0.01)
    for extra in ({"top_k": 2**31}, {"temperature": 1e9}, {"stop_token_ids": [10**6]}):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="tiny", prompt="hi", max_tokens=4, extra_body=extra)
        assert info.value.body["param"] == next(iter(extra))
    results = await asyncio.gather(*streams)
    await client.close()
    assert results == [reference(loaded, p) for p in prompts]


async def test_a_short_soak_loses_and_corrupts_nothing(server):
    """benchmarks/soak.py for a few seconds: 8 streaming clients on 4 slots, every text checked
    against the sequential run."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("soak", Path(__file__).parents[1] / "benchmarks" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = soak  # dataclasses look their module up
    spec.loader.exec_module(soak)
    summary = await soak.soak(server[0], clients=8, seconds=4, max_tokens=8, prompts=soak.PROMPTS[:6],
                              pid=os.getpid())
    assert soak.healthy(summary), summary
    assert summary["completed"] >= 8 and summary["rss_end_mb"] > 0
    assert "lost" in soak.table(summary)
