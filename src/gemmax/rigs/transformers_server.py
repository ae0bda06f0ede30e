"""The Hugging Face transformers reference rig: an OpenAI-compatible server over a PyTorch model, with
real token streaming, so `gemmax bench` can time gemmax and transformers on the same weights.

Generation is a plain loop: one prefill forward over the prompt, then one forward per token with
`past_key_values`, greedy (temperature 0) or sampled (temperature, top_p, seed). Each token is sent
the moment it is sampled. Requests run one at a time on a single worker thread (transformers has no
continuous batching); a queued request's wait counts in its TTFT, as it would for a user.

Checkpoints without a tokenizer (the tiny random test models) take token-id prompts (`prompt` as a
list of ints, as OpenAI allows); their chunks carry `token_ids` and empty text. Every chunk carries
`token_ids` (vLLM's `return_token_ids` shape). Usage adds the server-side figures
`decode_tokens_per_second` ((n - 1) / (t_last - t_first) over sampled tokens),
`time_to_first_token_seconds`, `prefill_seconds` and `queue_seconds`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from gemmax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorType,
    SamplingFields,
    TokenizeRequest,
    error_body,
)

DTYPES = ("auto", "bfloat16", "float32", "float16")  # auto: `auto_dtype`


@dataclasses.dataclass(frozen=True)
class SamplingArgs:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclasses.dataclass
class TokenEvent:
    token_id: int
    finish_reason: str | None  # "stop" (eos) or "length" on the last token, else None
    t_start: float  # perf_counter when the worker picked the request up
    t_token: float  # perf_counter when this token was sampled


def auto_dtype(model_dir: str | Path) -> str:
    """`--dtype auto`: the checkpoint's dtype when it is stored in 16 bits, else bfloat16, the weight
    dtype of gemmax's CPU policy (this rig computes on the CPU), which is also what vLLM's auto computes
    a float32 checkpoint in on this CPU (the built-in model's directory is float32): each rig at its
    default precision, not the reference in float32 beside two 16-bit runtimes."""
    from transformers import AutoConfig

    stored = str(getattr(AutoConfig.from_pretrained(model_dir), "dtype", None) or "").removeprefix("torch.")
    return stored if stored in ("bfloat16", "float16") else "bfloat16"


class HFGenerator:
    """A transformers causal LM plus its tokenizer (if any), generating on one worker thread."""

    def __init__(self, model_dir: str | Path, dtype: str = "bfloat16", max_model_len: int | None = None,
                 threads: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.model_dir = Path(model_dir)
        if dtype == "auto":
            dtype = auto_dtype(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype)).eval()
        self.dtype = dtype
        self.tokenizer = self._load_tokenizer()
        text_config = self.model.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        self.max_model_len = int(max_model_len or getattr(text_config, "max_position_embeddings", 8192))
        eos = (self.model.generation_config.eos_token_id, text_config.eos_token_id)  # each an id or a list
        self.eos_ids = sorted({i for e in eos if e is not None for i in (e if isinstance(e, list) else [e])})
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-rig")

    def _load_tokenizer(self):
        if not any((self.model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    def precision(self) -> dict[str, str]:
        """dtypes actually in use: read from the loaded weights, not from the flag."""
        weights = sorted({str(p.dtype).removeprefix("torch.") for p in self.model.parameters()})
        return {"weights": ",".join(weights), "activations": self.dtype, "kv_cache": self.dtype}

    def generate(self, ids: list[int], args: SamplingArgs, cancel: threading.Event) -> Iterator[TokenEvent]:
        torch = self.torch
        t_start = time.perf_counter()
        generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            for step in range(args.max_tokens):
                logits = out.logits[0, -1].float()
                if step < args.min_tokens and self.eos_ids:
                    logits[self.eos_ids] = -float("inf")
                token = self._sample(logits, args, generator)
                t_token = time.perf_counter()
                finish = None
                if token in self.eos_ids and not args.ignore_eos:
                    finish = "stop"
                elif step + 1 == args.max_tokens:
                    finish = "length"
                yield TokenEvent(token, finish, t_start, t_token)
                if finish or cancel.is_set():
                    return
                out = self.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                cache = out.past_key_values

    def _sample(self, logits, args: SamplingArgs, generator) -> int:
        torch = self.torch
        if args.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / args.temperature, dim=-1)
        if args.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < args.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=generator))

    async def stream(self, ids: list[int], args: SamplingArgs) -> AsyncIterator[TokenEvent]:
        """Tokens as the worker thread samples them; closing the iterator stops the worker."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def emit(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (server shutting down)
                cancel.set()

        def work() -> None:
            try:
                if not cancel.is_set():
                    for event in self.generate(ids, args, cancel):
                        emit(event)
            except BaseException as exc:  # reported to the request, not lost in the thread
                emit(exc)
            finally:
                emit(None)

        self.executor.submit(work)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()

    def decode_delta(self, ids: list[int], emitted: str, final: bool = False) -> str:
        """New text after `emitted` for generated `ids` (held back while a UTF-8 sequence is partial,
        unless `final`: the answer's last token releases whatever is held, as the whole answer shows it)."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        return text[len(emitted):]


# The request shapes and the error body are the gemmax server's own (gemmax.server.protocol), so both
# servers accept and refuse the same requests; this rig honours temperature, top_p, seed, ignore_eos and
# min_tokens, and refuses what it cannot do (n > 1, several prompts, other sampling controls).
UNSUPPORTED = {"top_k": (None, 0, -1), "min_p": (None, 0.0), "presence_penalty": (None, 0.0),
               "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0), "stop": (None, []),
               "stop_token_ids": (None, []), "logit_bias": (None, {}),
               # constrained output and forced tool calls (the gemmax server's grammars)
               "response_format": (None, {"type": "text"}), "structured_outputs": (None, {}),
               "tool_choice": (None, "none", "auto"),
               # token log-probabilities and the prompt echoed back
               "top_logprobs": (None, 0), "echo": (None, False)}


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _error_body(message: str, param: str | None = None, kind: ErrorType = "invalid_request_error") -> dict:
    return error_body(message, kind, "server_error" if kind == "server_error" else "invalid_request", param)


def create_app(gen: HFGenerator, served_name: str) -> FastAPI:
    import torch
    import transformers

    app = FastAPI(title="gemmax transformers rig")
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status == 404:  # the gemmax server's answer to a model it does not serve
            return JSONResponse(error_body(exc.message, "not_found_error", "model_not_found", exc.param), status_code=404)
        return JSONResponse(_error_body(exc.message, exc.param), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            return JSONResponse(_error_body("the request body is not valid JSON"), status_code=400)
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return JSONResponse(_error_body(f"{param}: {first.get('msg', 'invalid request')}", param), status_code=400)

    def check_model(model: str | None) -> None:
        if model and model != served_name:
            raise APIError(f"the model `{model}` does not exist: this server serves `{served_name}`", "model", 404)

    def check_ids(ids: list[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < gen.vocab_size]
        if bad:
            raise APIError(f"token ids {bad[:5]} are outside the vocabulary [0, {gen.vocab_size})", param)

    def prompt_ids(prompts: list[str | list[int]]) -> list[int]:
        if len(prompts) != 1:
            raise APIError("this server takes one prompt per request", "prompt")
        prompt = prompts[0]
        if isinstance(prompt, str):
            if gen.tokenizer is None:
                raise APIError("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
            return gen.tokenizer(prompt).input_ids
        if not prompt:
            raise APIError("the prompt is empty", "prompt")
        check_ids(prompt, "prompt")
        return list(prompt)

    def sampling(req: SamplingFields, max_tokens: int | None, n_prompt: int) -> SamplingArgs:
        if req.n != 1:
            raise APIError("this server generates one choice per request (n = 1)", "n")
        for name, defaults in UNSUPPORTED.items():
            if getattr(req, name, None) not in defaults:
                raise APIError(f"{name} is not supported by the transformers rig", name)
        logprobs = getattr(req, "logprobs", None)  # completions: an int (0 asks for the chosen token's); chat: a bool
        if logprobs is not None and logprobs is not False:
            raise APIError("logprobs is not supported by the transformers rig", "logprobs")
        if req.temperature is not None and req.temperature < 0:
            raise APIError(f"temperature must be at least 0, got {req.temperature}", "temperature")
        if req.top_p is not None and not 0 < req.top_p <= 1:
            raise APIError(f"top_p must lie in (0, 1], got {req.top_p}", "top_p")
        room = gen.max_model_len - n_prompt
        max_tokens = max_tokens if max_tokens is not None else room
        if max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens > room or room < 1:
            raise APIError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                           f"({gen.max_model_len})", "max_tokens")
        if req.min_tokens > max_tokens:
            raise APIError(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
        return SamplingArgs(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
                            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens)

    def usage(n_prompt: int, events: list[TokenEvent], t_arrival: float) -> dict[str, Any]:
        first, last = events[0], events[-1]
        n = len(events)
        return {
            "prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n,
            "decode_tokens_per_second": (n - 1) / (last.t_token - first.t_token) if n > 1 else None,
            "time_to_first_token_seconds": first.t_token - t_arrival,
            "prefill_seconds": first.t_token - first.t_start,
            "queue_seconds": first.t_start - t_arrival,
        }

    async def respond(ids: list[int], args: SamplingArgs, stream: bool, include_usage: bool,
                      chunk: Callable[[str, list[int], str | None], dict], whole: Callable[[str, str], dict],
                      header: dict | None, return_token_ids: bool):
        """The answer, streamed (every chunk carries its `token_ids`) or whole (with `token_ids` when
        asked, as vLLM's `return_token_ids`)."""
        t_arrival = time.perf_counter()
        if not stream:
            events = [e async for e in gen.stream(ids, args)]
            out = [e.token_id for e in events]
            body = whole(gen.decode_delta(out, ""), events[-1].finish_reason)
            if return_token_ids:
                body["choices"][0]["token_ids"] = out
            body["usage"] = usage(len(ids), events, t_arrival)
            return JSONResponse(body)

        async def sse() -> AsyncIterator[str]:
            events: list[TokenEvent] = []
            emitted = ""
            if header is not None:
                yield f"data: {json.dumps(header)}\n\n"
            try:
                async for event in gen.stream(ids, args):
                    events.append(event)
                    delta = gen.decode_delta([e.token_id for e in events], emitted, final=event.finish_reason is not None)
                    emitted += delta
                    yield f"data: {json.dumps(chunk(delta, [event.token_id], event.finish_reason))}\n\n"
            except Exception as exc:  # mid-stream failure: tell the client in-band
                yield f"data: {json.dumps(_error_body(f'generation failed: {exc}', kind='server_error'))}\n\n"
                return
            if include_usage:
                final = chunk("", [], None)
                final["choices"] = []
                final["usage"] = usage(len(ids), events, t_arrival)
                yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        ids = prompt_ids(req.prompt)
        args = sampling(req, req.max_tokens if req.max_tokens is not None else 16, len(ids))
        rid = f"cmpl-{uuid.uuid4().hex}"

        def chunk(text: str, token_ids: list[int], finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": served_name,
                    "choices": [{"index": 0, "text": text, "token_ids": token_ids, "logprobs": None,
                                 "finish_reason": finish}]}

        def whole(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": served_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await respond(ids, args, req.stream, include, chunk, whole, None, req.return_token_ids)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        check_model(req.model)
        if gen.tokenizer is None or not getattr(gen.tokenizer, "chat_template", None):
            raise APIError("this model has no chat template: use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.content or ""} for m in req.messages]
        ids = gen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
        args = sampling(req, req.max_completion_tokens or req.max_tokens, len(ids))
        rid = f"chatcmpl-{uuid.uuid4().hex}"

        def chunk(text: str, token_ids: list[int], finish: str | None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": served_name, "choices": [{"index": 0, "delta": {"content": text},
                                                       "token_ids": token_ids, "finish_reason": finish}]}

        def whole(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": served_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish}]}

        header = chunk("", [], None)
        header["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        include = bool(req.stream_options and req.stream_options.include_usage)
        return await respond(ids, args, req.stream, include, chunk, whole, header, req.return_token_ids)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if gen.tokenizer is None:
            raise APIError("this model has no tokenizer", "prompt")
        if req.prompt is None:
            raise APIError("the transformers rig tokenizes a prompt, not messages", "messages")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        tokens = gen.tokenizer(req.prompt, add_special_tokens=special).input_ids
        return {"tokens": tokens, "count": len(tokens), "max_model_len": gen.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_ids(req.tokens, "tokens")
        if gen.tokenizer is None:
            raise APIError("this model has no tokenizer", "tokens")
        return {"prompt": gen.tokenizer.decode(req.tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_name, "object": "model", "created": created, "owned_by": "transformers",
            "root": str(gen.model_dir), "max_model_len": gen.max_model_len, "vocab_size": gen.vocab_size}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "rig": "transformers", "model": served_name, "device": "cpu",
                "precision": gen.precision(), "threads": torch.get_num_threads(),
                "torch": torch.__version__, "transformers": transformers.__version__}

    @app.get("/version")
    async def version():
        return {"version": transformers.__version__, "rig": "transformers"}

    return app


def serve(model: str, host: str, port: int, dtype: str, max_model_len: int | None, threads: int | None,
          served_name: str | None) -> None:
    import uvicorn

    gen = HFGenerator(model, dtype=dtype, max_model_len=max_model_len, threads=threads)
    uvicorn.run(create_app(gen, served_name or model), host=host, port=port, log_level="warning")
