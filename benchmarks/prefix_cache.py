"""Prefix caching from the wire, against `gemmax serve` (the built-in model unless --url is given).

1. Multi-turn chat: turn 1 sends a ~1,500-token message; turn 2 resends it with the reply and a short
   question, so its first ~1,500 tokens are cached. Time to first token (streamed, first content
   chunk) of turn 2 against turn 1; the issue's target is at most 25%.
2. Shared system prompt: 20 requests (all at once) with one ~1,000-token system prompt and distinct
   short questions; throughput with the cache against without it. "Without" is the same server with a
   fresh `cache_salt` per request, so nothing is shared and every request prefills its whole prompt
   (same engine, same chunking; `--prefix-cache-bytes 0` would also drop the block stores).

Each measurement uses texts no earlier request sent (turn 1 is a miss), after a warm-up that compiles
the copy shapes. Prints a table and one JSON line.

    python benchmarks/prefix_cache.py --quick        # 2 chats, one round of the 20-request workload
    python benchmarks/prefix_cache.py                # 5 chats, 3 rounds
    python benchmarks/prefix_cache.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
import uuid

import httpx

from gemmax.rigs.registry import free_port, wait_healthy

WORDS = ["river", "mountain", "signal", "copper", "lantern", "orbit", "quiet", "harvest", "marble", "window", "thunder", "pepper", "garden", "engine", "violet", "compass", "shadow", "ladder", "ember", "frost", "meadow", "canyon", "silver", "rocket", "anchor", "puzzle"]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gemmax.cli", "serve", "--port", str(port), "--max-model-len",
           str(args.max_model_len), "--max-batch", str(args.max_batch), "--log-level", "warning", *args.serve_args]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, args.ready_timeout, proc)
    except (RuntimeError, TimeoutError) as exc:
        proc.kill()
        raise SystemExit(f"gemmax serve did not become ready: {exc}") from None
    return proc, url


def text_of(client: httpx.Client, tokens: int, rng: random.Random) -> str:
    """Random words making about `tokens` tokens (measured with /tokenize, then trimmed)."""
    words = [rng.choice(WORDS) for _ in range(tokens)]
    count = client.post("/tokenize", json={"prompt": " ".join(words)}).json()["count"]
    return " ".join(words[: max(1, int(len(words) * tokens / count))])


async def chat(client: httpx.AsyncClient, messages: list[dict], max_tokens: int, salt: str | None = None) -> dict:
    """One streamed greedy chat request: {ttft, seconds, text, usage}."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"cache_salt": salt} if salt else {})}
    start = time.perf_counter()
    ttft, text, usage = None, [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(content)
    return {"ttft": ttft, "seconds": time.perf_counter() - start, "text": "".join(text), "usage": usage}


async def multi_turn(client: httpx.AsyncClient, first_text: str, max_tokens: int) -> dict:
    turn1 = [{"role": "user", "content": f"{first_text}\n\nWhich word comes up most often above?"}]
    first = await chat(client, turn1, max_tokens)
    turn2 = turn1 + [{"role": "assistant", "content": first["text"]},
                     {"role": "user", "content": "And which word comes up least often?"}]
    second = await chat(client, turn2, max_tokens)
    return {"turn1_ttft": first["ttft"], "turn2_ttft": second["ttft"], "ratio": second["ttft"] / first["ttft"],
            "turn1_prompt": first["usage"]["prompt_tokens"], "turn2_prompt": second["usage"]["prompt_tokens"],
            "turn2_cached": second["usage"]["prompt_tokens_details"]["cached_tokens"]}


async def shared_system(client: httpx.AsyncClient, system: str, requests: int, max_tokens: int, cached: bool) -> dict:
    """`requests` chats at once under one system prompt; salts make each unique when not `cached`."""
    round_id = uuid.uuid4().hex
    jobs = [chat(client, [{"role": "system", "content": system},
                          {"role": "user", "content": f"Question {i}: name a word from the list that starts with "
                                                      f"the letter {'abcdefghijklmnopqrst'[i % 20]}."}],
                 max_tokens, salt=None if cached else f"{round_id}-{i}")
            for i in range(requests)]
    start = time.perf_counter()
    results = await asyncio.gather(*jobs)
    wall = time.perf_counter() - start
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    return {"wall_seconds": wall, "requests_per_second": requests / wall, "output_tokens_per_second": tokens / wall,
            "median_ttft": statistics.median(r["ttft"] for r in results),
            "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in results),
            "cached_tokens": sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)}


async def run(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    with httpx.Client(base_url=url, timeout=600) as sync:
        chat_texts = [text_of(sync, args.turn_tokens, rng) for _ in range(args.chats + 1)]
        systems = [f"You answer questions about this list of words. {text_of(sync, args.system_tokens, rng)}"
                   for _ in range(2 * args.rounds + 1)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await multi_turn(client, chat_texts[0], args.max_tokens)  # warm-up: compiles the copy shapes
        await shared_system(client, systems[0], 4, args.max_tokens, cached=True)
        chats = [await multi_turn(client, text, args.max_tokens) for text in chat_texts[1:]]
        rounds = []
        for r in range(args.rounds):  # alternate, each with a system prompt no request has sent yet
            without = await shared_system(client, systems[1 + 2 * r], args.requests, args.max_tokens, cached=False)
            with_cache = await shared_system(client, systems[2 + 2 * r], args.requests, args.max_tokens, cached=True)
            rounds.append((without, with_cache))
        health = (await client.get("/health")).json()
    return {"chats": chats, "rounds": rounds, "prefix_cache": health.get("prefix_cache"),
            "model": health.get("model"), "platform": health.get("policy", {}).get("platform")}


def report(result: dict) -> dict:
    chats, rounds = result["chats"], result["rounds"]
    print(f"model {result['model']} on {result['platform']}; prefix cache {result['prefix_cache']}")
    print("\nmulti-turn chat (TTFT, streamed)")
    print(f"{'chat':>4} {'turn1 prompt':>12} {'turn1 TTFT s':>12} {'turn2 prompt':>12} {'cached':>7} {'turn2 TTFT s':>12} {'ratio':>6}")
    for i, c in enumerate(chats):
        print(f"{i:>4} {c['turn1_prompt']:>12} {c['turn1_ttft']:>12.3f} {c['turn2_prompt']:>12} {c['turn2_cached']:>7} "
              f"{c['turn2_ttft']:>12.3f} {c['ratio']:>6.2f}")
    ratio = statistics.median(c["ratio"] for c in chats)
    print(f"median turn2 / turn1 TTFT: {ratio:.2f} (target <= 0.25)")
    print("\nshared system prompt, requests sent at once")
    print(f"{'round':>5} {'cache':>6} {'wall s':>7} {'req/s':>6} {'out tok/s':>9} {'median TTFT s':>13} {'cached/prompt tok':>18}")
    for r, pair in enumerate(rounds):
        for name, m in zip(("off", "on"), pair, strict=True):
            print(f"{r:>5} {name:>6} {m['wall_seconds']:>7.2f} {m['requests_per_second']:>6.2f} "
                  f"{m['output_tokens_per_second']:>9.1f} {m['median_ttft']:>13.3f} {m['cached_tokens']:>8}/{m['prompt_tokens']}")
    speedup = statistics.median(on["requests_per_second"] / off["requests_per_second"] for off, on in rounds)
    print(f"median throughput with / without the cache: {speedup:.2f}x")
    return {"turn2_over_turn1_ttft": ratio, "throughput_ratio": speedup, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start `gemmax serve` on the built-in model)")
    parser.add_argument("--quick", action="store_true", help="2 chats and one round of the 20-request workload")
    parser.add_argument("--chats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=1500)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("serve_args", nargs="*", help="more `gemmax serve` options (after --)")
    args = parser.parse_args()
    if args.quick:
        args.chats, args.rounds = 2, 1
    proc, url = (None, args.url) if args.url else start_server(args)
    try:
        result = report(asyncio.run(run(url, args)))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
