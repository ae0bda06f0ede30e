"""Wire timing of one streamed request, measured on the client with `perf_counter`.

The definitions follow `vllm bench serve` so figures line up with what people already quote:

- TTFT: send -> arrival of the first SSE event that carries a token. A chunk carries a token when
  its choice has non-empty `text` (completions), non-empty `delta.content` / `delta.reasoning_content`
  (chat), or non-empty `token_ids` (vLLM's `return_token_ids`, and servers without a tokenizer). A
  role header or an empty keep-alive chunk is not a token, so it never shortens TTFT.
- ITL: every gap between consecutive token-carrying events.
- latency (vLLM's "e2el"): send -> the last token-carrying event. `stream_time` (send -> end of the
  stream, usage chunk and `[DONE]` included) is kept beside it.
- TPOT = (latency - ttft) / (output_tokens - 1), with `output_tokens` taken from the server's usage
  when it reports one, else counted from the stream.

A request succeeds only when it got at least one token, the stream ended cleanly and a
`finish_reason` arrived; anything else keeps its partial timings and the error text. Failed requests
are returned like the others, never dropped.
"""

from __future__ import annotations

import dataclasses
import json
from time import perf_counter
from typing import Any

import httpx


@dataclasses.dataclass
class RequestRecord:
    """One request: what was asked, and what the wire showed (seconds, perf_counter clock)."""

    input_len: int  # prompt tokens we built
    max_tokens: int
    start_time: float = 0.0  # perf_counter() just before the request was sent
    success: bool = False
    error: str = ""
    http_status: int | None = None
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float | None = None  # to the last token-carrying event
    stream_time: float | None = None  # to the end of the stream
    token_times: list[float] = dataclasses.field(default_factory=list)  # arrival offsets of token events
    counted_tokens: int = 0  # tokens seen on the wire (token_ids lengths, else one per token event)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    generated_text: str = ""

    @property
    def output_tokens(self) -> int:
        """The server's `usage.completion_tokens` when reported, else the count seen on the wire."""
        if self.usage is not None and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return self.counted_tokens

    @property
    def prompt_tokens(self) -> int | None:
        value = (self.usage or {}).get("prompt_tokens")
        return value if isinstance(value, int) else None

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1 or self.latency is None or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def decode_tok_s(self) -> float | None:
        """Wire decode rate of this request: 1 / TPOT."""
        tpot = self.tpot
        return 1.0 / tpot if tpot else None

    @property
    def gauge(self) -> float | None:
        """The server's own decode rate (`usage.decode_tokens_per_second`) as sent (an int stays an
        int, so its resolution can be read back), when it reports one."""
        value = (self.usage or {}).get("decode_tokens_per_second")
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    def to_json(self) -> dict[str, Any]:
        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else seconds * 1000.0

        gauge, tpot = self.gauge, self.tpot
        return {
            "success": self.success, "error": self.error, "http_status": self.http_status,
            "input_len": self.input_len, "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens,
            "output_tokens": self.output_tokens, "counted_tokens": self.counted_tokens,
            "finish_reason": self.finish_reason,
            "ttft_ms": ms(self.ttft), "tpot_ms": ms(tpot), "latency_ms": ms(self.latency),
            "stream_ms": ms(self.stream_time), "itl_ms": [x * 1000.0 for x in self.itl],
            "decode_tok_s": self.decode_tok_s, "gauge": gauge,
            "ratio": gauge / self.decode_tok_s if gauge is not None and self.decode_tok_s else None,
            "usage": self.usage,
        }


def _token_payload(choice: dict[str, Any]) -> tuple[str, int]:
    """(text, token count) carried by one streamed choice."""
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        text = delta.get("content") or delta.get("reasoning_content") or ""
    if not isinstance(text, str):  # a malformed chunk carries no text
        text = ""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids:
        return text, len(ids)
    return text, 1 if text else 0


def _error_text(data: dict[str, Any]) -> str:
    err = data.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


async def _read_events(response: httpx.Response, record: RequestRecord, start: float) -> bool:
    """Time the SSE events of a 200 response into `record`; True when `[DONE]` arrived. The stream is
    read to its end so the keep-alive connection goes back to the pool."""
    done = False
    data_lines: list[str] = []
    async for line in response.aiter_lines():
        now = perf_counter()
        if line.startswith("data:"):
            data_lines.append(line[5:].removeprefix(" "))
            continue
        if line or not data_lines:  # comments (": ping"), other SSE fields, stray blank lines
            continue
        event, data_lines = "\n".join(data_lines), []
        if event.strip() == "[DONE]":
            done = True
            continue
        data = json.loads(event)
        choices = (data.get("choices") or []) if isinstance(data, dict) else None
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            record.error = f"malformed event (not an object with a list of choice objects): {event[:200]}"
            return False
        if "error" in data:
            record.error = f"error event: {_error_text(data)}"
            return False
        if isinstance(data.get("usage"), dict):
            record.usage = data["usage"]
        for choice in choices:
            text, n = _token_payload(choice)
            if n:
                offset = now - start
                if record.ttft is None:
                    record.ttft = offset
                else:
                    record.itl.append(offset - record.token_times[-1])
                record.token_times.append(offset)
                record.latency = offset
                record.counted_tokens += n
                record.generated_text += text
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
    return done


async def stream_request(client: httpx.AsyncClient, path: str, payload: dict[str, Any],
                         record: RequestRecord) -> RequestRecord:
    """POST `payload` (which must ask for `stream: true`) and time its SSE events into `record`."""
    done = False
    record.start_time = start = perf_counter()
    try:
        async with client.stream("POST", path, json=payload) as response:
            record.http_status = response.status_code
            if response.status_code == 200:
                done = await _read_events(response, record, start)
            else:
                body = (await response.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status_code}: {body[:1000]}"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.stream_time = perf_counter() - start
    if not record.error:
        if record.ttft is None:
            record.error = "no token-carrying chunk arrived"
        elif record.finish_reason is None:
            record.error = "stream ended without a finish_reason" + ("" if done else " or [DONE]")
    record.success = not record.error
    return record
