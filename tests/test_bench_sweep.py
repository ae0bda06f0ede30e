"""The sweep against scripted servers: decode-source choice, gauge resolution flags, warm-up
exclusion, exact prompt lengths with unique nonces, output forcing, server state before and after."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from bench_fake_server import FakeServer, Script, train_tokenizer
from gemmax.bench.metrics import tick_of
from gemmax.bench.prompts import FIRST_ID, NONCE_IDS
from gemmax.bench.sweep import Sweep, SweepConfig, parse_sampling

# Timed to the millisecond against scripted delays: `make test` runs this module alone, not beside a
# worker that compiles on both cores (pyproject.toml's markers).
pytestmark = pytest.mark.wire_timing


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer()


async def sweep(server: FakeServer, **kwargs) -> dict:
    await server.start()
    try:
        return await Sweep(SweepConfig(base_url=server.base_url, **kwargs)).run()
    finally:
        await server.stop()


async def test_auto_picks_both_with_a_gauge_and_stream_without():
    fast = dict(ttft=0.01, itl=0.01)
    with_gauge = await sweep(FakeServer(Script(**fast, gauge=lambda x: x)), input_lens=(8,), output_len=6, repeats=1)
    without = await sweep(FakeServer(Script(**fast)), input_lens=(8,), output_len=6, repeats=1)
    assert with_gauge["decode_source"] == "both"
    assert without["decode_source"] == "stream"
    (cell,) = with_gauge["cells"]
    # both figures come from the same streamed request: the ratio is gauge / wire per request
    for r in cell["requests"]:
        assert r["ratio"] == pytest.approx(r["gauge"] / r["decode_tok_s"])
    assert cell["ratio"]["median"] == pytest.approx(1.0, abs=0.05)
    (cell,) = without["cells"]
    assert cell["gauge"] is None and cell["ratio"] is None and cell["stream"]["median"] > 0


async def test_gauge_source_needs_a_gauge():
    with pytest.raises(RuntimeError, match="decode_tokens_per_second"):
        await sweep(FakeServer(Script(ttft=0.01, itl=0.01)), input_lens=(8,), output_len=4, repeats=1,
                    decode_source="gauge")


async def test_gauge_quantised_to_a_tenth_at_13_tok_s_is_flagged():
    # 30 tokens at 13 tok/s: 2.2 s per request, long enough that loopback jitter keeps the wire's
    # run-to-run spread well under the 0.77% tick of a one-decimal gauge. Both runs go together.
    pace = dict(ttft=0.02, itl=1 / 13)
    args = dict(input_lens=(8,), output_len=30, repeats=3, decode_source="both")
    coarse, fine = await asyncio.gather(sweep(FakeServer(Script(**pace, gauge=lambda x: round(x, 1))), **args),
                                        sweep(FakeServer(Script(**pace, gauge=lambda x: x)), **args))
    (cell,) = coarse["cells"]
    res = cell["gauge_resolution"]
    assert cell["gauge"]["median"] == pytest.approx(13.0, abs=0.3)
    assert res["tick"] == pytest.approx(0.1)
    assert res["resolution"] == pytest.approx(0.1 / cell["gauge"]["median"])
    assert res["spread"] == cell["stream"]["spread"] < res["resolution"]
    assert res["flagged"] is True
    assert any("gauge tick" in flag for flag in cell["flags"])
    (cell,) = fine["cells"]
    assert cell["gauge_resolution"]["flagged"] is False
    assert not any("gauge tick" in flag for flag in cell["flags"])


def test_tick_of_reads_the_printed_resolution():
    assert tick_of(12.8) == pytest.approx(0.1)
    assert tick_of(13) == 1.0
    assert tick_of(12.8341) == pytest.approx(1e-4)
    assert tick_of(float(json.loads("13.05"))) == pytest.approx(0.01)


async def test_warmup_records_are_excluded_from_medians():
    # The first request of each (prompt length, max_tokens) shape is slow, like a compile.
    def script(served, shape_count):
        return Script(ttft=0.30, itl=0.04) if shape_count == 1 else Script(ttft=0.01, itl=0.004)

    server = FakeServer(script)
    result = await sweep(server, input_lens=(8, 16), output_len=5, repeats=2, concurrency=(1, 2))
    assert len(server.served) == 1 + 2 * (1 * (1 + 2) + 2 * (1 + 2))  # probe; per input: c x (warm-up + 2)
    for cell in result["cells"]:
        c = cell["concurrency"]
        assert len(cell["warmup"]) == c and len(cell["requests"]) == 2 * c
        measured = [r["ttft_ms"] for r in cell["requests"]]
        assert cell["median_ttft_ms"] == pytest.approx(float(np.median(measured)))
        assert cell["completed"] == len(measured)
        assert max(measured) < 300 and cell["ttft"]["max"] < 300
        assert cell["stream"]["min"] > 1000 / 40 * 2  # no slow (25 tok/s) request in the stats
        if c == 1 and cell["input_len"] == 16:  # the first request of each new shape was the warm-up
            assert cell["warmup"][0]["ttft_ms"] >= 300
    assert result["probe"]["ttft_ms"] >= 300  # the probe asks the first cell's shape (8 in, 5 out) first


async def test_exact_input_counts_with_the_servers_tokenizer(bpe):
    server = FakeServer(Script(ttft=0.005, itl=0.002), tokenizer=bpe)
    result = await sweep(server, input_lens=(41, 97, 300), output_len=2, repeats=1, concurrency=(2,))
    assert result["prompt_mode"] == "server"
    for cell in result["cells"]:
        assert cell["input_len_verified"] is True
        assert all(r["prompt_tokens"] == cell["input_len"] for r in cell["requests"] + cell["warmup"])
    counts = {s.prompt_tokens for s in server.served[1:]}
    assert counts == {41, 97, 300}
    heads = [bpe.encode(s.body["prompt"]).ids[:8] for s in server.served]
    assert len({tuple(h) for h in heads}) == len(heads)  # every prompt differs within its first tokens


async def test_exact_input_counts_with_a_local_tokenizer(bpe, tmp_path):
    bpe.save(str(tmp_path / "tokenizer.json"))
    server = FakeServer(Script(ttft=0.005, itl=0.002), tokenizer=bpe, tokenize_endpoint=False)
    result = await sweep(server, input_lens=(57, 130), output_len=2, repeats=1, tokenizer=tmp_path)
    assert result["prompt_mode"] == "local"
    assert [c["input_len_verified"] for c in result["cells"]] == [True, True]
    assert {s.prompt_tokens for s in server.served[1:]} == {57, 130}


async def test_token_id_prompts_without_a_tokenizer():
    server = FakeServer(Script(ttft=0.005, itl=0.002), vocab_size=96)
    result = await sweep(server, input_lens=(5, 33), output_len=2, repeats=2, concurrency=(3,))
    assert result["prompt_mode"] == "ids"
    prompts = [s.body["prompt"] for s in server.served]
    assert all(isinstance(p, list) and all(FIRST_ID <= i < 96 for i in p) for p in prompts)
    assert sorted({len(p) for p in prompts[1:]}) == [5, 33]
    assert len({tuple(p[:NONCE_IDS]) for p in prompts}) == len(prompts)  # unique nonce per request
    assert all(c["input_len_verified"] for c in result["cells"])


async def test_token_id_prompts_need_a_vocabulary_size():
    with pytest.raises(ValueError, match="vocab"):
        await sweep(FakeServer(Script(), vocab_size=None), input_lens=(8,), output_len=2, repeats=1)


async def test_output_forcing_falls_back_and_lengths_are_checked():
    server = FakeServer(Script(ttft=0.005, itl=0.002), accept_forcing=False)
    result = await sweep(server, input_lens=(8,), output_len=4, repeats=1)
    assert result["forced_output"] is False
    assert all("ignore_eos" not in s.body for s in server.served[2:])
    assert result["cells"][0]["completed"] == 1

    short = FakeServer(lambda served, n: Script(ttft=0.005, itl=0.002, short_by=1 if served.body["max_tokens"] == 6 else 0))
    result = await sweep(short, input_lens=(8,), output_len=6, repeats=1)
    assert all(s.body["ignore_eos"] is True and s.body["min_tokens"] == s.body["max_tokens"] for s in short.served)
    (cell,) = result["cells"]
    assert cell["output_len_verified"] is False
    assert any("output length not held" in flag for flag in cell["flags"])


async def test_sampling_settings_reach_every_request_and_the_result():
    greedy_server = FakeServer(Script(ttft=0.005, itl=0.002))
    greedy = await sweep(greedy_server, input_lens=(8,), output_len=4, repeats=1)
    assert greedy["sampling"] == "greedy" and all(s.body["temperature"] == 0.0 for s in greedy_server.served)

    settings = parse_sampling("temperature=0.7,top_p=0.9,top_k=40")
    assert settings == (("temperature", 0.7), ("top_p", 0.9), ("top_k", 40))
    server = FakeServer(Script(ttft=0.005, itl=0.002))
    result = await sweep(server, input_lens=(8,), output_len=4, repeats=1, sampling=settings)
    assert result["sampling"] == "temperature=0.7,top_p=0.9,top_k=40"
    assert server.served and all((s.body["temperature"], s.body["top_p"], s.body["top_k"]) == (0.7, 0.9, 40)
                                 for s in server.served)
    for bad in ("temperature", "seed=3", "top_k=0.5"):
        with pytest.raises(ValueError, match="sampling"):
            parse_sampling(bad)


async def test_health_precision_and_degenerate_counter_before_and_after():
    precision = {"weights": "int8", "activations": "bfloat16", "kv_cache": "bfloat16"}
    server = FakeServer(Script(ttft=0.005, itl=0.002), precision=precision, degenerate_every=2)
    result = await sweep(server, input_lens=(8,), output_len=2, repeats=3)
    s = result["server"]
    assert s["precision_before"] == s["precision_after"] == precision
    assert s["degenerate_responses_before"] == 0
    assert s["degenerate_responses_after"] == len(server.served) // 2
    assert s["degenerate_responses_delta"] == len(server.served) // 2


async def test_request_rate_mode_and_cost():
    server = FakeServer(Script(ttft=0.005, itl=0.002))
    result = await sweep(server, input_lens=(8,), output_len=3, repeats=2, request_rates=(50.0,), num_prompts=4,
                         price_per_hour=3.6)
    (cell,) = result["cells"]
    assert cell["request_rate"] == 50.0 and cell["concurrency"] is None
    assert cell["completed"] == 8 and len(cell["warmup"]) == 4
    assert cell["total_output_tokens"] == 8 * 3
    assert cell["output_throughput"] == pytest.approx(cell["total_output_tokens"] / cell["duration"])
    assert cell["cost_per_million_output_tokens"] == pytest.approx(3.6 / 3600 / cell["output_throughput"] * 1e6)


async def test_vllm_field_names():
    result = await sweep(FakeServer(Script(ttft=0.005, itl=0.002)), input_lens=(8,), output_len=3, repeats=1)
    (cell,) = result["cells"]
    for name in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                 "request_throughput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
                 "ttfts", "itls", "errors"):
        assert name in cell
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert isinstance(cell[f"{stat}_{metric}_ms"], float)


async def test_the_probe_asks_no_more_tokens_than_the_sweep():
    """A server whose context holds the sweep's requests (8 + 4 tokens) but not 8 + 8: the probe asks
    for the sweep's 4, so the sweep runs, forced."""
    server = FakeServer(lambda served, n: Script(ttft=0.005, itl=0.002, status=400 if served.body["max_tokens"] > 4 else 200))
    result = await sweep(server, input_lens=(8,), output_len=4, repeats=1)
    assert result["forced_output"] is True and result["cells"][0]["completed"] == 1
    assert {s.body["max_tokens"] for s in server.served} == {4}


async def test_an_unreachable_server_or_a_refused_model_list_says_so():
    from gemmax.rigs.registry import free_port

    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    for model in (None, "m"):
        with pytest.raises(RuntimeError, match=f"cannot reach {dead}/v1/models"):
            await Sweep(SweepConfig(base_url=dead, model=model, input_lens=(8,), output_len=2, repeats=1)).run()
    server = FakeServer(Script())

    @server.app.middleware("http")
    async def refuse(request, call_next):  # a server that wants a key
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": {"message": "no key"}}, status_code=401)

    with pytest.raises(RuntimeError, match=r"/v1/models answered HTTP 401 \(check --api-key\)"):
        await sweep(server, model="m", input_lens=(8,), output_len=2, repeats=1)


async def test_a_server_gone_between_cells_keeps_the_measured_cells(bpe):
    """Text prompts are counted by the server's /tokenize before each cell: when it stops answering
    after the first cell, the sweep ends with `aborted` and the first cell kept."""
    server = FakeServer(Script(ttft=0.005, itl=0.002), tokenizer=bpe)
    sent = []

    def on_request(record):
        sent.append(record)
        if len(sent) == 3:  # probe, warm-up and the one measured request of the first cell
            server.tokenize_endpoint = False

    await server.start()
    try:
        result = await Sweep(SweepConfig(base_url=server.base_url, input_lens=(41, 97), output_len=4, repeats=1),
                             on_request).run()
    finally:
        await server.stop()
    assert [c["input_len"] for c in result["cells"]] == [41] and result["cells"][0]["completed"] == 1
    assert result["aborted"].startswith("the sweep stopped after 1 of 2 cells: HTTPStatusError")
    assert result["server"]["health_after"] is not None  # the end of the run is still recorded


async def test_a_stream_delivered_in_one_event_is_flagged():
    """A server (or a proxy) that buffers the whole answer into one event: its TPOT is 0 and the wire
    shows no decode rate, which the cell says instead of printing a blank."""
    result = await sweep(FakeServer(Script(ttft=0.005, itl=0.002, tokens_per_chunk=6)), input_lens=(8,),
                         output_len=6, repeats=2)
    (cell,) = result["cells"]
    assert cell["stream"] is None and cell["decode_tok_s"] is None
    assert "2 of 2 requests delivered all their tokens in one event" in "; ".join(cell["flags"])
    chunked = await sweep(FakeServer(Script(ttft=0.005, itl=0.002, tokens_per_chunk=2)), input_lens=(8,),
                          output_len=6, repeats=1)
    assert not any("one event" in flag for flag in chunked["cells"][0]["flags"])
