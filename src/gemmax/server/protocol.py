"""Request and response shapes of the OpenAI-compatible API, as vLLM serves them.

Requests are pydantic models with `extra="allow"`: vLLM tolerates fields it does not know, and so do
we (clients send `user`, `metadata`, ... freely). Types are strict (`"stream": "yes"` is a 400, not
true; `"top_k": 1.5` is a 400, not 1). These models check the API's shapes only: the bounds of every
value the engine receives are checked by the engine (`gemmax.engine.api.validate_request`), once. Fields that would change the output but are not
implemented here (`logit_bias`, `suffix`) are refused with a 400 rather than silently ignored.
Structured output comes with vLLM's names: `response_format` (`json_object`, `json_schema`) and the
`structured_outputs` extra (`json`, `regex`, `choice`, `grammar`), turned into one constraint
(`SamplingFields.constraint`: the fields of an engine `Constraint`, as a dict: clients such as the
rigs import this module and never the engine); the engine's validator refuses what llguidance rejects. Union-typed fields are checked by validators that
raise one plain message, so a validation error never reaches the client as a list of pydantic
union branches. `validation_message` turns a `ValidationError` into the one-line message of a 400.

Responses are plain dicts built in `gemmax.server.generation`: their shape is documented in
docs/server.md and checked by the official `openai` client in the tests.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

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
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM extra: exactly one of json, regex, choice, grammar
    cache_salt: str | None = None  # vLLM extra: only requests with the same salt share cached prompt KV
    speculative: dict[str, Any] | None = None  # gemmax extra: {"method": "ngram" | "draft" | "mtp" | "off", "k": 2 | 4 | 8}
    _constraint: dict[str, str] | None = PrivateAttr(default=None)

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

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, value: Any) -> dict[str, Any] | None:
        """The shape only; the engine checks the values against what it compiled (400 with the numbers)."""
        if value is None:
            return None
        unknown = set(value) - {"method", "k"}
        if unknown:
            raise ValueError(f"speculative takes `method` and `k`, not {', '.join(sorted(unknown))}")
        if not isinstance(value.get("method", ""), str):
            raise ValueError("speculative.method must be a string")
        if isinstance(value.get("k"), bool) or not isinstance(value.get("k", 0), int):
            raise ValueError("speculative.k must be an integer")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given when stream is true")
        self._constraint = _constraint(self.response_format, self.structured_outputs)
        return self

    @property
    def constraint(self) -> dict[str, str] | None:
        """The engine constraint asked for by response_format or structured_outputs (None: free)."""
        return self._constraint

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _spec(kind: str, spec: str, param: str) -> dict[str, str]:
    return {"kind": kind, "spec": spec, "param": param}


def _constraint(response_format: dict[str, Any] | None, structured: dict[str, Any] | None) -> dict[str, str] | None:
    """One Constraint from the two ways of asking (both at once is refused)."""
    found = None
    if response_format is not None:
        kind = response_format.get("type", "text")
        if kind == "json_object":
            found = _spec("json_object", "", "response_format")
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("response_format.json_schema must be an object with a `schema` object")
            if "strict" in spec and not isinstance(spec["strict"], bool | None):
                raise ValueError("response_format.json_schema.strict must be a boolean")
            # strict or not, the schema is enforced: a grammar cannot follow a schema loosely
            found = _spec("json_schema", json.dumps(spec.get("schema", {})), "response_format")
        elif kind != "text":
            raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
    if structured:
        given = {k: v for k, v in structured.items() if k in _STRUCTURED_KINDS and v is not None}
        unknown = sorted(set(structured) - set(_STRUCTURED_KINDS))
        if unknown:
            raise ValueError(f"structured_outputs: unsupported key(s) {unknown}; use one of json, regex, choice, grammar")
        if len(given) != 1:
            raise ValueError("structured_outputs must give exactly one of json, regex, choice, grammar")
        if found is not None:
            raise ValueError("give either response_format or structured_outputs, not both")
        key, value = next(iter(given.items()))
        param = f"structured_outputs.{key}"
        if key == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object")
            found = _spec("json_schema", json.dumps(value), param)
        elif key == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            found = _spec("choice", json.dumps(value), param)
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{param} must be a non-empty string")
            found = _spec(_STRUCTURED_KINDS[key], value, param)
    return found


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: Any = None  # str | list[ContentPart] | None; checked below
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (arguments as JSON text)
    tool_call_id: str | None = None  # a `role: tool` message's answer to a call

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

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        names = [t.get("function", {}).get("name") for t in self.tools or ()]
        if self.tools is not None and not all(isinstance(t, dict) and t.get("type", "function") == "function"
                                              and isinstance(t.get("function"), dict) and isinstance(n, str)
                                              for t, n in zip(self.tools, names, strict=True)):
            raise ValueError("tools must be a list of {type: function, function: {name, parameters}} objects")
        choice = self.tool_choice
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not isinstance(name, str):
                raise ValueError("tool_choice must be none, auto, required or {type: function, function: {name}}")
            if name not in names:
                raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        elif choice not in (None, "none", "auto", "required"):
            raise ValueError("tool_choice must be none, auto, required or {type: function, function: {name}}")
        if choice == "required" or isinstance(choice, dict):
            if not self.tools:
                raise ValueError("tool_choice required or a named function needs tools")
            if self.constraint is not None:
                raise ValueError("a forced tool call cannot be combined with response_format or structured_outputs")
        return self

    @property
    def tools_active(self) -> bool:
        """Tool calls are parsed from the answer (tools given and tool_choice is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

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
