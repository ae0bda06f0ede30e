"""`gemmax mcp`: the operator's tools as an MCP server (the official SDK's `MCPServer`), over stdio
or streamable HTTP.

Each tool is a thin wrapper over code the CLI runs too: the rigs registry and a small deployment
registry (`gemmax.mcp.deployments`), the benchmark harness (`gemmax.bench`), the memory plan
(`gemmax fit`), the decode profiler (`gemmax profile`), the compile cache (`gemmax cache`). Docstrings are the tool descriptions; results
are pydantic models (structured output with a JSON schema). Anticipated failures (an unknown rig, a
busy port, a missing model, a server error) come back as tool errors carrying the message, never
as a crash of the server.

File arguments are confined (`confined`): a tool reads and writes only under gemmax's own state
directory and cache directory, and refuses any other path with a message naming both; URL
destinations (fsspec: s3://, gs://, ...) are refused unless the operator opted in (`gemmax mcp
--allow-urls`, or GEMMAX_MCP_ALLOW_URLS=1). A deployment binds loopback unless it is given an API
key. docs/mcp.md has the rules.

Tools that touch the accelerator (`verify_device`, `fit_check`, `profile_decode`) run the CLI in a short-lived child
process: JAX claims most of a GPU's memory in the first process that uses it, and this server must
not hold it while the deployments it starts need it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel, Field

import gemmax
from gemmax.mcp.deployments import (
    DeploymentError,
    DeploymentStatus,
    StopResult,
    state_dir,
)
from gemmax.mcp.device import DeviceReport
from gemmax.mcp.local import deployments
from gemmax.mcp.remote import DEPLOY_TOOLS, DeployError, check_url

INSTRUCTIONS = """\
gemmax deployment tools. Typical flow: list_rigs -> verify_device -> fit_check -> start_deployment
(waits until /health is 200) -> deployment_status / query_model -> run_sweep -> compare_results ->
stop_deployment; profile_decode shows where a decode step's time goes. Deployments outlive this server and are remembered on disk: list_deployments shows
what any gemmax MCP server on this machine started, and a deployment whose process died shows as
"dead" until stop_deployment removes it. Beyond this machine: deploy_launch (target ssh or aws) ->
deploy_status (boot timeline) -> deploy_benchmark -> deploy_terminate; deploy_cost and deploy_cleanup
keep the bill and the orphans in check."""

# Failures with a message worth showing the caller; anything else is a bug and the SDK reports it
# as an opaque crash.
ANTICIPATED = (DeploymentError, DeployError, ValueError, OSError, RuntimeError, httpx.HTTPError, subprocess.SubprocessError)
CLI_TIMEOUT_S = 900.0


def _cli(args: list[str], timeout: float = CLI_TIMEOUT_S, module: str = "gemmax.cli") -> subprocess.CompletedProcess:
    """Run `python -m <module> ARGS` (stdin closed: under the stdio transport ours is the protocol)."""
    return subprocess.run([sys.executable, "-m", module, *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


def _json_output(proc: subprocess.CompletedProcess, what: str, ok_codes: tuple[int, ...]) -> dict[str, Any]:
    """The JSON object on the last stdout line, or an error naming what failed and why (stderr tail)."""
    lines = proc.stdout.strip().splitlines()
    if proc.returncode in ok_codes and lines:
        try:
            return json.loads(lines[-1])
        except ValueError:
            pass
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise DeploymentError(f"{what} failed (exit status {proc.returncode}):\n{tail}")


# ------------------------------------------------------------------------------------------ confinement

ALLOW_URLS_ENV = "GEMMAX_MCP_ALLOW_URLS"


def allowed_roots() -> list[Path]:
    """Where the tools may read and write files: gemmax's state directory and its cache directory."""
    from gemmax.engine.compile_cache import cache_root

    return [state_dir().resolve(), cache_root().resolve()]


def confined(path: str, argument: str) -> Path:
    """`path` resolved (symlinks followed; relative to the state directory) if it lies under an
    allowed root; otherwise refused with a message saying where files may go."""
    if "://" in path and not path.startswith("file://"):
        raise ValueError(f"{argument}: {path!r} is a URL; this tool takes a local path here")
    given = Path(path.removeprefix("file://")).expanduser()
    resolved = (given if given.is_absolute() else state_dir() / given).resolve()
    roots = allowed_roots()
    if not any(resolved.is_relative_to(root) for root in roots):
        raise ValueError(f"{argument}: {path!r} is outside gemmax's own directories; the MCP tools read and "
                         f"write files only under {' or '.join(str(r) for r in roots)} (a relative path is "
                         "taken under the state directory)")
    return resolved


def url_or_confined(location: str, argument: str) -> str:
    """A tarball location: a URL when the operator opted in to URL destinations, else a confined path."""
    if "://" in location and not location.startswith("file://"):
        if os.environ.get(ALLOW_URLS_ENV) != "1":
            raise ValueError(f"{argument}: URL destinations are off; the operator enables them with "
                             f"`gemmax mcp --allow-urls` (or {ALLOW_URLS_ENV}=1)")
        return location
    return str(confined(location, argument))


# ------------------------------------------------------------------------------------------ results


class RigInfo(BaseModel):
    name: str
    available: bool = Field(description="its runtime is installed here")
    description: str


class LogTail(BaseModel):
    name: str
    log: str = Field(description="the log file (stdout and stderr of the rig process)")
    lines: list[str]


class FitReport(BaseModel):
    """`gemmax fit`: weights + KV cache + workspace against device memory."""

    fits: bool
    plan: dict[str, Any] = Field(description="every term in bytes, plus the largest max_model_len / max_batch that fit")
    explanation: str = Field(description="the arithmetic, as `gemmax fit` prints it")


class QueryResult(BaseModel):
    deployment: str
    endpoint: str
    model: str
    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    degeneracy: dict[str, Any] | None = Field(description="the server's verdict on this output (null: the server gives none)")
    degenerate_responses_before: float | None = Field(description="gemmax:degenerate_responses_total before the request")
    degenerate_responses_after: float | None
    degenerate_responses_delta: float | None
    latency_s: float


class SweepSummary(BaseModel):
    path: str = Field(description="the full result JSON (input for compare_results)")
    label: str
    model: str
    decode_source: str
    prompt_mode: str
    forced_output: bool = Field(description="the server honoured ignore_eos/min_tokens, so every output had the asked length")
    cells: list[dict[str, Any]] = Field(description="headline figures per cell: decode tok/s, median TTFT ms, throughput")
    flags: list[str] = Field(description="cell warnings (output length not held, failed requests, coarse gauge)")
    precision: dict[str, Any] | None
    degenerate_responses_delta: float | None


class Comparison(BaseModel):
    columns: list[str]
    rows: list[list[str]]
    notes: list[str]
    markdown: str


class ProfileResult(BaseModel):
    """`gemmax profile`: where a decode step's time goes, and the share of the bandwidth roofline."""

    report_path: str = Field(description="profile.json (compare two with `gemmax profile --compare A B`)")
    trace_dir: str = Field(description="the JAX profiler trace (open with xprof or TensorBoard)")
    text: str = Field(description="the tables `gemmax profile` prints: time by kind of op, bytes, roofline, slowest ops")
    report: dict[str, Any] = Field(description="the full report: categories, top ops, bytes per step, tok/s, roofline %")


class CacheTransfer(BaseModel):
    url: str
    cache_dir: str
    bytes_written: int | None = None
    files_restored: int | None = None


# ------------------------------------------------------------------------------------------ tools


def list_rigs() -> list[RigInfo]:
    """Runtimes that can serve a model behind the same OpenAI-compatible API (gemmax, transformers,
    vllm), and whether each is installed here."""
    from gemmax.rigs.registry import RIGS

    return [RigInfo(name=r.name, available=r.available(), description=r.description) for r in RIGS.values()]


class DeploymentOptions(BaseModel):
    host: str = Field("127.0.0.1", description="bind address: loopback unless api_key is given")
    api_key: str | None = Field(None, description="the API key the deployment requires (gemmax, vllm); needed to "
                                "bind anything but loopback. Not recorded on disk.")
    dtype: str | None = Field(None, description="weights/compute dtype; null: the rig's default (gemmax: device policy)")
    max_model_len: int | None = Field(None, ge=2, description="longest prompt + completion in tokens")
    max_batch: int | None = Field(None, ge=1, description="decode slots (gemmax --max-batch, vllm --max-num-seqs)")
    name: str | None = Field(None, description="deployment name; default RIG-PORT")
    wait: bool = Field(True, description="return once /health answers 200")
    timeout_s: float = Field(600.0, gt=0, description="how long to wait for /health")


def start_deployment(rig: str, model: str, port: Annotated[int, Field(ge=1, le=65535)],
                     options: DeploymentOptions | None = None) -> DeploymentStatus:
    """Start a rig (gemmax, transformers or vllm) serving MODEL on PORT as a managed background
    process, its output captured in a log file, and record it in the deployment registry. By default
    waits until GET /health answers 200; a rig that exits or stays unhealthy is stopped and the error
    carries its log tail. MODEL is a local checkpoint directory (or .gguf for gemmax) or a hub id."""
    o = options or DeploymentOptions()
    return deployments().start(rig, model, port, host=o.host, dtype=o.dtype, max_model_len=o.max_model_len,
                               max_batch=o.max_batch, name=o.name, wait=o.wait, timeout_s=o.timeout_s,
                               api_key=o.api_key)


def stop_deployment(name: str, timeout_s: Annotated[float, Field(gt=0)] = 30.0) -> StopResult:
    """Stop a deployment: SIGTERM (gemmax drains in-flight requests), then SIGKILL after timeout_s;
    removes it from the registry (a dead one is just removed). The log file is kept."""
    return deployments().stop(name, timeout_s)


def list_deployments() -> list[DeploymentStatus]:
    """Every deployment in the registry (started by any gemmax MCP server on this machine) with its
    live state: ready, loading, unreachable or dead."""
    return deployments().statuses()


def deployment_status(name: str) -> DeploymentStatus:
    """One deployment's state and what its /health reports: device policy, precision (the dtypes
    actually in use), weight bytes, version and build, uptime; for a dead one, its exit status when known."""
    return deployments().status(name)


def deployment_logs(name: str, tail: Annotated[int, Field(ge=1, le=10000)] = 100) -> LogTail:
    """The last TAIL lines of a deployment's log (its stdout and stderr)."""
    record, lines = deployments().logs_tail(name, tail)
    return LogTail(name=name, log=record.log, lines=lines)


def verify_device(dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto") -> DeviceReport:
    """The accelerator as gemmax sees it: platform, device kind, compute capability, memory, the dtype
    policy chosen for it (and its warning, e.g. an emulated dtype), and real matrix products through
    the model's own matmul in those dtypes checked against numpy (catches a broken driver, a wrong
    kernel, or float16 overflow). Runs in a short-lived process so this server never holds the device."""
    proc = _cli(["--dtype", dtype], module="gemmax.mcp.device")
    return DeviceReport(**_json_output(proc, "the device check", ok_codes=(0, 1)))


def fit_check(model: str, max_model_len: Annotated[int, Field(ge=1)] = 2048, max_batch: Annotated[int, Field(ge=1)] = 4,
              device_memory_gib: float | None = None, dtype: str = "auto", kv_dtype: str = "auto",
              prefill_tokens: int | None = None) -> FitReport:
    """Will MODEL fit at max_model_len x max_batch? The memory plan of `gemmax fit`: weights + KV cache
    (sliding rings and KV sharing honoured) + prefill workspace against the device's memory (or
    device_memory_gib), with the arithmetic and the largest max_model_len / max_batch that fit.
    MODEL: a checkpoint directory (config.json alone is enough), a config.json, a .gguf or a hub id."""
    from gemmax.engine.memory import MemoryPlan

    args = ["fit", "--model", model, "--max-model-len", str(max_model_len), "--max-batch", str(max_batch),
            "--dtype", dtype, "--kv-dtype", kv_dtype, "--json"]
    if device_memory_gib is not None:
        args += ["--device-memory-gib", str(device_memory_gib)]
    if prefill_tokens is not None:
        args += ["--prefill-tokens", str(prefill_tokens)]
    plan = _json_output(_cli(args), "gemmax fit", ok_codes=(0, 1))
    fields = {f.name for f in dataclasses.fields(MemoryPlan)}
    return FitReport(fits=plan["fits"], plan=plan, explanation=MemoryPlan(**{k: plan[k] for k in fields}).explain())


async def query_model(deployment: str, prompt: str, max_tokens: Annotated[int, Field(ge=1)] = 32,
                      temperature: Annotated[float, Field(ge=0)] = 0.0, seed: int | None = None,
                      chat: bool = False, api_key: str | None = None) -> QueryResult:
    """Send one request to a deployment (/v1/completions, or /v1/chat/completions with chat=true, the
    prompt as one user message) and return the text with the server's degeneracy verdict and the change
    in its gemmax:degenerate_responses_total counter across the request. api_key: the deployment's key
    (default: the one it was started with by this server)."""
    from gemmax.bench.sweep import degenerate_count

    record = deployments().get(deployment)
    key = api_key or deployments().api_key(deployment)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=record.base_url, headers=headers,
                                 timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        listed = (await client.get("/v1/models")).json().get("data") or [{}]
        model = listed[0].get("id") or record.model
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            body["seed"] = seed
        if chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        before = await degenerate_count(client)
        t0 = time.perf_counter()
        response = await client.post(path, json=body)
        latency = time.perf_counter() - t0
        after = await degenerate_count(client)
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500]
        raise DeploymentError(f"{path} on {deployment} answered HTTP {response.status_code}: {message}")
    data = response.json()
    choice = data["choices"][0]
    return QueryResult(
        deployment=deployment, endpoint=path, model=model,
        text=choice["message"]["content"] if chat else choice["text"], finish_reason=choice.get("finish_reason"),
        usage=data.get("usage"), degeneracy=choice.get("degeneracy"), degenerate_responses_before=before,
        degenerate_responses_after=after,
        degenerate_responses_delta=None if before is None or after is None else after - before,
        latency_s=round(latency, 4))


async def run_sweep(deployment: str, input_lens: list[int] | None = None, output_len: int | None = None,
                    repeats: int | None = None, concurrency: list[int] | None = None,
                    request_rates: list[float] | None = None, num_prompts: int | None = None,
                    decode_source: Literal["auto", "stream", "gauge", "both"] | None = None,
                    prompt_mode: Literal["auto", "server", "local", "ids"] | None = None,
                    label: str | None = None, out: str | None = None, api_key: str | None = None) -> SweepSummary:
    """Run the benchmark harness (`gemmax bench`) against a deployment: every input length x load
    level, a warm-up round then `repeats` measured rounds each, timed from the wire. Unset arguments
    take the harness defaults (input lengths 41,521,2057,3593; 64 output tokens; 3 repeats;
    concurrency 1). Writes the full result JSON to OUT (default: under the state directory) and
    returns its path with the headline figures. The label defaults to the deployment name. api_key: the
    deployment's key (default: the one it was started with by this server)."""
    from gemmax.bench.report import run_flags, summary_line, write_json
    from gemmax.bench.sweep import Sweep, SweepConfig

    if out:
        confined(out, "out")  # refused before the sweep runs, not after
    record = deployments().get(deployment)
    given = {"input_lens": input_lens, "output_len": output_len, "repeats": repeats, "concurrency": concurrency,
             "request_rates": request_rates, "num_prompts": num_prompts, "decode_source": decode_source,
             "prompt_mode": prompt_mode}
    config = SweepConfig(base_url=record.base_url, label=label or record.name,
                         api_key=api_key or deployments().api_key(deployment),
                         **{k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None})
    result = await Sweep(config).run()
    path = confined(out, "out") if out else state_dir() / "results" / f"{record.name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(result, path)
    server = result["server"]
    return SweepSummary(path=str(path), label=result["label"], model=result["model"],
                        decode_source=result["decode_source"], prompt_mode=result["prompt_mode"],
                        forced_output=result["forced_output"], cells=json.loads(summary_line(result))["cells"],
                        flags=run_flags(result),
                        precision=server["precision_after"],
                        degenerate_responses_delta=server["degenerate_responses_delta"])


def compare_results(files: Annotated[list[str], Field(min_length=2)]) -> Comparison:
    """Side-by-side comparison of sweep result files (`gemmax bench compare`; the first is the
    baseline): wire decode tok/s and TTFT per cell with ratios, each rig's own gauge beside its own
    figures only, and notes on precision and degenerate responses."""
    from gemmax.bench.compare import compare_runs, to_markdown
    from gemmax.bench.report import load_run

    comparison = compare_runs([load_run(confined(f, "files")) for f in files])
    return Comparison(columns=comparison.columns, rows=comparison.rows, notes=comparison.notes,
                      markdown=to_markdown(comparison))


def profile_decode(model: str, steps: Annotated[int, Field(ge=1)] = 20, warmup: Annotated[int, Field(ge=0)] = 5,
                   batch: Annotated[int, Field(ge=1)] = 1, context: Annotated[int, Field(ge=0)] = 128,
                   dtype: str = "auto", layout: Literal["auto", "plain"] = "auto", random_weights: bool = False,
                   peak_bandwidth_gbs: float | None = None, out: str | None = None) -> ProfileResult:
    """Profile decode steps of MODEL with the JAX profiler (`gemmax profile`): device time by kind of op
    (conversion, fp32 / 16-bit matmul, attention, ...) classified from the compiled HLO, bytes read per
    step, tokens/s and the share of the bandwidth roofline. random_weights reads only config.json.
    Writes the trace and profile.json under OUT (default: under the state directory). Runs in its own
    process, on the device a deployment may be using: profile before starting one, or on a spare device."""
    out_dir = confined(out, "out") if out else state_dir() / "profiles" / time.strftime("%Y%m%d-%H%M%S")
    args = ["profile", "--model", model, "--steps", str(steps), "--warmup", str(warmup), "--batch", str(batch),
            "--context", str(context), "--dtype", dtype, "--layout", layout, "--out", str(out_dir)]
    if random_weights:
        args.append("--random-weights")
    if peak_bandwidth_gbs is not None:
        args += ["--peak-bandwidth", str(peak_bandwidth_gbs)]
    proc = _cli(args)
    report = _json_output(proc, "gemmax profile", ok_codes=(0,))
    text = proc.stdout.strip().rsplit("\n", 1)[0]
    return ProfileResult(report_path=str(out_dir / "profile.json"), trace_dir=str(out_dir), text=text, report=report)


def compile_cache_export(dest: str, cache_dir: str | None = None) -> CacheTransfer:
    """Pack JAX's persistent compilation cache (default: the user cache dir) into a .tar.gz at DEST: a
    path under gemmax's state or cache directory, or (when the operator allowed URLs) any fsspec URL
    (s3://, gs://, ...) whose filesystem package is installed."""
    from gemmax.engine.compile_cache import default_cache_dir, export_cache

    source = confined(cache_dir, "cache_dir") if cache_dir else default_cache_dir()
    check_url(dest)
    written = export_cache(url_or_confined(dest, "dest"), source)
    return CacheTransfer(url=dest, cache_dir=str(cache_dir or default_cache_dir()), bytes_written=written)


def compile_cache_import(src: str, cache_dir: str | None = None) -> CacheTransfer:
    """Unpack a tarball made by compile_cache_export (local path or fsspec URL) into the compilation
    cache, so the next start skips XLA compilation."""
    from gemmax.engine.compile_cache import default_cache_dir, import_cache

    target = confined(cache_dir, "cache_dir") if cache_dir else default_cache_dir()
    check_url(src)
    restored = import_cache(url_or_confined(src, "src"), target)
    return CacheTransfer(url=src, cache_dir=str(cache_dir or default_cache_dir()), files_restored=restored)


TOOLS: tuple[Callable[..., Any], ...] = (
    list_rigs, start_deployment, stop_deployment, list_deployments, deployment_status, deployment_logs,
    verify_device, fit_check, query_model, run_sweep, compare_results, profile_decode, compile_cache_export,
    compile_cache_import, *DEPLOY_TOOLS,
)


# ------------------------------------------------------------------------------------------ server


def _tool_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Re-raise anticipated failures as ToolError, so the caller reads the message (the SDK hides the
    text of any other exception)."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def run_async(*args, **kwargs):
            try:
                return await fn(*args, **kwargs)
            except ANTICIPATED as exc:
                raise ToolError(str(exc)) from exc

        return run_async

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ANTICIPATED as exc:
            raise ToolError(str(exc)) from exc

    return run


def build_server() -> MCPServer:
    server = MCPServer("gemmax", instructions=INSTRUCTIONS, version=gemmax.__version__)
    for fn in TOOLS:
        server.add_tool(_tool_errors(fn), description=inspect.cleandoc(fn.__doc__ or ""))
    return server


def run(transport: Literal["stdio", "http"] = "stdio", host: str = "127.0.0.1", port: int = 8765,
        allow_urls: bool = False) -> None:
    """Serve over stdio, or streamable HTTP at http://HOST:PORT/mcp."""
    if allow_urls:
        os.environ[ALLOW_URLS_ENV] = "1"
    server = build_server()
    if transport == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host=host, port=port)
