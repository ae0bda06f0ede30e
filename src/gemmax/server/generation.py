"""One API request as engine requests: submit, follow the token streams, build the responses.

A request with P prompts and `n` choices becomes P * n engine requests (choice index p * n + j; seeds
seed, seed + 1, ..., seed + n - 1 per prompt, as vLLM's parallel sampling does). Their token streams
are merged in arrival order. Each choice owns an incremental detokenizer and a stop-string matcher:
on a stop-string match the server cancels that engine request (its slot is freed) and reports
finish_reason "stop" with the string as `stop_reason`.

Streaming follows vLLM's SSE shapes with two deliberate differences: the first chat chunk (role plus
content) goes out with the first generated token rather than before it, so a client's TTFT is the
real one; and the finish chunk of each choice carries the degeneracy verdict. Usage carries the
engine's server-side timings (see `usage`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from gemmax.engine.api import (
    INT64,
    Constraint,
    EngineNotReady,
    GenerationRequest,
    GenerationResult,
    InvalidRequest,
    QueueFull,
    RequestHandle,
    SamplingParams,
    Speculation,
    SpeculationStats,
    TokenEvent,
    check_token_ids,
)
from gemmax.server.detokenize import IncrementalDetokenizer, StopStringMatcher
from gemmax.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from gemmax.server.tool_calls import (
    OutputParser,
    call_format,
    gemma3_messages,
    has_thought_channel,
    tool_constraint,
)

log = logging.getLogger("gemmax.server")

_END = None  # marks the end of one choice's stream in the merged event stream
STATUS_KEY = "gemmax.status"  # ASGI scope key: a stream's final status (known only at its end), for the counter


class ApiError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code or type_
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def engine_error(exc: Exception, renames: dict[str, str] | None = None) -> ApiError | None:
    """The one mapping of the engine's typed refusals to HTTP (None: not one of them). `renames`
    maps the engine's parameter names to the endpoint's (chat: prompt -> messages, ...)."""
    if isinstance(exc, InvalidRequest):
        param = (renames or {}).get(exc.param, exc.param)
        message = str(exc)
        if param != exc.param and message.startswith(f"{exc.param}: "):
            message = f"{param}: " + message.removeprefix(f"{exc.param}: ")
        return ApiError(exc.status, message, "invalid_request_error", exc.code, param)
    if isinstance(exc, QueueFull):
        return ApiError(503, str(exc), "service_unavailable", "queue_full",
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, EngineNotReady):
        return ApiError(503, f"engine is not accepting requests: {exc}", "service_unavailable", "engine_not_ready")
    return None


@dataclasses.dataclass
class Prompt:
    ids: list[int]
    text: str | None = None  # the prompt as text (for `echo`), when it came as text


def chat_prompt(tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list | None = None,
                template_kwargs: dict[str, Any] | None = None) -> Prompt:
    """Render the checkpoint's chat template (jinja2) and tokenize it (the template emits `<bos>`)."""
    import jinja2

    if tokenizer is None:
        raise bad_request("this model has no tokenizer: use /v1/completions with token ids", "messages")
    plain = [m.model_dump(exclude_none=True) for m in messages]
    if not plain:
        raise bad_request("messages must not be empty", "messages")
    if continue_final_message and plain[-1].get("role") != "assistant":
        raise bad_request("continue_final_message needs a final assistant message", "messages")
    kwargs = dict(template_kwargs or {})
    if call_format(tokenizer) == "gemma3" and (tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in plain)):
        plain = gemma3_messages(plain, tools)  # Gemma 3's template knows no tools: prompt-based calls
    elif tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.render_chat(plain, add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as exc:  # the rendering depends only on the request: a template failure is a 400
        detail = str(exc) if isinstance(exc, ValueError | jinja2.TemplateError) else f"{type(exc).__name__}: {exc}"
        raise bad_request(f"chat template: {detail}", "messages", "invalid_chat") from exc
    if continue_final_message:
        # Cut the rendering right after the final assistant message's content (vLLM's rule).
        last = plain[-1].get("content") or ""
        at = text.rfind(last)
        if at < 0:
            raise bad_request("continue_final_message: the final message's content was not found in the "
                              "rendered chat", "messages")
        text = text[: at + len(last)]
    return Prompt(tokenizer.encode(text, add_bos=False), text)


def completion_prompts(tokenizer, request: CompletionRequest, vocab_size: int | None) -> list[Prompt]:
    prompts = []
    for item in request.prompt:
        if isinstance(item, str):
            if tokenizer is None:
                raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
            prompts.append(Prompt(tokenizer.encode(item, add_bos=request.add_special_tokens), item))
        else:
            if vocab_size is not None:  # the engine's range check, before anything decodes the ids
                check_token_ids("prompt", item, vocab_size)
            text = tokenizer.decode(item, skip_special_tokens=False) if tokenizer is not None else None
            prompts.append(Prompt(list(item), text))
    return prompts


def speculative_usage(stats: list[SpeculationStats]) -> dict[str, Any] | None:
    """The speculation of a request's choices summed (None: none speculated): verify steps, tokens
    proposed and accepted, and `accepted_lengths[n]`, the verify steps that accepted n proposals."""
    if not stats:
        return None
    lengths = [0] * max(len(s.accepted_lengths) for s in stats)
    for s in stats:
        for n, count in enumerate(s.accepted_lengths):
            lengths[n] += count
    return {"steps": sum(s.steps for s in stats), "proposed_tokens": sum(s.proposed for s in stats),
            "accepted_tokens": sum(s.accepted for s in stats), "accepted_lengths": lengths}


def sampling_params(request: SamplingFields, seed: int | None) -> SamplingParams:
    """OpenAI defaults for what the request leaves out: temperature 1, everything else off. Values
    go to the engine as given: it checks their bounds."""
    return SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_k=0 if request.top_k in (None, -1) else request.top_k,  # -1: off, as 0
        top_p=1.0 if request.top_p is None else request.top_p,
        min_p=request.min_p or 0.0,
        seed=seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
    )


class Choice:
    """One engine request's stream, turned into final text deltas, logprobs and a finish reason."""

    def __init__(self, index: int, prompt: Prompt, handle: RequestHandle, detokenizer: IncrementalDetokenizer,
                 stops: StopStringMatcher, min_tokens: int, user_stop_ids: frozenset[int]):
        self.index, self.prompt, self.handle = index, prompt, handle
        self._detok, self._stops, self._min_tokens = detokenizer, stops, min_tokens
        self._user_stop_ids = user_stop_ids
        self.token_ids: list[int] = []  # consumed ids (after a stop-string match, later ids are dropped)
        self.events: list[TokenEvent] = []  # consumed events not yet sent (streaming) / all (non-streaming)
        self.text = ""  # text released so far
        self.token_chars = 0  # characters of the token strings sent so far (completions' text_offset)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.result: GenerationResult | None = None
        self.last_token_at: float | None = None
        self.itl: list[float] = []  # seconds between consecutive tokens, as the server saw them

    @property
    def stopped(self) -> bool:
        return self.finish_reason is not None

    def on_token(self, event: TokenEvent) -> str:
        if self.stopped:
            return ""  # draining after a stop-string match
        now = time.perf_counter()
        if self.last_token_at is not None:
            self.itl.append(now - self.last_token_at)
        self.last_token_at = now
        self.token_ids.append(event.token_id)
        self.events.append(event)
        text = self._detok.push(event.token_id)
        if len(self.token_ids) <= self._min_tokens and not self._stops.held:
            return self._release(text)  # vLLM checks stop strings only after min_tokens
        safe, matched = self._stops.feed(text)
        if matched is not None:
            self.finish_reason, self.stop_reason = "stop", matched
            self.handle.cancel()
        return self._release(safe)

    def on_end(self, result: GenerationResult) -> str:
        """The engine finished this request; returns the last text (held-back text released)."""
        self.result = result
        if self.stopped:
            return ""
        if result.finish_reason == "error":
            raise ApiError(500, f"engine error: {result.error or 'unknown'}", "server_error", "engine_error")
        safe, matched = self._stops.feed(self._detok.flush())
        if matched is not None:
            self.finish_reason, self.stop_reason = "stop", matched
            return self._release(safe)
        self.finish_reason = {"stop": "stop", "length": "length"}.get(result.finish_reason, "abort")
        if result.stop_token_id in self._user_stop_ids:
            self.stop_reason = result.stop_token_id
        return self._release(safe + self._stops.flush())

    def _release(self, text: str) -> str:
        self.text += text
        return text

    def take_events(self) -> list[TokenEvent]:
        events, self.events = self.events, []
        return events


class Job:
    """The engine requests of one API call and their merged token streams."""

    def __init__(self, state, kind: str, request: ChatCompletionRequest | CompletionRequest,
                 prompts: list[Prompt], scope: dict | None = None):
        self.state, self.kind, self.request, self.prompts = state, kind, request, prompts
        self.scope = scope  # the ASGI scope, where a stream leaves its final status
        self.arrival = time.perf_counter()
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices: list[Choice] = []
        self._pumps: list[asyncio.Task] = []
        self.parsers: dict[int, OutputParser] = {}  # per choice index, when tools or a thought channel are read

    @property
    def renames(self) -> dict[str, str]:
        """The engine's parameter names as this endpoint calls them."""
        if self.kind != "chat":
            return {}
        renames = {"prompt": "messages", "logprobs": "top_logprobs"}
        if self.request.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        return renames

    def submit(self, engine, loop: asyncio.AbstractEventLoop, tokenizer, table) -> None:
        """One engine request per prompt and choice, queued together (`Engine.submit_all`: the engine
        validates every one first, and its queue bound admits or refuses them as one); a refusal is
        answered with nothing queued. A choice read by an `OutputParser` (tools, a thought channel)
        releases its text with special tokens kept: the parser reads the markers, and strips them
        from what it returns when the request skips special tokens; its stop strings are matched on
        the text without them then, as the plain path's skipping decode shows it."""
        req = self.request
        wanted = req.requested_max_tokens
        stop_ids = tuple(req.stop_token_ids or ())
        constraint = Constraint(**req.constraint) if req.constraint is not None else None
        tools = self.kind == "chat" and req.tools_active
        if tools and constraint is None:
            constraint = tool_constraint(req.tools, req.tool_choice, call_format(tokenizer), tokenizer)
        reasoning = self.kind == "chat" and has_thought_channel(tokenizer)
        speculative = None if req.speculative is None else Speculation(**req.speculative)
        if req.seed is not None and req.seed + req.n - 1 >= INT64:  # else the engine's error quotes seed + j
            raise bad_request(f"seed: choice j of n samples with seed + j, so seed + n - 1 must be at most {INT64 - 1}; "
                              f"got seed {req.seed} with n {req.n}", "seed")
        requests = [
            (prompt, GenerationRequest(
                prompt_ids=tuple(prompt.ids),
                max_tokens=max(engine.max_model_len - len(prompt.ids), 1) if wanted is None else wanted,
                sampling=sampling_params(req, None if req.seed is None else req.seed + j), stop_token_ids=stop_ids,
                ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=req.engine_logprobs,
                fit_to_context=wanted is None, constraint=constraint, cache_salt=req.cache_salt,
                speculative=speculative))
            for prompt in self.prompts for j in range(req.n)]  # choice index p * n + j
        try:
            handles = engine.submit_all([gen for _, gen in requests], loop)
        except Exception as exc:
            mapped = engine_error(exc, self.renames)
            if mapped is not None:
                raise mapped from exc
            raise
        parsed = tools or reasoning
        skipped = req.skip_special_tokens
        try:
            for index, ((prompt, _), handle) in enumerate(zip(requests, handles, strict=True)):
                self.choices.append(Choice(
                    index, prompt, handle, IncrementalDetokenizer(tokenizer, skipped and not parsed, table),
                    StopStringMatcher(req.stop, req.include_stop_str_in_output,
                                      table.special_pattern if parsed and skipped else None),
                    req.min_tokens, frozenset(stop_ids)))
                if parsed:
                    self.parsers[index] = OutputParser(tokenizer, tools=tools, reasoning=reasoning,
                                                       skipped=table.special_strings if skipped else None)
        except BaseException:
            for handle in handles:  # queued already: their slots must not run for nobody
                handle.cancel()
            raise

    def close(self) -> None:
        """Cancel every engine request that is still running (their slots are freed) and stop
        following them. Idempotent; called whenever a request ends, however it ends."""
        for choice in self.choices:
            choice.handle.cancel()
        for task in self._pumps:
            task.cancel()

    async def events(self) -> AsyncIterator[tuple[Choice, TokenEvent | None]]:
        """(choice, event) in arrival order; (choice, None) once that choice's stream has ended."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for event in choice.handle:
                    queue.put_nowait((choice, event))
            finally:
                queue.put_nowait((choice, _END))

        self._pumps = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            for _ in range(len(self.choices)):
                while (item := await queue.get())[1] is not _END:
                    yield item
                yield item
        finally:
            self.close()

    # response pieces ---------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted once per prompt as prompt_tokens are:
        per prompt, the fewest any of its choices had (each choice is its own engine request)."""
        per_prompt: dict[int, int] = {}
        for c in self.choices:
            cached = c.result.cached_tokens if c.result is not None else 0
            key = id(c.prompt)
            per_prompt[key] = min(per_prompt.get(key, cached), cached)
        return sum(per_prompt.values())

    def usage(self) -> dict[str, Any]:
        """OpenAI usage plus the engine's timings, full precision. One choice: its own figures. Several:
        seconds are the slowest choice's, bucket and pad tokens are summed, decode speed is all
        choices' decode tokens over the longest decode time, uncompiled_shape is any."""
        results = [c.result for c in self.choices if c.result is not None]
        timings = [r.timings for r in results]
        decode_tokens = sum(max(len(c.token_ids) - 1, 0) for c in self.choices)
        decode_seconds = max((t.decode_seconds for t in timings), default=0.0)
        if len(timings) == 1:
            tps = timings[0].decode_tokens_per_second
        else:
            tps = decode_tokens / decode_seconds if decode_seconds > 0 else 0.0
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "decode_tokens_per_second": tps,
            "time_to_first_token_seconds": max((t.time_to_first_token_seconds for t in timings), default=0.0),
            "prefill_seconds": max((t.prefill_seconds for t in timings), default=0.0),
            "queue_seconds": max((t.queue_seconds for t in timings), default=0.0),
            "decode_seconds": decode_seconds,
            "prefill_bucket": sum(t.prefill_bucket for t in timings),
            "pad_tokens": sum(t.pad_tokens for t in timings),
            "prefill_batch": max((t.prefill_batch for t in timings), default=1),
            "uncompiled_shape": any(t.uncompiled_shape for t in timings),
            "degenerate": any(r.degeneracy.degenerate for r in results),
            "speculative": speculative_usage([r.speculation for r in results if r.speculation is not None]),
        }

    def header(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.settings.served_model_name}

    def degeneracy(self, choice: Choice) -> dict[str, Any]:
        verdict = choice.result.degeneracy if choice.result is not None else None
        return {"degenerate": bool(verdict and verdict.degenerate), "reason": verdict.reason if verdict else None}

    def logprobs(self, choice: Choice, events: list[TokenEvent]) -> dict[str, Any] | None:
        """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: vLLM's
        {tokens, token_logprobs, top_logprobs, text_offset}, `events` being the choice's next ones
        (text_offset: the characters of the choice's token strings before each, as vLLM's
        non-streamed response counts them; its streamed chunks restart at the text released so far,
        which lags while text is held back: here the streamed offsets are the non-streamed ones)."""
        k = self.request.engine_logprobs
        if k is None:
            return None
        token = self.state.token_str
        if self.kind == "chat":
            def entry(t: int, lp: float) -> dict[str, Any]:
                s = token(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

            return {"content": [
                {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in (e.top_logprobs or ())[:k]]}
                for e in events
            ]}
        tokens = [token(e.token_id) for e in events]
        offsets = []
        for t in tokens:
            offsets.append(choice.token_chars)
            choice.token_chars += len(t)
        # the chosen token, then the k most likely: up to k + 1 entries (OpenAI's legacy rule, vLLM's)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{t: e.logprob, **{token(i): lp for i, lp in (e.top_logprobs or ())[:k]}}
                             for t, e in zip(tokens, events, strict=True)],
            "text_offset": offsets,
        }


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def degenerate_error(job: Job, choice: Choice) -> ApiError:
    reason = job.degeneracy(choice)["reason"] or "flagged by the degeneracy check"
    return ApiError(422, f"degenerate output in choice {choice.index}: {reason}", "degenerate_output",
                    "degenerate_output")


async def collect(job: Job) -> dict[str, Any]:
    """Run a non-streaming request to the end and build its response body."""
    on_error = job.state.settings.on_degenerate == "error"
    async for choice, event in job.events():
        if event is _END:
            choice.on_end(choice.handle.result)
            if on_error and job.degeneracy(choice)["degenerate"]:
                raise degenerate_error(job, choice)
        else:
            choice.on_token(event)
    chat = job.kind == "chat"
    choices = []
    for c in sorted(job.choices, key=lambda c: c.index):
        body: dict[str, Any] = {"index": c.index}
        parser = job.parsers.get(c.index)
        if chat and parser is not None:
            parser.update(c.text, final=True)
            body["message"] = parser.message()
            if parser.calls_complete and c.finish_reason == "stop":
                c.finish_reason = "tool_calls"
        elif chat:
            body["message"] = {"role": "assistant", "content": c.text}
        else:
            body["text"] = ((c.prompt.text or "") if job.request.echo else "") + c.text
        body.update(logprobs=job.logprobs(c, c.events), finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, degeneracy=job.degeneracy(c))
        if job.request.return_token_ids:
            body["token_ids"] = c.token_ids
            if not chat:
                body["prompt_token_ids"] = c.prompt.ids
        choices.append(body)
    response = {**job.header("chat.completion" if chat else "text_completion"), "choices": choices,
                "usage": job.usage()}
    if chat and job.request.return_token_ids:
        response["prompt_token_ids"] = job.prompts[0].ids
    return response


async def stream(job: Job) -> AsyncIterator[str]:
    """SSE events of a streaming request: per-choice deltas, a finish chunk per choice, the usage
    chunk when asked, then [DONE]. Errors after the headers went out are sent as an `error` event.
    However the stream ends (finished, failed, client gone), the engine requests are cancelled and
    the request is counted once."""
    chat = job.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    req = job.request
    on_error = job.state.settings.on_degenerate == "error"
    started: set[int] = set()

    def chunk(choice: Choice, text: str, finish: bool) -> dict[str, Any] | None:
        """The chunk of what `choice` released (`text`), or None when there is nothing to send: no
        text or parser delta, not its first chunk nor its last, and no token ids asked for (the
        tokens' logprobs then go out with the next chunk, as the plain path sends them)."""
        first = choice.index not in started
        body: dict[str, Any] = {"index": choice.index}
        parser = job.parsers.get(choice.index)
        finish_reason = choice.finish_reason
        if chat and parser is not None:
            delta = parser.update(choice.text, final=finish)
            if finish and parser.calls_complete and finish_reason == "stop":
                finish_reason = "tool_calls"
            body["delta"] = {"role": "assistant", **delta} if first else delta
            news = bool(delta)
        elif chat:
            body["delta"] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            news = bool(text)
        else:
            body["text"] = ((choice.prompt.text or "") if req.echo and first else "") + text
            news = bool(text)
        if not (news or first or finish or req.return_token_ids):
            return None
        started.add(choice.index)
        events = choice.take_events()
        body.update(logprobs=job.logprobs(choice, events), finish_reason=finish_reason if finish else None,
                    stop_reason=choice.stop_reason if finish else None)
        if req.return_token_ids:
            body["token_ids"] = [e.token_id for e in events]
            if first and not chat:
                body["prompt_token_ids"] = choice.prompt.ids
        if finish:
            body["degeneracy"] = job.degeneracy(choice)
        return {**job.header(obj), "choices": [body]}

    status = 200
    try:
        async for choice, event in job.events():
            if event is _END:
                tail = choice.on_end(choice.handle.result)
                if on_error and job.degeneracy(choice)["degenerate"]:
                    raise degenerate_error(job, choice)
                yield sse(chunk(choice, tail, finish=True))
            elif not choice.stopped:  # (a choice that hit a stop string is drained silently)
                # With return_token_ids every token goes out at once (vLLM does the same), even while
                # its text is held back (a partial UTF-8 character or a possible stop string).
                body = chunk(choice, choice.on_token(event), finish=False)
                if body is not None:
                    yield sse(body)
        if req.include_usage:
            yield sse({**job.header(obj), "choices": [], "usage": job.usage()})
    except ApiError as exc:
        status = exc.status
        yield sse({"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}})
    except (asyncio.CancelledError, GeneratorExit):
        status = 499  # the client went away
        raise
    except Exception as exc:  # a real fault: report it on the stream, keep the server up
        status = 500
        log.exception("stream %s failed", job.id)
        yield sse({"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error",
                             "param": None, "code": "internal_error"}})
    finally:
        job.close()
        job.state.finish(job, status)
        if job.scope is not None:
            job.scope[STATUS_KEY] = status
    yield sse("[DONE]")
