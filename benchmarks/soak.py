"""Soak: N streaming clients for T seconds against a gemmax server, every answer checked.

Greedy prompts (temperature 0) have one right answer: it is taken first from a sequential run (one
request at a time), then N clients stream the same prompts in a loop for T seconds and every stream
is judged. One right answer needs a batch-invariant server: batched decode sums in another order than
a single stream, so without `--batch-invariant` a greedy text may flip at a near-tie (docs/server.md);
the server this script starts runs with it (`--no-batch-invariant` to soak the default mode), and the
summary says which mode the server was in (from /health).

    completed     HTTP 200, text equal to the sequential run's, ended by `data: [DONE]`
    corrupted     ended by [DONE] but the text differs (a batching, cache or streaming bug)
    unterminated  the stream ended without [DONE]
    failed        a non-200 answer, an error event, or a transport error
    lost          sent but none of the above (a request that never came back by the end)

The server's resident memory (with its children) is sampled every second; the growth is measured
from the end of the first tenth of the run (the allocators have settled by then) to the end.

    python benchmarks/soak.py --clients 64 --seconds 300            # starts `gemmax serve` (built-in model)
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid PID  # an already running server

Prints a table and, last, one JSON line. Exit status 1 when anything was lost, corrupted,
unterminated or failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from gemmax.rigs.registry import free_port, wait_healthy

PROMPTS = [
    "The capital of France is", "Write one sentence about the sea.", "List three colours:",
    "Once upon a time", "The quick brown fox", "def fibonacci(n):", "Water boils at",
    "The three laws of motion are", "A haiku about autumn:", "Translate 'good morning' to Spanish:",
    "The largest planet in the solar system is", "My favourite book is",
]


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    corrupted: int = 0
    unterminated: int = 0
    failed: int = 0
    ttft: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, what: str) -> None:
        self.failed += 1
        self.errors[what] = self.errors.get(what, 0) + 1


async def stream_once(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, bool, float | None]:
    """(text, saw [DONE], seconds to the first text) of one streaming greedy completion; raises on
    a non-200 answer or an error event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    text, done = [], False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error'].get('code')}")
            piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if piece and first is None:
                first = time.perf_counter() - start
            text.append(piece)
    return "".join(text), done, first


async def expected_texts(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        out = []
        for prompt in prompts:
            text, done, _ = await stream_once(client, prompt, max_tokens)
            if not done:
                raise RuntimeError("the sequential reference run did not finish a stream")
            out.append(text)
        return out


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
    except psutil.Error:
        return None


async def soak(url: str, clients: int, seconds: float, max_tokens: int = 32, prompts: list[str] | None = None,
               pid: int | None = None, log=print) -> dict:
    """Run the soak; returns the summary (the JSON line's content)."""
    prompts = prompts or PROMPTS
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        batch_invariant = (await client.get("/health")).json().get("batch_invariant")
    expected = await expected_texts(url, prompts, max_tokens)
    tally = Tally()
    rss: list[tuple[float, int]] = []
    start = time.perf_counter()
    deadline = start + seconds

    async def client_loop(index: int) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=10), limits=limits) as client:
            k = index
            while time.perf_counter() < deadline:
                i = k % len(prompts)
                k += 1
                tally.sent += 1
                try:
                    text, done, first = await stream_once(client, prompts[i], max_tokens)
                except Exception as exc:  # a failure is counted, never raised: the soak goes on
                    tally.error(str(exc) if str(exc).startswith(("HTTP", "error event")) else type(exc).__name__)
                    continue
                if not done:
                    tally.unterminated += 1
                elif text != expected[i]:
                    tally.corrupted += 1
                else:
                    tally.completed += 1
                    if first is not None:
                        tally.ttft.append(first)

    async def sample_rss() -> None:
        while time.perf_counter() < deadline:
            value = rss_bytes(pid)
            if value is not None:
                rss.append((time.perf_counter() - start, value))
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample_rss())
    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    elapsed = time.perf_counter() - start
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler
    final = rss_bytes(pid)
    if final is not None:
        rss.append((elapsed, final))
    settled = next((v for t, v in rss if t >= seconds / 10), rss[0][1] if rss else None)
    lost = tally.sent - tally.completed - tally.corrupted - tally.unterminated - tally.failed
    ttft = sorted(tally.ttft)
    summary = {
        "clients": clients, "seconds": round(elapsed, 1), "max_tokens": max_tokens, "prompts": len(prompts),
        "batch_invariant": batch_invariant,
        **{k: v for k, v in asdict(tally).items() if k not in ("ttft", "errors")}, "lost": lost,
        "errors": tally.errors, "requests_per_s": round(tally.completed / elapsed, 2),
        "ttft_p50_s": round(ttft[len(ttft) // 2], 3) if ttft else None,
        "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))], 3) if ttft else None,
        "rss_start_mb": round(rss[0][1] / 2**20, 1) if rss else None,
        "rss_settled_mb": round(settled / 2**20, 1) if settled else None,
        "rss_end_mb": round(rss[-1][1] / 2**20, 1) if rss else None,
        "rss_peak_mb": round(max(v for _, v in rss) / 2**20, 1) if rss else None,
        "rss_growth_pct": round(100 * (rss[-1][1] - settled) / settled, 2) if rss and settled else None,
        "rss_samples_mb": [round(v / 2**20, 1) for _, v in rss[:: max(len(rss) // 20, 1)]],
    }
    return summary


def table(summary: dict) -> str:
    rows = [("clients", summary["clients"]), ("seconds", summary["seconds"]),
            ("server batch-invariant", summary["batch_invariant"]), ("sent", summary["sent"]),
            ("completed", summary["completed"]), ("failed", summary["failed"]), ("corrupted", summary["corrupted"]),
            ("unterminated", summary["unterminated"]), ("lost", summary["lost"]),
            ("completed / s", summary["requests_per_s"]), ("TTFT p50 / p99 s", f"{summary['ttft_p50_s']} / {summary['ttft_p99_s']}"),
            ("RSS start / settled / end / peak MB", f"{summary['rss_start_mb']} / {summary['rss_settled_mb']} / "
             f"{summary['rss_end_mb']} / {summary['rss_peak_mb']}"),
            ("RSS growth (settled -> end)", f"{summary['rss_growth_pct']} %")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def healthy(summary: dict) -> bool:
    return not (summary["lost"] or summary["corrupted"] or summary["unterminated"] or summary["failed"])


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gemmax.cli", "serve", "--port", str(port), "--max-model-len",
           str(args.max_model_len), "--max-batch", str(args.max_batch), "--log-level", "warning",
           "--batch-invariant" if args.batch_invariant else "--no-batch-invariant", *args.serve_args]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, args.ready_timeout, proc)
    except (RuntimeError, TimeoutError) as exc:
        proc.kill()
        raise SystemExit(f"gemmax serve did not become ready: {exc}") from None
    return proc, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start `gemmax serve` on the built-in model)")
    parser.add_argument("--pid", type=int, help="the running server's pid, for RSS")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--server-log", help="file for the started server's output")
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                        help="start the server with --batch-invariant (default), so every greedy text has one right answer")
    parser.add_argument("serve_args", nargs="*", help="more `gemmax serve` options (after --)")
    args = parser.parse_args()
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        proc, url = start_server(args)
        pid = proc.pid
    try:
        summary = asyncio.run(soak(url, args.clients, args.seconds, args.max_tokens, pid=pid))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    summary["cpu_count"] = os.cpu_count()
    print(table(summary))
    print(json.dumps(summary))
    return 0 if healthy(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
