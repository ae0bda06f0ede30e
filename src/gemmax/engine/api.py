"""The engine's small interface: what the server (or a fake engine in tests) relies on.

The engine knows nothing about HTTP or text: requests are token ids in, token ids out. A request is
submitted, its tokens are streamed through a `RequestHandle` (sync iteration or `async for`), it can
be cancelled at any time (its slot is freed at once), and it ends with one `GenerationResult` that
carries the server-side timings and the degeneracy verdict.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import queue
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "cancelled", "error"]
MAX_LOGPROBS = 20  # top logprobs per token at most (OpenAI's and vLLM's default bound)


# ------------------------------------------------------------------------------------------ validation
# Every bound below comes from what the engine can represent: token ids and counters are int32 on
# the device, the sampling parameters are float32 rows, ids index a vocabulary of `vocab_size`.
INT32_MAX = 2**31 - 1
INT64 = 2**63
MAX_TEMPERATURE = 100.0  # logits / 100 is already flat to within float32 noise for any real model
MAX_PENALTY = 2.0  # presence / frequency (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0
MAX_STOP_TOKEN_IDS = 1024


class InvalidRequest(ValueError):
    """A request the engine refuses: `param` names the offending field, `code` is the API error code.
    The server maps it to a 400 in the OpenAI shape, nothing more."""

    status = 400

    def __init__(self, param: str | None, message: str, code: str = "invalid_value"):
        self.param, self.message, self.code = param, message, code
        super().__init__(f"{param}: {message}" if param else message)


class PromptTooLong(InvalidRequest):
    """prompt_tokens + 1 > max_model_len: refused at submit time, with both numbers."""

    def __init__(self, prompt_tokens: int, max_model_len: int, param: str = "prompt"):
        self.prompt_tokens, self.max_model_len = prompt_tokens, max_model_len
        super().__init__(None, f"prompt has {prompt_tokens} tokens but max_model_len is {max_model_len}: "
                         f"at most {max_model_len - 1} prompt tokens leave room for one generated token",
                         "context_length_exceeded")
        self.param = param


class QueueFull(RuntimeError):
    """The wait queue is at its bound (`max_queue`): retry after `retry_after` seconds (503)."""

    def __init__(self, waiting: int, max_queue: int, retry_after: int):
        self.waiting, self.max_queue, self.retry_after = waiting, max_queue, retry_after
        super().__init__(f"the server is at capacity: {waiting} requests are waiting (limit {max_queue}); "
                         f"retry after {retry_after} s")


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
class Constraint:
    """What a request's output must match (gemmax.engine.constraints compiles it with llguidance).
    kind: "json_schema" (spec: the schema as JSON text), "json_object" (spec unused), "regex",
    "choice" (spec: a JSON list of strings) or "grammar" (Lark, or GBNF when it has `::=`).
    `param` names the API field it came from, for a 400."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    spec: str = ""
    param: str | None = None


SPECULATIVE_METHODS = ("ngram", "draft", "mtp", "off")  # prompt lookup; a draft model; Gemma 4's MTP assistant; or plain
SPEC_KS = (2, 4, 8)  # proposed tokens per verify step: one compiled verify shape each


@dataclasses.dataclass(frozen=True)
class Speculation:
    """Speculative decoding of one request (gemmax.engine.speculative): `method` "ngram" (prompt
    lookup), "draft" (the server's draft model, gemmax.engine.draft), "mtp" (the server's Gemma 4 MTP
    assistant, gemmax.engine.mtp) or "off", at most `k` proposed
    tokens per verify step."""

    method: str = "ngram"
    k: int = 4


@dataclasses.dataclass(frozen=True)
class SpeculationStats:
    """What speculation did for one request: verify steps, tokens proposed and accepted, and how many
    verify steps accepted 0, 1, 2 ... proposals (`accepted_lengths[n]`)."""

    steps: int
    proposed: int
    accepted: int
    accepted_lengths: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()  # in addition to the checkpoint's eos ids (unless ignore_eos)
    ignore_eos: bool = False
    min_tokens: int = 0  # eos / stop ids are not honoured before this many tokens
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token's logprob plus top-k
    # True: max_tokens is capped by the context left after the prompt. False: a prompt + max_tokens
    # over max_model_len is refused (the OpenAI API's rule for an explicit max_tokens).
    fit_to_context: bool = True
    constraint: Constraint | None = None  # None: free output
    cache_salt: str | None = None  # prefix caching: only requests with the same salt share cached KV
    speculative: Speculation | None = None  # None: the engine's default


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
    uncompiled_shape: bool  # True if a step of it (its prefill, first token, or a decode / verify step of its group) compiled or loaded its program
    prefill_batch: int = 1  # prompts prefilled in one forward with this one's last chunk, itself included


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    timings: RequestTimings
    degeneracy: DegeneracyVerdict
    stop_token_id: int | None = None  # the eos / stop id that ended it (not part of token_ids)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled)
    speculation: SpeculationStats | None = None  # None: decoded plainly throughout

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    slots_in_use: int
    slots_total: int
    # Prefix cache counters and bytes (gemmax.engine.prefix_cache.PrefixCache.stats); None when off.
    prefix_cache: dict[str, int] | None = None


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
        """`submit_all` of one request."""
        ...

    def submit_all(self, requests: Sequence[GenerationRequest],
                   loop: asyncio.AbstractEventLoop | None = None) -> list[RequestHandle]:
        """Validate (`validate_request`) and queue requests together (thread-safe), one handle each in
        order: every one is validated before any is queued, and the queue bound (`Admission`) admits
        or refuses them as one, so one API call's choices (prompts x n) are never refused by their
        own earlier ones and nothing of a refused call is queued. Raises InvalidRequest (PromptTooLong
        among them), QueueFull or EngineNotReady."""
        ...

    def stats(self) -> EngineStats: ...

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until warm-up is done (True) or `timeout` passes (False); raises RuntimeError when
        warm-up failed."""
        ...

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish (bounded), stop the loop."""
        ...


# ------------------------------------------------------------------------------------------ one validator


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(param: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(param, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidRequest(param, f"must be a finite number, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise InvalidRequest(param, f"must lie in {interval}, got {value!r}")


def _integer(param: str, value: Any, low: int, high: int, what: str = "") -> None:
    if not _is_int(value):
        raise InvalidRequest(param, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidRequest(param, f"must lie in [{low}, {high}]{what}, got {value}")


def check_token_ids(param: str, ids: Any, vocab_size: int) -> None:
    """Every id an int in [0, vocab_size): the one range check, run before anything decodes them."""
    for t in ids:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise InvalidRequest(param, f"token id {t!r} is outside the vocabulary (0..{vocab_size - 1})")


def validate_request(request: GenerationRequest, *, max_model_len: int, vocab_size: int,
                     spec_ks: tuple[int, ...] = (), draft: bool = False, mtp: bool = False) -> None:
    """Refuse, with the offending parameter, anything the engine cannot serve exactly as asked. The
    only request validation there is: BatchEngine.submit and the tests' fake engine both call it,
    and the server maps what it raises to HTTP. `spec_ks`: the proposal lengths the engine compiled a
    verify step for (empty: no speculative decoding); `draft`, `mtp`: whether it has a draft model, an
    MTP assistant."""
    prompt = request.prompt_ids
    if not prompt:
        raise InvalidRequest("prompt", "prompt is empty")
    check_token_ids("prompt", prompt, vocab_size)
    n = len(prompt)
    if n + 1 > max_model_len:
        raise PromptTooLong(n, max_model_len)
    room = max_model_len - n
    _integer("max_tokens", request.max_tokens, 1, INT32_MAX)
    if not request.fit_to_context and request.max_tokens > room:
        raise InvalidRequest("max_tokens", f"this model's max_model_len is {max_model_len} tokens, but the request "
                             f"needs {n + request.max_tokens} ({n} in the prompt, {request.max_tokens} in the "
                             "completion): lower max_tokens or shorten the prompt", "context_length_exceeded")
    _integer("min_tokens", request.min_tokens, 0, min(room, request.max_tokens),
             f" (at most max_tokens and the {room} tokens of context left after the prompt)")
    if not isinstance(request.ignore_eos, bool):
        raise InvalidRequest("ignore_eos", f"must be a boolean, got {request.ignore_eos!r}")
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(request.stop_token_ids)}")
    check_token_ids("stop_token_ids", request.stop_token_ids, vocab_size)
    if request.cache_salt is not None and (not isinstance(request.cache_salt, str) or not request.cache_salt):
        raise InvalidRequest("cache_salt", f"must be a non-empty string, got {request.cache_salt!r}")
    if request.logprobs is not None:
        _integer("logprobs", request.logprobs, 0, MAX_LOGPROBS)
    s = request.sampling
    _number("temperature", s.temperature, 0.0, MAX_TEMPERATURE)
    _integer("top_k", s.top_k, -1, vocab_size, " (-1 or 0: off; at most the vocabulary size)")
    _number("top_p", s.top_p, 0.0, 1.0, low_open=True)
    _number("min_p", s.min_p, 0.0, 1.0)
    if s.seed is not None:
        _integer("seed", s.seed, -INT64, INT64 - 1)
    _number("presence_penalty", s.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    _number("frequency_penalty", s.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    _number("repetition_penalty", s.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
    if request.constraint is not None:
        from gemmax.engine.constraints import check

        if request.ignore_eos or request.min_tokens:
            raise InvalidRequest("ignore_eos" if request.ignore_eos else "min_tokens",
                                 "cannot be combined with constrained output: the grammar decides where it ends")
        error = check(request.constraint)
        if error:
            raise InvalidRequest(request.constraint.param, error, "invalid_constraint")
    if request.speculative is not None:
        spec = request.speculative
        if spec.method not in SPECULATIVE_METHODS:
            raise InvalidRequest("speculative.method", f"must be one of {', '.join(SPECULATIVE_METHODS)}, "
                                 f"got {spec.method!r}")
        if spec.method != "off":
            if not spec_ks:
                raise InvalidRequest("speculative", "this server runs without speculative decoding: start it with "
                                     "--speculative ngram (or on-request) to use it")
            if isinstance(spec.k, bool) or not isinstance(spec.k, int) or spec.k not in spec_ks:
                raise InvalidRequest("speculative.k", f"must be one of {', '.join(map(str, spec_ks))} (the "
                                     f"compiled proposal lengths), got {spec.k!r}")
            if spec.method == "draft" and not draft:
                raise InvalidRequest("speculative.method", "this server has no draft model: start it with "
                                     "--draft-model PATH to use method 'draft'")
            if spec.method == "mtp" and not mtp:
                raise InvalidRequest("speculative.method", "this server has no MTP assistant: start it with "
                                     "--speculative mtp --draft-model ASSISTANT to use method 'mtp'")


class Admission:
    """The bounded wait queue's rule, shared by every engine: refuse a call (`submit_all`'s requests,
    as one) once `max_queue` requests wait, with a Retry-After estimated from recent request
    durations. A queued request that a free slot will take does not wait (a burst at an idle engine
    stays queued for its burst window, slots free). An admitted call's requests all enter, so the
    waiting requests can exceed the bound by one call's requests less one (at most
    `--max-choices` - 1)."""

    def __init__(self, max_queue: int | None, slots: int):
        self.max_queue, self.slots = max_queue, max(slots, 1)
        self._recent = 2.0  # seconds a request holds a slot (moving average; a guess until measured)

    def check(self, queued: int, free: int) -> None:
        """Refuse (QueueFull) when the `queued` requests, less what the `free` slots will take, are
        at the bound."""
        waiting = max(queued - max(free, 0), 0)
        if self.max_queue is not None and waiting >= self.max_queue:
            raise QueueFull(waiting, self.max_queue, self.retry_after(waiting))

    def retry_after(self, waiting: int) -> int:
        return int(min(max(math.ceil(self._recent * (waiting + 1) / self.slots), 1), 60))

    def observe(self, seconds: float) -> None:
        self._recent = 0.9 * self._recent + 0.1 * max(seconds, 0.0)
