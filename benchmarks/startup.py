"""Launch to ready, cold and warm: `gemmax serve` of the built-in model timed from process start to
`/health` 200, and the first requests after it against the ones after them.

For each variant (`--src NAME=PATH`: a gemmax source tree put first on PYTHONPATH, so two versions of
the code run side by side in one run; default: the installed gemmax), four starts on one fresh
compile-cache directory (GEMMAX_COMPILE_CACHE):

1. cold: the directory empty;
2. warm: what start 1 wrote (JAX's persistent cache and gemmax's executable store);
3. warm, JAX's cache only: the executable store removed (what a start after a code change that left
   the programs as they were finds: the store's keys hold a hash of the code, JAX's do not);
4. the start after that: what start 3 left (it stores the programs it read from JAX's cache).

After each start, requests of `--lengths` prompt tokens (16 forced output tokens each, greedy), each
length `--repeats` times in a row: the first request of a length is the first to run its prefill
shapes. The one-time conversion of the built-in model happens before any timing (skipped when the
serve arguments name a `--model`). Prints a table and ends with one JSON line; each start's result is
also printed to stderr as one JSON line as soon as it is measured.

    python benchmarks/startup.py
    python benchmarks/startup.py --src before=/path/to/old/src --src after=src
    python benchmarks/startup.py --uds /tmp/gemmax.sock --pause 5 -- --model /path/to/checkpoint

`--uds PATH`: serve listens on that Unix socket (`gemmax serve --uds`) and the health poll and the
requests go through it, for machines that refuse TCP sockets, loopback included (the TPU machine).
`--pause S`: seconds between one server's exit and the next launch (an accelerator a process has just
released can refuse the next one for a moment); not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gemmax.rigs.registry import free_port

HERE = Path(__file__).parent


def client_for(url: str, uds: str | None, timeout: float) -> httpx.Client:
    """A client of the server at `url`, or over the Unix socket `uds` (then the url's host is only the Host header)."""
    transport = httpx.HTTPTransport(uds=uds) if uds else None
    return httpx.Client(base_url=url, timeout=timeout, transport=transport)


def wait_ready(url: str, process: subprocess.Popen, timeout: float, uds: str | None = None) -> dict:
    deadline = time.monotonic() + timeout
    with client_for(url, uds, 5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"gemmax serve exited with {process.returncode} before it was ready")
            try:
                response = client.get("/health")
                if response.status_code == 200:
                    return response.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"not ready after {timeout} s")


def timed_requests(url: str, lengths: list[int], repeats: int, uds: str | None = None) -> list[dict]:
    """Per length, `repeats` completions in a row of exactly that many prompt ids: (e2e s, server TTFT s)."""
    rows = []
    with client_for(url, uds, 600.0) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for length in lengths:
            times = []
            for n in range(repeats):
                prompt = [2] + [(7 * n + 13 * i) % 20000 + 100 for i in range(length - 1)]  # <bos> + distinct ids
                t0 = time.perf_counter()
                reply = client.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 16, "min_tokens": 16, "ignore_eos": True,
                    "temperature": 0.0}).json()
                usage = reply["usage"]
                times.append({"e2e_s": round(time.perf_counter() - t0, 3),
                              "ttft_s": round(usage.get("time_to_first_token_seconds", float("nan")), 3),
                              "uncompiled": usage.get("uncompiled_shape")})
            rows.append({"prompt_tokens": length, "requests": times})
    return rows


def one_start(name: str, src: str | None, cache: Path, args, label: str) -> dict:
    if args.pause and args.launched:  # after a server's exit, before the next launch
        time.sleep(args.pause)
    args.launched = True
    if args.uds:  # a socket file a server left behind would answer nothing: each start binds afresh
        Path(args.uds).unlink(missing_ok=True)
        listen, url = ["--uds", args.uds], "http://localhost"
    else:
        port = free_port()
        listen, url = ["--port", str(port)], f"http://127.0.0.1:{port}"
    env = {**os.environ, "GEMMAX_COMPILE_CACHE": str(cache)}
    if src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(src).resolve()), os.environ.get("PYTHONPATH")]))
    log = args.out_dir / f"startup-{name}-{label}.log"
    with open(log, "w") as out:
        t0 = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "gemmax.cli", "serve", *listen, *args.serve_args],
                                   env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            health = wait_ready(url, process, args.timeout, args.uds)
            ready = time.perf_counter() - t0
            requests = timed_requests(url, args.lengths, args.repeats, args.uds)
        finally:
            process.terminate()
            process.wait(60)
    warmup = health.get("warmup", {})
    print(f"[{name}/{label}] ready in {ready:.1f} s; warm-up {warmup}", file=sys.stderr)
    result = {"variant": name, "start": label, "ready_s": round(ready, 2), "warmup": warmup, "requests": requests}
    print(json.dumps(result), file=sys.stderr, flush=True)  # what a run stopped later still leaves
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", action="append", default=[], help="NAME=PATH of a gemmax source tree (repeatable)")
    parser.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")], default=[32, 521, 2000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--uds", help="serve on this Unix socket path, and talk to it there (no TCP)")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds after a server exits before the next launch")
    parser.add_argument("serve_args", nargs="*", help="more `gemmax serve` arguments (after --)")
    args = parser.parse_args()
    args.launched = False  # whether a server has run yet (`--pause` comes between launches)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    variants = [tuple(item.split("=", 1)) for item in args.src] or [("installed", None)]

    if not any(a == "--model" or a.startswith("--model=") for a in args.serve_args):
        from gemmax.weights.builtin import default_model_path

        default_model_path()  # the one-time conversion, outside every timing
    results = []
    for name, src in variants:
        cache = Path(tempfile.mkdtemp(prefix=f"gemmax-startup-{name}-"))
        try:
            results.append(one_start(name, src, cache, args, "cold"))
            results.append(one_start(name, src, cache, args, "warm"))
            shutil.rmtree(cache / "xla" / "executables", ignore_errors=True)
            results.append(one_start(name, src, cache, args, "warm, JAX cache only"))
            results.append(one_start(name, src, cache, args, "the start after it"))
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    print("| variant | start | launch to ready s | compiled / loaded | "
          + " | ".join(f"{n} tok: first / rest e2e s" for n in args.lengths) + " |")
    print("|---|---|---:|---|" + "---|" * len(args.lengths))
    for r in results:
        w = r["warmup"]
        cells = []
        for row in r["requests"]:
            e2e = [q["e2e_s"] for q in row["requests"]]
            late = "*" if any(q["uncompiled"] for q in row["requests"]) else ""
            cells.append(f"{e2e[0]:.2f} / {min(e2e[1:], default=float('nan')):.2f}-{max(e2e[1:], default=float('nan')):.2f}{late}")
        print(f"| {r['variant']} | {r['start']} | {r['ready_s']:.1f} | "
              f"{w.get('executables_compiled', w.get('cache_misses'))} / {w.get('executables_loaded', w.get('cache_hits'))} | "
              + " | ".join(cells) + " |")
    print("(* a request of that length compiled something after ready)")
    print(json.dumps({"startup": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
