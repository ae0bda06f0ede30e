"""The sweep: every (input length x load level) cell of one OpenAI-compatible endpoint, measured the
same way whatever runtime answers.

Per cell: build all prompts first (exact token counts, unique nonces; no tokenize call runs while
requests are timed), run one warm-up round at the exact measured shape (same input length, output
length and load level; recorded under `warmup`, never averaged in), then `repeats` measured rounds.
A round is `concurrency` requests sent together, or in request-rate mode `num_prompts` requests with
seeded Poisson arrivals at `request_rate` req/s. Requests go to `/v1/completions`, greedy (temperature
0) unless `sampling` sets temperature / top_p / top_k / min_p (`parse_sampling`): the sampled
decode rate is a claim apart from the greedy one, since a runtime can sample far slower than argmax.
Output length is forced with `ignore_eos` and `min_tokens` (vLLM extensions, sent with
`return_token_ids`) where the server accepts them, and checked against returned usage.

Decode sources: `stream` (wire 1/TPOT), `gauge` (the server's `usage.decode_tokens_per_second`),
`both` (both from the same streamed request, with gauge/stream ratio), `auto` (a probe request
decides: `both` when the server reports a gauge, else `stream`). Every request streams, so the wire
figure exists for every source.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gemmax.bench.metrics import gauge_resolution, spread_stats, vllm_metrics
from gemmax.bench.prompts import IdPrompts, TextPrompts, resolve_prompts
from gemmax.bench.timing import RequestRecord, stream_request

SCHEMA = "gemmax-bench/1"
DEGENERATE_COUNTER = "gemmax:degenerate_responses_total"
DECODE_SOURCES = ("auto", "stream", "gauge", "both")
PROBE_OUTPUT = 8
SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float}


def parse_sampling(text: str) -> tuple[tuple[str, float | int], ...]:
    """"temperature=0.7,top_p=0.9" -> (("temperature", 0.7), ("top_p", 0.9)); "" or "greedy" -> ()."""
    if text.strip() in ("", "greedy"):
        return ()
    fields = []
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in SAMPLING_FIELDS:
            raise ValueError(f"sampling is name=value pairs of {', '.join(SAMPLING_FIELDS)}, got {item!r}")
        try:
            fields.append((name, SAMPLING_FIELDS[name](value)))
        except ValueError as exc:
            raise ValueError(f"sampling {name} must be a {SAMPLING_FIELDS[name].__name__}, got {value!r}") from exc
    return tuple(fields)


def sampling_name(sampling: tuple[tuple[str, float | int], ...]) -> str:
    return ",".join(f"{name}={value}" for name, value in sampling) or "greedy"


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    base_url: str
    uds: Path | None = None  # connect through this Unix socket (base_url then only names the Host sent)
    model: str | None = None  # default: the first entry of /v1/models
    input_lens: tuple[int, ...] = (41, 521, 2057, 3593)
    output_len: int = 64
    repeats: int = 3
    concurrency: tuple[int, ...] = (1,)
    request_rates: tuple[float, ...] = ()  # non-empty: request-rate mode instead of concurrency levels
    num_prompts: int = 8  # requests per round in request-rate mode
    decode_source: str = "auto"
    prompt_mode: str = "auto"  # auto | server | local | ids (see gemmax.bench.prompts)
    tokenizer: Path | None = None
    vocab_size: int | None = None
    label: str | None = None
    api_key: str | None = None
    price_per_hour: float | None = None
    seed: int = 0
    timeout_s: float = 1800.0
    sampling: tuple[tuple[str, float | int], ...] = ()  # `parse_sampling`; () = greedy

    def __post_init__(self):
        if self.decode_source not in DECODE_SOURCES:
            raise ValueError(f"decode source must be one of {DECODE_SOURCES}, got {self.decode_source!r}")
        if not self.input_lens or min(self.input_lens) < 1:
            raise ValueError(f"input lengths must be >= 1, got {self.input_lens}")
        unknown = [name for name, _ in self.sampling if name not in SAMPLING_FIELDS]
        if unknown:
            raise ValueError(f"unknown sampling fields {unknown}; known: {', '.join(SAMPLING_FIELDS)}")
        if self.output_len < 1 or self.repeats < 1:
            raise ValueError("output length and repeats must be >= 1")
        if self.request_rates:
            if min(self.request_rates) <= 0 or self.num_prompts < 1:
                raise ValueError("request rates must be > 0 and num_prompts >= 1")
        elif not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")

    def load_levels(self) -> list[tuple[int | None, float | None]]:
        """(concurrency, request_rate) per cell column."""
        if self.request_rates:
            return [(None, r) for r in self.request_rates]
        return [(c, None) for c in self.concurrency]

    def round_size(self, concurrency: int | None) -> int:
        return concurrency if concurrency is not None else self.num_prompts

    def planned_requests(self) -> int:
        """Requests the sweep will send: the probe, then warm-up + repeats rounds per cell."""
        per_input = sum(self.round_size(c) * (1 + self.repeats) for c, _ in self.load_levels())
        return 1 + per_input * len(self.input_lens)


async def _get_json(client: httpx.AsyncClient, path: str) -> dict[str, Any] | None:
    """A JSON object from GET `path`; {"status_code": N} on an HTTP error status; None when unreachable
    or not JSON."""
    try:
        response = await client.get(path)
        if response.status_code != 200:
            return {"status_code": response.status_code}
        data = response.json()
        return data if isinstance(data, dict) else {"value": data}
    except (httpx.HTTPError, ValueError):
        return None


async def degenerate_count(client: httpx.AsyncClient) -> float | None:
    """`gemmax:degenerate_responses_total` from /metrics (summed over labels); None when absent."""
    try:
        response = await client.get("/metrics")
        if response.status_code != 200:
            return None
        total = None
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.name == DEGENERATE_COUNTER:
                    total = (total or 0.0) + sample.value
        return total
    except (httpx.HTTPError, ValueError):
        return None


class Sweep:
    def __init__(self, config: SweepConfig, on_request: Callable[[RequestRecord], None] | None = None):
        self.config = config
        self.on_request = on_request or (lambda record: None)
        self.forced = True
        self.model = config.model
        self.prompts: TextPrompts | IdPrompts | None = None
        self._next_index = 0

    def _payload(self, prompt: str | list[int], output_len: int) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **dict(self.config.sampling),
        }
        if self.forced:  # vLLM extensions: a fixed output length, and token ids in every chunk so a
            # chunk whose text is held back (partial UTF-8, no tokenizer) still counts as a token
            payload.update(ignore_eos=True, min_tokens=output_len, return_token_ids=True)
        return payload

    async def _one(self, client: httpx.AsyncClient, prompt: str | list[int], input_len: int,
                   output_len: int) -> RequestRecord:
        record = RequestRecord(input_len=input_len, max_tokens=output_len)
        await stream_request(client, "/v1/completions", self._payload(prompt, output_len), record)
        self.on_request(record)
        return record

    async def _prompts(self, n: int, count: int) -> list[str | list[int]]:
        assert self.prompts is not None
        out = []
        for _ in range(count):
            out.append(await self.prompts.build(n, self._next_index))
            self._next_index += 1
        return out

    async def _round(self, client: httpx.AsyncClient, prompts: list[str | list[int]], input_len: int,
                     rate: float | None, seed: int) -> tuple[list[RequestRecord], float]:
        """Send one round; (records in send order, wall seconds from first send to last end)."""
        output_len = self.config.output_len
        start = perf_counter()
        if rate is None:
            records = await asyncio.gather(*(self._one(client, p, input_len, output_len) for p in prompts))
        else:
            rng = random.Random(seed)
            tasks, arrival = [], 0.0
            for p in prompts:
                await asyncio.sleep(max(0.0, start + arrival - perf_counter()))
                tasks.append(asyncio.create_task(self._one(client, p, input_len, output_len)))
                arrival += rng.expovariate(rate)
            records = await asyncio.gather(*tasks)
        return list(records), perf_counter() - start

    async def _probe(self, client: httpx.AsyncClient) -> RequestRecord:
        """One small request (the shortest input, at most PROBE_OUTPUT tokens out): are the vLLM
        extensions accepted (else retried without them; a refusal of both fails the sweep with the
        server's answer), and does the server report a gauge?"""
        n = min(self.config.input_lens)
        output = min(PROBE_OUTPUT, self.config.output_len)  # what fits the sweep's requests fits the probe
        (prompt,) = await self._prompts(n, 1)
        record = await self._one(client, prompt, n, output)
        if not record.success and record.http_status in (400, 422):
            self.forced = False
            record = await self._one(client, prompt, n, output)
        if not record.success:
            raise RuntimeError(f"probe request failed: {record.error}")
        return record

    async def run(self) -> dict[str, Any]:
        cfg = self.config
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        largest_round = max(self.config.round_size(c) for c, _ in cfg.load_levels())
        limits = httpx.Limits(max_connections=largest_round + 4, max_keepalive_connections=largest_round + 4)
        transport = httpx.AsyncHTTPTransport(uds=str(cfg.uds), limits=limits) if cfg.uds is not None else None
        async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits,
                                     transport=transport, timeout=httpx.Timeout(cfg.timeout_s, connect=30.0)) as client:
            models = await _get_json(client, "/v1/models")
            if models is None:
                raise RuntimeError(f"cannot reach {cfg.base_url}/v1/models (no connection, or its answer is not JSON)")
            status = models.get("status_code")
            if status in (401, 403) or (status is not None and cfg.model is None):
                hint = " (check --api-key)" if status in (401, 403) else ": pass --model"
                raise RuntimeError(f"{cfg.base_url}/v1/models answered HTTP {status}{hint}")
            entries = models.get("data") or [{}]
            entry = next((e for e in entries if e.get("id") == cfg.model), entries[0])
            if self.model is None:
                self.model = entry.get("id")
                if self.model is None:
                    raise RuntimeError(f"{cfg.base_url}/v1/models lists no model: pass --model")
            vocab_size = cfg.vocab_size or entry.get("vocab_size")
            self.prompts = await resolve_prompts(client, self.model, cfg.prompt_mode, cfg.tokenizer,
                                                 vocab_size, cfg.seed)
            started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            health_before = await _get_json(client, "/health")
            degenerate_before = await degenerate_count(client)
            probe = await self._probe(client)
            source = cfg.decode_source
            if source == "auto":
                source = "both" if probe.gauge is not None else "stream"
            elif source in ("gauge", "both") and probe.gauge is None:
                raise RuntimeError(f"decode source {source!r}: the server reports no "
                                   "usage.decode_tokens_per_second (use --decode-source stream)")
            cells, aborted = [], None
            try:
                for input_len in cfg.input_lens:
                    for concurrency, rate in cfg.load_levels():
                        cells.append(await self._cell(client, input_len, concurrency, rate, source))
            except (httpx.HTTPError, ValueError) as exc:  # a request's own failure is recorded; this is the
                # server gone, or a prompt it cannot count (/tokenize answering something else)
                planned = len(cfg.input_lens) * len(cfg.load_levels())
                aborted = f"the sweep stopped after {len(cells)} of {planned} cells: {type(exc).__name__}: {exc}"
            health_after = await _get_json(client, "/health")
            degenerate_after = await degenerate_count(client)
        return {
            "schema": SCHEMA,
            "label": cfg.label or f"{self.model}@{cfg.uds or httpx.URL(cfg.base_url).netloc.decode()}",
            "base_url": cfg.base_url,
            "model": self.model,
            "started": started,
            "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "config": {k: (str(v) if isinstance(v, Path) else v)
                       for k, v in dataclasses.asdict(cfg).items() if k != "api_key"},
            "decode_source": source,
            "sampling": sampling_name(cfg.sampling),
            "prompt_mode": self.prompts.mode,
            "forced_output": self.forced,
            "server": {
                "model_entry": entry,
                "health_before": health_before,
                "health_after": health_after,
                "precision_before": (health_before or {}).get("precision"),
                "precision_after": (health_after or {}).get("precision"),
                "degenerate_responses_before": degenerate_before,
                "degenerate_responses_after": degenerate_after,
                "degenerate_responses_delta": (None if degenerate_before is None or degenerate_after is None
                                               else degenerate_after - degenerate_before),
            },
            "probe": probe.to_json(),
            "cells": cells,
            "aborted": aborted,  # None, or where the sweep stopped: `cells` holds what it measured before
        }

    async def _cell(self, client: httpx.AsyncClient, input_len: int, concurrency: int | None,
                    rate: float | None, source: str) -> dict[str, Any]:
        cfg = self.config
        size = cfg.round_size(concurrency)
        prompts = await self._prompts(input_len, size * (1 + cfg.repeats))
        seed = cfg.seed * 7919 + input_len
        warmup, _ = await self._round(client, prompts[:size], input_len, rate, seed)
        rounds: list[list[RequestRecord]] = []
        duration = 0.0
        for r in range(cfg.repeats):
            chunk = prompts[size * (r + 1): size * (r + 2)]
            records, wall = await self._round(client, chunk, input_len, rate, seed + r + 1)
            rounds.append(records)
            duration += wall
        return summarize_cell(cfg, input_len, concurrency, rate, source, warmup, rounds, duration)


def _median_of(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize_cell(cfg: SweepConfig, input_len: int, concurrency: int | None, rate: float | None,
                   source: str, warmup: list[RequestRecord], rounds: list[list[RequestRecord]],
                   duration: float) -> dict[str, Any]:
    """One cell's JSON: vLLM's metrics over the measured requests (warm-up excluded), then the decode
    figures, each as its median over every measured request with the lowest and highest round's
    figure beside it (`_over_requests`). The wire rate is 1 / TPOT: 1 / the median TPOT of the cell
    (the table's TPOT column) and of each round, not a median of per-request rates: at c=2 a round's
    median rate is the mean of its two requests' rates, which is not 1 / their median TPOT."""
    measured = [r for rnd in rounds for r in rnd]

    def figures(records: list[RequestRecord]) -> dict[str, float | None]:
        ok = [r for r in records if r.success]
        tpot = _median_of([r.tpot for r in ok if r.tpot is not None])  # as median_tpot_ms counts them
        return {"stream": 1.0 / tpot if tpot else None,
                "gauge": _median_of([r.gauge for r in ok if r.gauge is not None]),
                "ratio": _median_of([r.gauge / r.decode_tok_s for r in ok if r.gauge is not None and r.decode_tok_s]),
                "ttft_ms": _median_of([r.ttft * 1000.0 for r in ok])}

    per_round = [figures(rnd) for rnd in rounds]
    overall = figures(measured)

    def _over_requests(key: str) -> dict[str, Any] | None:
        """spread_stats of the rounds' figures, its median the figure over every measured request (the
        round median is kept as `round_median`); the spread is the rounds' range over that figure."""
        stats = spread_stats([f[key] for f in per_round if f[key] is not None])
        if stats is None or overall[key] is None:
            return stats
        median = overall[key]
        return {**stats, "round_median": stats["median"], "median": median,
                "spread": (stats["max"] - stats["min"]) / median if median else None}

    stream_stats = _over_requests("stream")
    all_gauges = [r.gauge for r in measured if r.success and r.gauge is not None]
    gauge_stats = _over_requests("gauge") if source in ("gauge", "both") else None
    ratio_stats = _over_requests("ratio") if source == "both" else None
    resolution = None
    if gauge_stats is not None and all_gauges:
        # one repeat has no run-to-run spread (its 0 would flag any gauge, however fine)
        spread = stream_stats["spread"] if stream_stats and stream_stats["n"] >= 2 else None
        resolution = gauge_resolution(all_gauges, spread)
    headline = gauge_stats if source == "gauge" else stream_stats

    flags = []
    successful = [r for r in [*warmup, *measured] if r.success]
    output_ok = all(r.output_tokens == cfg.output_len for r in successful) if successful else None
    if output_ok is False:
        got = sorted({r.output_tokens for r in successful})
        flags.append(f"output length not held: asked {cfg.output_len}, got {got}")
    reported = [r.prompt_tokens for r in successful if r.prompt_tokens is not None]
    input_ok = all(n == input_len for n in reported) if reported else None
    if input_ok is False:
        flags.append(f"input length off: built {input_len}, server counted {sorted(set(reported))}")
    if resolution is not None and resolution["flagged"]:
        flags.append(f"gauge tick {resolution['tick']:g} is {resolution['resolution']:.2%} of its value, "
                     f"coarser than the run-to-run spread {resolution['spread']:.2%}")
    buffered = [r for r in measured if r.success and r.output_tokens > 1 and len(r.token_times) == 1]
    if buffered:  # TPOT is 0 for them: the wire shows no decode rate
        flags.append(f"{len(buffered)} of {len(measured)} requests delivered all their tokens in one event (a "
                     "buffering server or proxy): the wire gives them no decode rate")
    failed = [r for r in measured if not r.success]
    if failed:
        flags.append(f"{len(failed)} of {len(measured)} requests failed: {failed[0].error[:200]}")

    metrics = vllm_metrics(measured, duration)
    cost = None
    if cfg.price_per_hour is not None and metrics["output_throughput"]:
        cost = cfg.price_per_hour / 3600.0 / metrics["output_throughput"] * 1e6
    return {
        "input_len": input_len,
        "output_len": cfg.output_len,
        "concurrency": concurrency,
        "request_rate": rate,
        "decode_source": source,
        **metrics,
        "decode_tok_s": headline["median"] if headline else None,
        "stream": stream_stats,
        "gauge": gauge_stats,
        "ratio": ratio_stats,
        "gauge_resolution": resolution,
        "ttft": spread_stats([f["ttft_ms"] for f in per_round if f["ttft_ms"] is not None]),
        "output_len_verified": output_ok,
        "input_len_verified": input_ok,
        "flags": flags,
        "cost_per_million_output_tokens": cost,
        "warmup": [r.to_json() for r in warmup],
        "requests": [r.to_json() for r in measured],
    }


def run_sweep(config: SweepConfig, on_request: Callable[[RequestRecord], None] | None = None) -> dict[str, Any]:
    return asyncio.run(Sweep(config, on_request).run())
