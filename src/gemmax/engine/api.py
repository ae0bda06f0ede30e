"""The engine's small interface: what the server (or a fake engine in tests) relies on.

The engine knows nothing about HTTP or text: requests are token ids in, token ids out. A request is
submitted, its tokens are streamed through a `RequestHandle` (sync iteration or `async for`), it can
be cancelled at any time (its slot is freed at once), and it ends with one `GenerationResult` that
carries the server-side timings and the degeneracy verdict.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "cancelled", "error"]
MAX_LOGPROBS = 20  # top logprobs per token at most (OpenAI's and vLLM's default bound)


class PromptTooLong(ValueError):
    """prompt_tokens + 1 > max_model_len: refused at submit time, with both numbers."""

    def __init__(self, prompt_tokens: int, max_model_len: int):
        self.prompt_tokens, self.max_model_len = prompt_tokens, max_model_len
        super().__init__(
            f"prompt has {prompt_tokens} tokens but max_model_len is {max_model_len}: "
            f"at most {max_model_len - 1} prompt tokens leave room for one generated token"
        )


class EngineNotReady(RuntimeError):
    """Submitted before warm-up finished, or after shutdown began."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy (seed ignored)
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()  # in addition to the checkpoint's eos ids (unless ignore_eos)
    ignore_eos: bool = False
    min_tokens: int = 0  # eos / stop ids are not honoured before this many tokens
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token's logprob plus top-k


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclasses.dataclass(frozen=True)
class DegeneracyVerdict:
    degenerate: bool
    reason: str | None = None  # e.g. "token loop: period 1 repeated 24 times in the tail"


@dataclasses.dataclass(frozen=True)
class RequestTimings:
    """Server-side timings of one request, seconds at full precision."""

    queue_seconds: float
    prefill_seconds: float
    time_to_first_token_seconds: float  # submit -> first token available
    decode_seconds: float  # first token -> last token
    decode_tokens_per_second: float  # (completion_tokens - 1) / decode_seconds; 0 with < 2 tokens
    prefill_bucket: int  # padded prefill length actually compiled (sum over chunks)
    pad_tokens: int
    uncompiled_shape: bool  # True if this request triggered a compilation


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    timings: RequestTimings
    degeneracy: DegeneracyVerdict
    stop_token_id: int | None = None  # the eos / stop id that ended it (not part of token_ids)
    error: str | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    slots_in_use: int
    slots_total: int


_END = object()


class RequestHandle:
    """Token stream of one request. The engine thread `put`s events; consumers iterate.

    Created inside a running asyncio loop it delivers through that loop (`async for`); otherwise
    through a thread-safe queue (plain `for`). Either way it yields TokenEvents, and `result` holds the
    GenerationResult once iteration ends.
    """

    def __init__(self, request_id: str, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self.request = request
        self.result: GenerationResult | None = None
        self._loop = loop
        self._async_queue: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._sync_queue: queue.Queue | None = None if loop is not None else queue.Queue()
        self._cancelled = threading.Event()

    # engine side -----------------------------------------------------------------------------
    def put(self, event: TokenEvent) -> None:
        self._deliver(event)

    def finish(self, result: GenerationResult) -> None:
        self.result = result
        self._deliver(_END)

    def _deliver(self, item: Any) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, item)
            except RuntimeError:  # loop closed: the consumer is gone
                self._cancelled.set()
        else:
            self._sync_queue.put(item)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    # consumer side ---------------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the engine to stop this request and free its slot (idempotent, thread-safe)."""
        self._cancelled.set()

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._sync_queue is None:
            raise TypeError("handle was created in an event loop: use `async for`")
        while (item := self._sync_queue.get()) is not _END:
            yield item

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        if self._async_queue is None:
            raise TypeError("handle was created outside an event loop: use `for`")
        while (item := await self._async_queue.get()) is not _END:
            yield item

    def wait(self) -> GenerationResult:
        """Drain the stream (sync) and return the final result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result


class Engine(Protocol):
    """What the server needs. `info` is static JSON-able data (model, policy, precision, limits)."""

    @property
    def info(self) -> dict[str, Any]: ...

    @property
    def ready(self) -> bool:
        """True once warm-up has finished, until shutdown begins; False forever after a failed start."""
        ...

    @property
    def error(self) -> BaseException | None:
        """Why the engine failed to start (warm-up raised), else None."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queue a request (thread-safe). Raises PromptTooLong or EngineNotReady."""
        ...

    def stats(self) -> EngineStats: ...

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish (bounded), stop the loop."""
        ...
