"""Wire timing against a scripted server on loopback: the harness must recover TTFT, ITL, TPOT and
latency to within 2 ms of the instants the server sent each chunk (same process, same clock). The
systematic errors this catches (an empty chunk taken for a token, timestamps taken after the stream,
a wrong TPOT divisor) are 10 ms and more; 2 ms leaves room for a test worker sharing the 2 cores."""

from __future__ import annotations

import httpx
import pytest

from bench_fake_server import FakeServer, Script
from gemmax.bench.sweep import Sweep, SweepConfig
from gemmax.bench.timing import RequestRecord, stream_request

TOL = 2e-3  # seconds

# Timed to the millisecond against scripted delays: `make test` runs this module alone, not beside a
# worker that compiles on both cores (pyproject.toml's markers).
pytestmark = pytest.mark.wire_timing


def payload(max_tokens: int) -> dict:
    return {"model": "fake-model", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}


def expected(record: RequestRecord, served) -> dict[str, float]:
    """Timings implied by the server's send instants, on the harness's clock origin."""
    sends = [t - record.start_time for t in served.send_times]
    return {"ttft": sends[0], "latency": sends[-1], "itl": [b - a for a, b in zip(sends, sends[1:], strict=False)]}


def deviation(record: RequestRecord, served) -> float:
    """Worst |harness - server| over TTFT, latency, every ITL and TPOT, in seconds."""
    exp = expected(record, served)
    errors = [abs(record.ttft - exp["ttft"]), abs(record.latency - exp["latency"])]
    errors += [abs(got - want) for got, want in zip(record.itl, exp["itl"], strict=True)]
    if record.tpot is not None:
        errors.append(abs(record.tpot - (exp["latency"] - exp["ttft"]) / (record.output_tokens - 1)))
    return max(errors)


async def timed(script: Script, max_tokens: int, attempts: int = 8) -> tuple[RequestRecord, object, float]:
    """(record, what the server sent, worst deviation) of the best of `attempts` identical requests.

    The machine is a shared 2-core box: the OS can preempt this process between the server's write
    and the client's read, which no client can see. A systematic error (an empty chunk taken for a
    token, timestamps taken after the stream, a wrong TPOT divisor) fails every attempt."""
    server = await FakeServer(script).start()
    best = None
    try:
        async with httpx.AsyncClient(base_url=server.base_url) as client:
            # one request to open the keep-alive connection, so connect time is not in the figures
            await stream_request(client, "/v1/completions", payload(2), RequestRecord(4, 2))
            for _ in range(attempts):
                record = await stream_request(client, "/v1/completions", payload(max_tokens),
                                              RequestRecord(4, max_tokens))
                served = server.served[-1]
                worst = deviation(record, served) if record.ttft is not None else float("inf")
                if best is None or worst < best[2]:
                    best = (record, served, worst)
                if worst < TOL / 2:
                    break
    finally:
        await server.stop()
    return best


async def test_recovers_ttft_itl_tpot_latency_within_1ms():
    gaps = (0.020, 0.035, 0.015, 0.040, 0.025, 0.030)
    record, served, worst = await timed(Script(ttft=0.080, gaps=gaps), max_tokens=len(gaps) + 1)
    exp = expected(record, served)
    assert record.success, record.error
    assert record.output_tokens == len(gaps) + 1 == record.counted_tokens
    assert record.ttft >= 0.080  # the scripted delay is a floor: nothing can arrive before it is sent
    assert len(record.itl) == len(gaps)
    assert worst < TOL
    assert abs(record.tpot - (exp["latency"] - exp["ttft"]) / len(gaps)) < TOL
    # The server kept its script (loosely: a loaded machine may wake it late, never early), so the
    # chunks really were spread out and the 2 ms checks are not trivially met.
    assert min(exp["itl"]) > 0.005
    assert abs(exp["latency"] - exp["ttft"] - sum(gaps)) < 0.03
    assert record.stream_time >= record.latency  # the usage chunk and [DONE] come after the last token


async def test_empty_first_chunk_does_not_count_as_first_token():
    record, served, worst = await timed(Script(ttft=0.120, itl=0.02, empty_first_chunk=0.010), max_tokens=5)
    exp = expected(record, served)
    assert record.success, record.error
    assert served.empty_time - record.start_time < 0.05  # the empty chunk really came early
    assert record.ttft >= 0.120 and worst < TOL
    assert len(record.itl) == 4
    assert abs(record.tpot - (exp["latency"] - exp["ttft"]) / 4) < TOL


async def test_usage_count_beats_chunk_count_for_tpot():
    # Two tokens per chunk: 4 chunks carry 8 tokens; TPOT divides by the server's 8 - 1, as vLLM does.
    record, served, worst = await timed(Script(ttft=0.030, itl=0.030, tokens_per_chunk=2), max_tokens=8)
    exp = expected(record, served)
    assert record.success, record.error
    assert record.output_tokens == 8 and len(record.itl) == 3
    assert worst < TOL and abs(record.tpot - (exp["latency"] - exp["ttft"]) / 7) < TOL


async def test_without_usage_the_wire_count_is_used():
    record, served, worst = await timed(Script(ttft=0.030, itl=0.015, report_usage=False), max_tokens=6)
    exp = expected(record, served)
    assert record.success and record.usage is None
    assert record.output_tokens == record.counted_tokens == 6
    assert worst < TOL and abs(record.tpot - (exp["latency"] - exp["ttft"]) / 5) < TOL


async def test_failure_mid_stream_is_recorded_with_partial_timings():
    record, served, worst = await timed(Script(ttft=0.030, itl=0.015, fail_after=3), max_tokens=10)
    assert not record.success
    assert record.error  # the transport error text, not an empty string
    assert record.counted_tokens == 3 and len(served.send_times) == 3
    assert worst < TOL  # the partial TTFT and ITLs are still right
    assert record.tpot is None  # a failed request gives no TPOT


async def test_in_band_error_event_and_http_error_are_failures():
    record, _, _ = await timed(Script(ttft=0.010, itl=0.010, error_event_after=2), max_tokens=6, attempts=1)
    assert not record.success and "scripted engine error" in record.error
    record, _, _ = await timed(Script(status=500), max_tokens=6, attempts=1)
    assert not record.success and record.http_status == 500 and "scripted failure" in record.error


@pytest.mark.parametrize("concurrency", [2])
async def test_failed_requests_stay_in_the_cell(concurrency):
    # Every other measured request breaks mid-stream: the cell counts and lists them, never drops them.
    def script(served, n):
        return Script(ttft=0.01, itl=0.005, fail_after=2 if served.body["max_tokens"] == 6 and n % 2 == 0 else None)

    server = await FakeServer(script).start()
    try:
        config = SweepConfig(base_url=server.base_url, input_lens=(12,), output_len=6, repeats=2,
                             concurrency=(concurrency,), decode_source="stream")
        result = await Sweep(config).run()
    finally:
        await server.stop()
    (cell,) = result["cells"]
    total = len(cell["requests"])
    failed = [r for r in cell["requests"] if not r["success"]]
    assert total == 2 * concurrency
    assert cell["failed"] == len(failed) > 0 and cell["completed"] == total - len(failed)
    assert sum(1 for e in cell["errors"] if e) == len(failed)
    assert any("failed" in flag for flag in cell["flags"])


@pytest.mark.parametrize("raw", ["null", "[1, 2]", "42", '{"choices": "x"}', '{"choices": [7]}'])
async def test_an_event_that_is_not_a_chunk_object_fails_only_its_request(raw):
    """A stream event whose JSON is not an object with a list of choice objects is that request's
    failure (recorded with its partial timings), not an exception that ends the sweep."""
    record, _, _ = await timed(Script(ttft=0.010, itl=0.010, raw_event=raw, raw_event_after=2), max_tokens=6,
                               attempts=1)
    assert not record.success and record.error.startswith("malformed event") and raw in record.error
    assert record.counted_tokens == 2
