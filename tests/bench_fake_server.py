"""A scripted OpenAI-compatible server for the benchmark harness tests: a real HTTP server on loopback
(FastAPI under uvicorn) whose token timings, gauge, failures and tokenizer are chosen by the test.

Each streamed token is sent at an absolute deadline (request arrival + ttft + the scripted gaps), and
the server notes `perf_counter()` as it hands each chunk to the transport, so a test can compare the
harness's wire timings with the instants the bytes left (same process, same clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
from collections.abc import Callable
from time import perf_counter
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest


@dataclasses.dataclass
class Script:
    ttft: float = 0.05  # arrival -> first token chunk (s)
    gaps: tuple[float, ...] | None = None  # gaps between token chunks; default: `itl` repeated
    itl: float = 0.01
    empty_first_chunk: float | None = None  # send a chunk with empty text this long after arrival
    fail_after: int | None = None  # break the connection after this many token chunks
    error_event_after: int | None = None  # send an in-band error event after this many chunks
    raw_event: str | None = None  # with raw_event_after: this SSE data sent as it is (a malformed event)
    raw_event_after: int | None = None
    status: int = 200  # non-200: answer with an error body instead of a stream
    tokens_per_chunk: int = 1
    report_usage: bool = True
    gauge: Callable[[float], float] | None = None  # server-measured tok/s -> reported gauge
    short_by: int = 0  # generate this many fewer tokens than asked (an engine ignoring min_tokens)


@dataclasses.dataclass
class Served:
    """What the server saw and sent for one completion request."""

    body: dict[str, Any]
    prompt_tokens: int
    arrival: float
    send_times: list[float] = dataclasses.field(default_factory=list)  # token chunks only
    empty_time: float | None = None


class FakeServer:
    def __init__(self, script: Script | Callable[[Served, int], Script] = Script(), *,
                 tokenizer=None, tokenize_endpoint: bool = True, vocab_size: int | None = 128,
                 accept_forcing: bool = True,
                 precision: dict | None = None, degenerate_every: int | None = None, model: str = "fake-model"):
        self.script = script
        self.tokenizer = tokenizer  # tokenizers.Tokenizer counting text prompts, or None (token ids only)
        self.tokenize_endpoint = tokenize_endpoint and tokenizer is not None
        self.vocab_size = vocab_size
        self.accept_forcing = accept_forcing
        self.precision = precision or {"weights": "bfloat16", "activations": "bfloat16", "kv_cache": "bfloat16"}
        self.degenerate_every = degenerate_every
        self.model = model
        self.served: list[Served] = []
        self.shapes_seen: dict[tuple[int, int], int] = {}
        self.registry = CollectorRegistry()
        self.degenerate = Counter("gemmax:degenerate_responses", "degenerate responses", registry=self.registry)
        self.app = self._build()
        self.port: int | None = None
        self._server: uvicorn.Server | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids) + 1  # + <bos>, as the Gemma servers count

    def _script_for(self, served: Served, shape_count: int) -> Script:
        return self.script(served, shape_count) if callable(self.script) else self.script

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            entry = {"id": self.model, "object": "model", "root": self.model, "max_model_len": 8192}
            if self.vocab_size is not None:
                entry["vocab_size"] = self.vocab_size
            return {"object": "list", "data": [entry]}

        @app.get("/health")
        async def health():
            return {"status": "ok", "precision": self.precision}

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.registry), media_type="text/plain")

        @app.post("/tokenize")
        async def tokenize(request: Request):
            if not self.tokenize_endpoint:
                return JSONResponse({"error": {"message": "no tokenizer"}}, status_code=404)
            body = await request.json()
            ids = [2, *self.tokenizer.encode(body["prompt"]).ids]
            return {"tokens": ids, "count": len(ids), "max_model_len": 8192}

        @app.post("/v1/completions")
        async def completions(request: Request):
            arrival = perf_counter()
            body = await request.json()
            if not self.accept_forcing and ("ignore_eos" in body or "min_tokens" in body):
                return JSONResponse({"error": {"message": "unknown field ignore_eos"}}, status_code=400)
            prompt = body["prompt"]
            n_prompt = len(prompt) if isinstance(prompt, list) else self.count(prompt)
            served = Served(body=body, prompt_tokens=n_prompt, arrival=arrival)
            shape = (n_prompt, body["max_tokens"])
            self.shapes_seen[shape] = self.shapes_seen.get(shape, 0) + 1
            script = self._script_for(served, self.shapes_seen[shape])
            self.served.append(served)
            if self.degenerate_every and len(self.served) % self.degenerate_every == 0:
                self.degenerate.inc()
            if script.status != 200:
                return JSONResponse({"error": {"message": "scripted failure"}}, status_code=script.status)
            n_out = body["max_tokens"] - script.short_by
            return StreamingResponse(self._stream(served, script, n_out, body), media_type="text/event-stream")

        return app

    async def _stream(self, served: Served, script: Script, n_out: int, body: dict):
        def chunk(text: str, ids: list[int], finish: str | None) -> str:
            return "data: " + json.dumps({"id": "cmpl-fake", "object": "text_completion", "model": self.model,
                                          "choices": [{"index": 0, "text": text, "token_ids": ids,
                                                       "finish_reason": finish}]}) + "\n\n"

        async def until(t: float) -> None:
            await asyncio.sleep(max(0.0, t - perf_counter()))

        if script.empty_first_chunk is not None:
            await until(served.arrival + script.empty_first_chunk)
            served.empty_time = perf_counter()
            yield "data: " + json.dumps({"id": "cmpl-fake", "object": "text_completion", "model": self.model,
                                         "choices": [{"index": 0, "text": "", "finish_reason": None}]}) + "\n\n"
        n_chunks = -(-n_out // script.tokens_per_chunk)
        gaps = script.gaps or (script.itl,) * (n_chunks - 1)
        deadline = served.arrival + script.ttft
        emitted = 0
        for k in range(n_chunks):
            if k:
                deadline += gaps[k - 1]
            if script.fail_after is not None and k == script.fail_after:
                raise RuntimeError("scripted connection failure")
            if script.raw_event_after is not None and k == script.raw_event_after:
                yield f"data: {script.raw_event}\n\n"
            if script.error_event_after is not None and k == script.error_event_after:
                yield "data: " + json.dumps({"error": {"message": "scripted engine error"}}) + "\n\n"
                return
            await until(deadline)
            size = min(script.tokens_per_chunk, n_out - emitted)
            emitted += size
            finish = "length" if emitted == n_out else None
            served.send_times.append(perf_counter())
            yield chunk(" tok" * size, list(range(10, 10 + size)), finish)
        if script.report_usage and body.get("stream_options", {}).get("include_usage"):
            usage: dict[str, Any] = {"prompt_tokens": served.prompt_tokens, "completion_tokens": n_out,
                                     "total_tokens": served.prompt_tokens + n_out}
            times = served.send_times
            if script.gauge is not None and len(times) > 1:
                usage["decode_tokens_per_second"] = script.gauge((n_out - 1) / (times[-1] - times[0]))
            yield "data: " + json.dumps({"id": "cmpl-fake", "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    # ----- running it -----

    async def start(self) -> FakeServer:
        """Serve on a free loopback port in the running event loop."""
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self._server.should_exit = True
        await self._task

    @contextlib.contextmanager
    def in_thread(self):
        """Serve from a background thread (for synchronous callers such as the CLI runner)."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.start())
            ready.set()
            loop.run_until_complete(self._task)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        ready.wait(30)
        try:
            yield self
        finally:
            self._server.should_exit = True
            thread.join(30)
            loop.close()


def train_tokenizer(vocab_size: int = 400):
    """A real byte-level BPE (the `tokenizers` library) trained on the harness's filler prose, so
    token counts are not a linear function of words or characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from gemmax.bench.prompts import filler_text

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([filler_text(20000, seed) for seed in range(5)], trainer)
    return tokenizer
