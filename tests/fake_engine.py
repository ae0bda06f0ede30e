"""A fake engine with hand-checkable output, and a loopback uvicorn runner for server tests.

`FakeEngine` implements `gemmax.engine.api.Engine` for real (background thread, slots, a waiting
queue, cancellation, timings, drain on shutdown) but "generates" by rule instead of with a model:

- greedy (temperature 0): the prompt's content ids (specials removed) in order, then the first eos
  id; after that the same cycle again (with `ignore_eos` the eos id is emitted and generation goes
  on), so "Hello world" answers "Hello world";
- temperature > 0: content ids drawn with `random.Random(seed)`, the eos id every len(content) + 1
  tokens: the same seed gives the same answer, different seeds different ones;
- an eos / stop id before `min_tokens` is skipped (the next id of the cycle comes instead);
- logprobs: the chosen id gets -0.25, the k top entries are (id, -0.25), (id + 1, -1.25), ...;
- degeneracy: flagged when the last 8 ids are one id repeated;
- requests are validated by the engine's own `validate_request`, and the wait queue is bounded by the
  same `Admission` rule as BatchEngine's (`max_queue`);
- `fault_token` in a prompt: the request ends with finish_reason "error"; `crash_token`: submit raises;
  `warmup_error`: warm-up fails and `error` is set (as BatchEngine reports it).

Run as a script it serves a fake engine through `gemmax.server.serve.serve` (the same path as
`gemmax serve`), for the SIGTERM test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path

from gemmax.engine.api import (
    Admission,
    DegeneracyVerdict,
    EngineNotReady,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    RequestHandle,
    RequestTimings,
    TokenEvent,
    validate_request,
)

DEGENERATE_RUN = 8
WARMED_BUCKETS = (16, 32, 64)


class _Run:
    def __init__(self, handle: RequestHandle, content: list[int], submitted: float):
        self.handle = handle
        self.request: GenerationRequest = handle.request
        self.content = content
        self.rng = random.Random(self.request.sampling.seed)
        self.position = 0  # index into the (content + [eos]) cycle
        self.out: list[int] = []
        self.submitted = submitted
        self.admitted = self.first = self.last = 0.0


class FakeEngine:
    def __init__(self, *, special_ids=frozenset(), eos_token_ids=(1,), vocab_size=512, max_model_len=128,
                 max_batch=4, warmup_seconds=0.0, token_delay=0.0, prefill_delay=0.0, fault_token=None,
                 crash_token=None, weight_bytes=123_456, warmup_error=None, max_queue=None):
        self.special_ids = frozenset(special_ids) | frozenset(eos_token_ids)
        self._eos = tuple(eos_token_ids)
        self._max_model_len, self.max_batch = max_model_len, max_batch
        self.vocab_size = vocab_size
        self.warmup_seconds, self.token_delay, self.prefill_delay = warmup_seconds, token_delay, prefill_delay
        self.fault_token, self.crash_token = fault_token, crash_token
        self.weight_bytes = weight_bytes
        self.warmup_error = warmup_error
        self.error: BaseException | None = None  # a failed warm-up, reported like BatchEngine does
        self.submitted: list[GenerationRequest] = []  # every request the server sent, for the tests
        self.admission = Admission(max_queue, max_batch)
        self._cond = threading.Condition()
        self._waiting: deque[_Run] = deque()
        self._active: list[_Run] = []
        self._ready = False
        self._warmed = threading.Event()  # set when warm-up ends, failed or not
        self._accepting = True
        self._stopping = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)

    # Engine protocol ---------------------------------------------------------------------------
    @property
    def info(self) -> dict:
        return {
            "model": "fake", "vocab_size": self.vocab_size, "weight_bytes": self.weight_bytes,
            "max_batch": self.max_batch,
            "policy": {"platform": "cpu", "device_kind": "fake", "compute_capability": None},
            "precision": {"weights": "bfloat16", "activations": "float32", "kv_cache": "float32",
                          "pre_ampere": False},
        }

    @property
    def ready(self) -> bool:
        return self._ready and self._accepting

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def start(self) -> FakeEngine:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._warmed.wait(timeout)
        if self.error is not None:
            raise RuntimeError(f"engine failed to start: {self.error}") from self.error
        return self._warmed.is_set()

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        return self.submit_all([request], loop)[0]

    def submit_all(self, requests, loop: asyncio.AbstractEventLoop | None = None) -> list[RequestHandle]:
        if not self.ready:
            raise EngineNotReady("fake engine is not ready")
        for request in requests:
            validate_request(request, max_model_len=self._max_model_len, vocab_size=self.vocab_size)
            if self.crash_token is not None and self.crash_token in request.prompt_ids:
                raise RuntimeError("fake engine crashed on submit")
        runs = [_Run(RequestHandle(f"fake-{next(self._ids)}", request, loop),
                     [t for t in request.prompt_ids if t not in self.special_ids] or [request.prompt_ids[-1]],
                     time.perf_counter()) for request in requests]
        with self._cond:
            self.admission.check(len(self._waiting), self.max_batch - len(self._active))
            self.submitted.extend(requests)
            self._waiting.extend(runs)
            self._cond.notify()
        return [run.handle for run in runs]

    def stats(self) -> EngineStats:
        with self._cond:
            return EngineStats(running=len(self._active), waiting=len(self._waiting),
                               slots_in_use=len(self._active), slots_total=self.max_batch)

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        deadline = time.perf_counter() + drain_timeout
        with self._cond:
            self._accepting = False
            while (self._active or self._waiting) and time.perf_counter() < deadline:
                self._cond.wait(0.01)
            for run in [*self._active, *self._waiting]:
                run.handle.cancel()
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(5)

    # the "model" -------------------------------------------------------------------------------
    def _next_token(self, run: _Run) -> int:
        cycle = len(run.content) + 1
        k = run.position % cycle
        run.position += 1
        if k == cycle - 1:
            return self._eos[0]
        if run.request.sampling.temperature > 0:
            return run.rng.choice(run.content)
        return run.content[k]

    def _loop(self) -> None:
        time.sleep(self.warmup_seconds)
        if self.warmup_error is not None:
            self.error = RuntimeError(self.warmup_error)
            self._ready = True  # as BatchEngine: ready is set, `error` says it failed
            self._warmed.set()
            return
        self._ready = True
        self._warmed.set()
        while True:
            with self._cond:
                while len(self._active) < self.max_batch and self._waiting:
                    run = self._waiting.popleft()
                    run.admitted = time.perf_counter()
                    self._active.append(run)
                if self._stopping and not self._active and not self._waiting:
                    return
                if not self._active:
                    self._cond.wait(0.05)
                    continue
                active = list(self._active)
            if self.prefill_delay and any(not r.out for r in active):
                time.sleep(self.prefill_delay)
            for run in active:
                outcome = self._step(run)
                if outcome is not None:
                    with self._cond:
                        self._active.remove(run)
                        self._cond.notify_all()
                    run.handle.finish(self._result(run, *outcome))
            if self.token_delay:
                time.sleep(self.token_delay)

    def _step(self, run: _Run) -> tuple[str, int | None, str | None] | None:
        """Emit one token; (finish_reason, stop id, error) when the request ends, else None."""
        req = run.request
        if run.handle.cancelled:
            return "cancelled", None, None
        if self.fault_token is not None and self.fault_token in req.prompt_ids:
            return "error", None, "fake fault in the engine"
        stops = set(req.stop_token_ids) | (set() if req.ignore_eos else set(self._eos))
        token = self._next_token(run)
        while token in stops and len(run.out) < req.min_tokens:
            token = self._next_token(run)
        if token in stops:
            return "stop", token, None
        now = time.perf_counter()
        run.first = run.first or now
        run.last = now
        run.out.append(token)
        logprob = top = None
        if req.logprobs is not None:
            logprob = -0.25
            top = tuple(((token + i) % self.vocab_size, -0.25 - i) for i in range(req.logprobs))
        run.handle.put(TokenEvent(token, logprob, top))
        if len(run.out) >= req.max_tokens:
            return "length", None, None
        return None

    def _result(self, run: _Run, finish: str, stop_id: int | None, error: str | None) -> GenerationResult:
        n = len(run.request.prompt_ids)
        bucket = max(16, 1 << (n - 1).bit_length())
        decode = run.last - run.first if run.out else 0.0
        timings = RequestTimings(
            queue_seconds=run.admitted - run.submitted, prefill_seconds=self.prefill_delay,
            time_to_first_token_seconds=(run.first - run.submitted) if run.out else 0.0,
            decode_seconds=decode,
            decode_tokens_per_second=(len(run.out) - 1) / decode if len(run.out) > 1 and decode > 0 else 0.0,
            prefill_bucket=bucket, pad_tokens=bucket - n, uncompiled_shape=bucket not in WARMED_BUCKETS,
        )
        tail = run.out[-DEGENERATE_RUN:]
        degenerate = len(tail) == DEGENERATE_RUN and len(set(tail)) == 1
        verdict = DegeneracyVerdict(degenerate, f"token loop: period 1 repeated {DEGENERATE_RUN} times in the tail"
                                    if degenerate else None)
        return GenerationResult(tuple(run.out), finish, n, timings, verdict, stop_id, error)


def fake_for(tokenizer, **kwargs) -> FakeEngine:
    """A FakeEngine whose specials and eos ids match a tests/tiny_checkpoint.py tokenizer."""
    from tiny_checkpoint import EOS_ID, SPECIALS, TURN_CLOSE_ID

    specials = {tokenizer.token_to_id(s) for s in SPECIALS}
    return FakeEngine(special_ids=specials, eos_token_ids=(EOS_ID, TURN_CLOSE_ID),
                      vocab_size=tokenizer.vocab_size, **kwargs)


@contextlib.contextmanager
def running_server(app, graceful_seconds: float = 5.0):
    """Serve `app` with uvicorn on a free loopback port in a background thread; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=graceful_seconds))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def fake_server(tokenizer, settings=None, wait_ready: bool = True, **engine_kwargs):
    """A FakeEngine behind the real app on loopback; yields (base_url, engine, app)."""
    from gemmax.server.app import ServerSettings, create_app

    engine = fake_for(tokenizer, **engine_kwargs).start()
    settings = settings or ServerSettings(served_model_name="tiny", model_root="/models/tiny")
    app = create_app(engine, tokenizer, settings)
    with running_server(app) as url:
        deadline = time.time() + 30
        while wait_ready and not engine.ready and time.time() < deadline:
            time.sleep(0.01)
        yield url, engine, app


def read_metric(url: str, name: str, labels: dict[str, str] | None = None, headers=None) -> float | None:
    """One sample of /metrics, parsed with prometheus_client's parser (None when absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return sample.value
    return None


def main() -> int:
    from gemmax.server.app import ServerSettings
    from gemmax.server.serve import serve
    from gemmax.weights.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uds", help="listen on this Unix socket instead of --port")
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--warmup-seconds", type=float, default=0.0)
    parser.add_argument("--drain-timeout", type=float, default=10.0)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)

    def load():
        return fake_for(tokenizer, token_delay=args.token_delay, warmup_seconds=args.warmup_seconds).start(), tokenizer

    settings = ServerSettings(served_model_name="fake", drain_timeout=args.drain_timeout)
    return serve(load, settings, port=args.port, log_level="info", uds=args.uds)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
