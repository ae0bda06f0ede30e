"""Request and response shapes of the OpenAI-compatible API, as vLLM serves them.

Requests are pydantic models with `extra="allow"`: vLLM tolerates fields it does not know, and so do
we (clients send `user`, `metadata`, ... freely). Types are strict (`"stream": "yes"` is a 400, not
true; `"top_k": 1.5` is a 400, not 1). These models check the API's shapes only: the bounds of every
value the engine receives are checked by the engine (`gemmax.engine.api.validate_request`), once. Fields that would change the output but are not
implemented here (`logit_bias`, `suffix`, structured `response_format`, forced tool calls) are
refused with a 400 rather than silently ignored. Union-typed fields are checked by validators that
raise one plain message, so a validation error never reaches the client as a list of pydantic
union branches. `validation_message` turns a `ValidationError` into the one-line message of a 400.

Responses are plain dicts built in `gemmax.server.generation`: their shape is documented in
docs/server.md and checked by the official `openai` client in the tests.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_N = 64  # choices per request (each one is an engine request)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(_Lenient):
    """Parameters shared by /v1/completions and /v1/chat/completions (vLLM's sampling extras included)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 and 0 switch it off
    min_p: float | None = None
    seed: int | None = None
    stop: Any = Field(None, validate_default=True)  # str | list[str] -> list[str]; checked below
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM extra: choices[i].token_ids and prompt_token_ids
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings (use stop_token_ids for ids)")
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given when stream is true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: Any = None  # str | list[ContentPart] | None; checked below
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        """Text parts are joined with newlines (vLLM's "string" content format)."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content parts")
        texts = []
        for part in value:
            part = ContentPart.model_validate(part)
            if part.type != "text" or part.text is None:
                raise ValueError(f"content part of type {part.type!r} is not supported: this model reads text only")
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice other than 'none' or 'auto' is not supported by this server")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError("structured response_format is not supported by this server")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]; checked below
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> list[str | list[int]]:
        """Normalised to a list of prompts, each a string or a list of token ids."""
        message = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value:
            raise ValueError(message if not isinstance(value, list) else "prompt must not be empty")
        if all(isinstance(p, str) for p in value):
            return value
        if all(_is_id(t) for t in value):
            return [value]
        if all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in value):
            return value
        raise ValueError(message)

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported by this server")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs (prompt logprobs) is not supported by this server")
        return self

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


ErrorType = Literal[
    "invalid_request_error", "authentication_error", "not_found_error", "request_too_large",
    "degenerate_output", "service_unavailable", "server_error",
]


def error_body(message: str, type_: ErrorType, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_message(exc: ValidationError, prefix_skip: tuple[str, ...] = ("body",)) -> tuple[str, str | None]:
    """(message, param) for the first validation error: field path, pydantic's sentence and the
    offending scalar; never pydantic's URLs, error types or class names."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = [str(p) for p in first["loc"] if p not in prefix_skip]
    param = ".".join(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "json_invalid":
        return f"request body is not valid JSON ({msg})", None
    value = first.get("input")
    shown = f" (got {value!r})" if isinstance(value, int | float | str | bool) and len(repr(value)) <= 60 else ""
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{shown}{more}" if param else f"{msg}{more}"), param
