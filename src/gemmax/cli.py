"""The `gemmax` command line. Each command is a thin shell over a library function; heavy imports
(jax, torch) happen inside the commands so `gemmax --help` stays instant."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import sys

import typer

app = typer.Typer(help="gemmax: Gemma 4 / Gemma 3 inference in pure JAX.", no_args_is_help=True,
                  pretty_exceptions_enable=False)


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _parse_ids(text: str, vocab_size: int) -> list[int]:
    """--prompt-ids: comma-separated ids, at least one, each in the vocabulary."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise typer.BadParameter(f"--prompt-ids must be comma-separated integers, got {text!r}") from exc
    if not ids:
        raise typer.BadParameter("--prompt-ids holds no id")
    from gemmax.engine.api import check_token_ids

    with _usage_errors():
        check_token_ids("--prompt-ids", ids, vocab_size)
    return ids


@contextlib.contextmanager
def _usage_errors():
    """A value the command cannot use (an unknown dtype, a model path that is not there) is a usage
    error (exit status 2, one line), not a traceback: `fit` keeps status 1 for "does not fit"."""
    try:
        yield
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


# Load-time quantisation (docs/quantization.md): one option set shared by generate, serve, fit and
# profile. `with_quant_options` adds these parameters to a command, which receives them as one
# `quant` argument (a gemmax.quant.QuantOptions).
_QUANT_OPTIONS = {
    "quant": (str, typer.Option("auto", help="linear layers: none, int8 (per output channel), w4a16 (int4, group-wise scales); auto: int8 layers and LM head for a checkpoint stored quantised (a Q4_K_M / Q8_0 GGUF, the built-in model) unless --dtype is given, else none")),
    "ple_bits": (int, typer.Option(16, help="per-layer embedding table: 16 (as loaded), 8 or 4 bits")),
    "int8_lm_head": (bool, typer.Option(False, "--int8-lm-head", help="int8 copy of the tied embedding for the LM head's matmul (the gather keeps its precision)")),
    "int8_gemm_copy": (bool, typer.Option(True, "--int8-gemm-copy/--no-int8-gemm-copy", help="CPU, int8 layers: also hold each matrix in bf16 for batched decode at 8+ rows and prefill (faster; 3 bytes a weight instead of 1)")),
    "kv_cache_dtype": (str, typer.Option("auto", help="KV cache: auto (device policy) or int8 (per-position, per-head scales)")),
    "w4a16_kernel": (str, typer.Option("auto", help="w4a16 matmul: auto, xla, pallas (fused kernel; tiles checked against on-chip memory)")),
    "w4a16_tiles": (str, typer.Option(None, help="Pallas tiles BMxBNxBK[xSTAGES] (default: the largest that fit)")),
    "allow_pallas_interpret": (bool, typer.Option(False, "--allow-pallas-interpret", help="allow the Pallas kernel in CPU interpret mode (a simulator)")),
}


def with_quant_options(command):
    """Add the load-time quantisation options to a typer command; it gets them as `quant=QuantOptions(...)`."""
    signature = inspect.signature(command)
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
             for name, (kind, option) in _QUANT_OPTIONS.items()]

    @functools.wraps(command)
    def wrapper(**kwargs):
        from gemmax.quant.options import QuantError, QuantOptions, W4Tiles

        values = {name: kwargs.pop(name) for name in _QUANT_OPTIONS}
        try:
            tiles = W4Tiles.parse(values["w4a16_tiles"]) if values["w4a16_tiles"] else None
            quant = QuantOptions(quant=values["quant"], ple_bits=values["ple_bits"], int8_lm_head=values["int8_lm_head"],
                                 int8_gemm_copy=values["int8_gemm_copy"],
                                 kv_cache=values["kv_cache_dtype"], w4a16_kernel=values["w4a16_kernel"],
                                 w4a16_tiles=tiles, allow_pallas_interpret=values["allow_pallas_interpret"])
        except (QuantError, ValueError) as exc:
            raise typer.BadParameter(str(exc)) from exc
        return command(**kwargs, quant=quant)

    kept = [p for p in signature.parameters.values() if p.name != "quant"]
    wrapper.__signature__ = signature.replace(parameters=kept + added)
    wrapper.__annotations__ = {**{k: v for k, v in command.__annotations__.items() if k != "quant"},
                               **{name: kind for name, (kind, _) in _QUANT_OPTIONS.items()}}
    return wrapper


_COORDINATOR_HELP = "several hosts: jax.distributed coordinator HOST:PORT (or JAX_COORDINATOR_ADDRESS; TPU pods and SLURM are detected)"
_NUM_PROCESSES_HELP = "several hosts: processes in all"


@app.command()
@with_quant_options
def generate(
    model: str = typer.Option(None, help="HF directory, .gguf file, hub id; default: the built-in model"),
    prompt: str = typer.Option(None, help="text prompt (<bos> is prepended)"),
    prompt_ids: str = typer.Option(None, help="comma-separated token ids, used as is"),
    max_tokens: int = typer.Option(32, min=1),
    temperature: float = typer.Option(0.0, min=0.0),
    top_k: int = typer.Option(0, min=0),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0),
    seed: int = typer.Option(None),
    dtype: str = typer.Option("auto", help="auto (device policy), float32, bfloat16, float16"),
    json_output: bool = typer.Option(False, "--json", help="print one JSON object"),
    coordinator: str = typer.Option(None, help=_COORDINATOR_HELP),
    num_processes: int = typer.Option(None, min=1, help=_NUM_PROCESSES_HELP),
    process_id: int = typer.Option(None, min=0, help="several hosts: this process's index (0 prints)"),
    mesh: str = typer.Option(None, help="dp=D,tp=T[,ep=E]: data (decode slots), tensor and expert parallel over D*T*E devices (docs/mesh.md); default one device"),
    quant=None,
) -> None:
    """Generate from one prompt (greedy when temperature is 0)."""
    _setup_logging()
    if (prompt is None) == (prompt_ids is None):
        raise typer.BadParameter("give exactly one of --prompt or --prompt-ids")
    from gemmax.engine.api import SamplingParams
    from gemmax.engine.generate import generate as run
    from gemmax.engine.loading import load_model

    spec = _mesh_spec(mesh)
    distributed = _join_processes(spec, coordinator, num_processes, process_id)
    try:
        loaded = load_model(model, dtype, quant, mesh=spec)
    except ValueError as exc:  # quantisation options this device cannot run (QuantError, W4A16FitError)
        raise typer.BadParameter(str(exc)) from exc
    if prompt is not None:
        if loaded.tokenizer is None:
            raise typer.BadParameter("this checkpoint has no tokenizer: use --prompt-ids")
        ids = loaded.tokenizer.encode(prompt)
    else:
        ids = _parse_ids(prompt_ids, loaded.checkpoint.config.vocab_size)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    params = loaded.checkpoint.params
    with contextlib.ExitStack() as stack:
        if spec is not None:  # the weights on the mesh; the steps follow their shardings
            import jax

            from gemmax.engine.mesh import make_mesh, shard_params

            device_mesh = make_mesh(spec)
            params = shard_params(params, loaded.checkpoint.config, device_mesh)
            stack.enter_context(jax.set_mesh(device_mesh))
        out = run(params, loaded.checkpoint.config, ids, max_tokens, sampling, loaded.policy.precision())
    if distributed:
        import jax

        if jax.process_index() != 0:  # every process ran the same steps; process 0 answers
            return
    text = loaded.tokenizer.decode(out) if loaded.tokenizer is not None else None
    if json_output:
        payload = {"token_ids": out, **({"text": text} if text is not None else {})}
        typer.echo(json.dumps(payload))
    else:
        typer.echo(text if text is not None else ",".join(map(str, out)))


def _several_processes(coordinator: str | None, num_processes: int | None) -> bool:
    """Whether the flags or JAX_COORDINATOR_ADDRESS ask for several processes."""
    return coordinator is not None or num_processes is not None or "JAX_COORDINATOR_ADDRESS" in os.environ


def _join_processes(spec, coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """`jax.distributed.initialize` when several processes are asked for (`_several_processes`), before
    anything touches a device; returns whether they were."""
    if not _several_processes(coordinator, num_processes):
        return False
    if spec is None:
        raise typer.BadParameter("several processes need --mesh over their devices")
    from gemmax.engine.mesh import init_distributed

    init_distributed(coordinator, num_processes, process_id)
    return True


def _mesh_spec(text: str | None):
    from gemmax.engine.mesh import MeshError, MeshSpec

    try:
        return MeshSpec.parse(text)
    except MeshError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _fit_table(json_output: bool) -> None:
    import jax.numpy as jnp

    from gemmax.engine.memory import GiB, fit_table
    from gemmax.model.config import FAMILY_TEXT_CONFIGS, ModelConfig

    models = {name: ModelConfig.from_hf_config(hf) for name, hf in FAMILY_TEXT_CONFIGS.items()}
    rows = fit_table(models, 8192, 8, weight_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
                     activation_dtype=jnp.bfloat16, prefill_tokens=2048)
    if json_output:
        typer.echo(json.dumps(rows))
        return
    typer.echo("smallest mesh serving 8 slots x 8,192 tokens (bf16 weights and KV, 2,048-token prefill chunks); "
               "per device; largest batch at 8,192 tokens / largest context at 8 slots on that mesh")
    typer.echo(f"{'model':8} {'accelerator':13} {'mesh':30} {'weights':>9} {'KV':>9} {'batch':>6} {'context':>8}")
    for r in rows:
        if r["mesh"] is None:
            typer.echo(f"{r['model']:8} {r['accelerator']:13} {'none up to 64 devices':30}")
            continue
        typer.echo(f"{r['model']:8} {r['accelerator']:13} {r['mesh']:30} {r['weights_per_device'] / GiB:7.2f}Gi "
                   f"{r['kv_per_device'] / GiB:7.2f}Gi {r['largest_batch']:6} {r['largest_context']:8,}")


@app.command()
def policy(dtype: str = typer.Option("auto"), json_output: bool = typer.Option(False, "--json")) -> None:
    """Print the device policy (platform, device, compute capability, dtypes)."""
    from gemmax.engine.policy import device_policy

    with _usage_errors():
        p = device_policy(dtype)
    typer.echo(json.dumps(p.as_dict()) if json_output else p.log_line())
    if p.warning:
        typer.echo(f"WARNING: {p.warning}", err=True)


@app.command()
@with_quant_options
def fit(
    model: str = typer.Option(None, help="HF directory (config.json alone is enough), config.json, .gguf or hub id"),
    max_model_len: int = typer.Option(2048, min=1, help="longest prompt + completion, tokens"),
    max_batch: int = typer.Option(8, min=1, help="decode slots"),
    device_memory_gib: float = typer.Option(None, min=0.0, help="plan for this much device memory (default: the live device's)"),
    dtype: str = typer.Option("auto", help="weights: auto (device policy), float32, bfloat16, float16"),
    kv_dtype: str = typer.Option("auto", help="KV cache: auto (device policy), float32, bfloat16, float16"),
    prefill_tokens: int = typer.Option(None, min=1, help="largest prefill chunk (default: the engine's largest bucket)"),
    prefix_cache_bytes: int = typer.Option(None, min=0, help="prefix cache budget, bytes, as serve's (default: free memory, at most 1 GiB; none with --mesh; 0: off)"),
    json_output: bool = typer.Option(False, "--json", help="print the plan as one JSON object"),
    mesh: str = typer.Option(None, help="dp=D,tp=T[,ep=E]: data (decode slots), tensor and expert parallel over D*T*E devices (docs/mesh.md); default one device"),
    speculative: bool = typer.Option(False, "--speculative", help="plan for `serve --speculative`: sliding rings with 8 slots of slack (docs/speculative.md)"),
    draft_model: str = typer.Option(None, help="plan for `serve --draft-model`: the draft's weights and KV cache too, or an MTP assistant's weights (no KV of its own; implies --speculative)"),
    table: bool = typer.Option(False, "--table", help="for E2B, E4B, 31B and 26B-A4B on common accelerators: the smallest mesh serving 8 slots x 8,192 tokens (bf16) and the largest batch / context there"),
    quant=None,
) -> None:
    """Will this model fit? Weights + KV cache (sliding rings and KV sharing honoured) + prefill workspace
    against device memory (per device with --mesh); exits 1 with the arithmetic and the largest
    max_model_len / batch that fit."""
    import jax.numpy as jnp

    from gemmax.engine.api import SPEC_KS
    from gemmax.engine.memory import GiB, plan_memory
    from gemmax.engine.policy import DTYPES, device_policy

    if table:
        _fit_table(json_output)
        return
    if model is None:
        raise typer.BadParameter("give --model (or --table)")
    spec = _mesh_spec(mesh)

    if kv_dtype != "auto" and kv_dtype not in DTYPES:
        raise typer.BadParameter(f"--kv-dtype must be auto or one of {sorted(DTYPES)}")
    with _usage_errors():
        p = device_policy(dtype)
    memory = int(device_memory_gib * GiB) if device_memory_gib is not None else p.device_memory_bytes
    if memory is None:
        raise typer.BadParameter("this device reports no memory size: give --device-memory-gib")
    import dataclasses

    from gemmax.engine.loading import quant_for
    from gemmax.quant.plan import format_weight_bytes, quantized_weight_bytes, weight_bytes_table
    from gemmax.weights.load import open_source

    with _usage_errors():
        source = open_source(model, weights=False)
    config = source.config
    if max_model_len > config.max_position_embeddings:  # as `serve` refuses it
        raise typer.BadParameter(f"--max-model-len {max_model_len:,} exceeds the {config.max_position_embeddings:,} "
                                 "positions the model was made for (max_position_embeddings in its config)")
    asked, quant = quant, quant_for(source, dtype, quant)
    kernel = "cpu" if p.platform == "cpu" else "xla"  # a CPU load keeps int8 matrices' GEMM copies too
    kv = "int8" if quant.kv_cache == "int8" else p.kv_cache if kv_dtype == "auto" else kv_dtype
    draft, mtp_slack = {}, 0
    if draft_model is not None:
        if spec is not None:
            raise typer.BadParameter("a draft model runs on one device: --draft-model cannot be planned with --mesh")
        from gemmax.model.assistant import AssistantConfig
        from gemmax.weights.assistant import assistant_weight_bytes, is_assistant, read_config

        if is_assistant(draft_model):  # weights only: it reads the target's KV; rings one slot more
            assistant = AssistantConfig.from_hf_config(read_config(draft_model))
            draft = {"draft_weights": assistant_weight_bytes(assistant, p.weight_dtype)}
            mtp_slack = 1
        else:
            with _usage_errors():
                draft_source = open_source(draft_model, weights=False)
            draft_quant = quant_for(draft_source, dtype, asked)
            draft = {"draft_config": draft_source.config,
                     "draft_weights": quantized_weight_bytes(draft_source.config, draft_quant, p.weight_dtype, kernel)}
        speculative = True
    weights, copies = None, 0
    if quant.changes_weights:
        weights = quantized_weight_bytes(config, quant, p.weight_dtype, kernel)
        copies = weights - quantized_weight_bytes(config, dataclasses.replace(quant, int8_gemm_copy=False),
                                                  p.weight_dtype, kernel)
    plan = plan_memory(config, max_model_len, max_batch, memory, weight_dtype=p.weight_dtype,
                       kv_dtype=jnp.int8 if kv == "int8" else DTYPES[kv],
                       activation_dtype=DTYPES[p.activations],
                       prefill_tokens=prefill_tokens or p.prefill_buckets[-1], model=model, mesh=spec,
                       ring_slack=max(SPEC_KS) + mtp_slack if speculative else 0,
                       weights=weights, weight_copies=copies,
                       prefix_cache_bytes=0 if spec is not None else prefix_cache_bytes, **draft)
    by_option = weight_bytes_table(config, p.weight_dtype, kernel, quant.int8_gemm_copy)  # exact, from shapes (jax.eval_shape)
    if json_output:
        typer.echo(json.dumps({**plan.as_dict(), "quant": quant.label, "weight_bytes_by_option": by_option}))
    else:
        from gemmax.quant.options import QuantOptions

        int8_alone = quantized_weight_bytes(config, QuantOptions(quant="int8"), p.weight_dtype)  # no copies
        held = ("\n  (int8 rows include the layers' bf16 GEMM copies this CPU holds; --no-int8-gemm-copy plans without them)"
                if by_option["int8"] != int8_alone else "")
        typer.echo(plan.explain() + f"\n  quantisation: {quant.label}\n" + format_weight_bytes(by_option, p.weight_dtype) + held)
    if not plan.fits:
        raise typer.Exit(1)


def _speculation(method: str, k: int, draft_model: str | None = None):
    """--speculative / --spec-k / --draft-model -> the engine's `speculation` (None: off)."""
    from gemmax.engine.api import SPEC_KS, Speculation

    if method not in ("off", "ngram", "draft", "mtp", "on-request"):
        raise typer.BadParameter(f"--speculative must be off, ngram, draft, mtp or on-request, got {method!r}")
    if method in ("draft", "mtp") and draft_model is None:
        raise typer.BadParameter(f"--speculative {method} needs --draft-model PATH")
    if draft_model is not None and method not in ("draft", "mtp", "on-request"):
        raise typer.BadParameter(f"--draft-model drafts for --speculative draft, mtp (or on-request), not {method!r}")
    if k not in SPEC_KS:
        raise typer.BadParameter(f"--spec-k must be one of {', '.join(map(str, SPEC_KS))}, got {k}")
    if method == "off":
        return None
    return Speculation(method if method in ("ngram", "draft", "mtp") else "off", k)


@app.command()
@with_quant_options
def serve(
    model: str = typer.Option(None, help="HF directory, .gguf file, hub id; default: the built-in model"),
    host: str = typer.Option("127.0.0.1", help="bind address (loopback by default)"),
    port: int = typer.Option(8000, min=0, max=65535),
    uds: str = typer.Option(None, help="listen on this Unix socket, not on --host/--port (machines without TCP; a proxy on the same host, which then needs --allowed-host for the Host it forwards); served as loopback"),
    max_model_len: int = typer.Option(2048, min=2, help="longest prompt + completion, tokens"),
    max_batch: int = typer.Option(8, min=1, help="decode slots (requests generated together)"),
    dtype: str = typer.Option("auto", help="auto (device policy), float32, bfloat16, float16"),
    api_key: str = typer.Option(None, envvar="GEMMAX_API_KEY", help="require 'Authorization: Bearer KEY'"),
    served_model_name: str = typer.Option(None, help="model name in the API (default: --model, or the built-in name)"),
    on_degenerate: str = typer.Option("flag", help="flag: report degenerate output; error: answer it with an error"),
    drain_timeout: float = typer.Option(30.0, min=0.0, help="seconds in-flight requests get at SIGTERM"),
    max_queue: int = typer.Option(256, min=0, help="requests that may wait for a slot (0: no bound); beyond: 503 with Retry-After"),
    max_choices: int = typer.Option(64, min=1, help="prompts x n in one request at most"),
    allowed_host: list[str] = typer.Option([], help="extra Host names served on a loopback bind (repeatable)"),
    prefix_cache_bytes: int = typer.Option(None, min=0, help="device bytes kept for the KV of prompt prefixes that later requests reuse (LRU; default: the memory plan's free bytes, at most 1 GiB; 0: off; not with --mesh; docs/server.md)"),
    batch_invariant: bool = typer.Option(False, help="decode each row as a single stream would (greedy texts independent of what shares the batch; batched decode slower: docs/server.md)"),
    speculative: str = typer.Option("off", help="speculative decoding (docs/speculative.md): off; ngram (prompt lookup for every request that does not opt out); draft (the --draft-model proposes, likewise); mtp (the --draft-model is a Gemma 4 MTP assistant, gemma4_assistant, that drafts from the target's hidden state and KV cache); on-request (only requests with the `speculative` extra)"),
    draft_model: str = typer.Option(None, help="a small model sharing the target's tokenizer that proposes tokens (HF directory, .gguf or hub id; with --speculative draft or on-request), or a Gemma 4 MTP assistant checkpoint (HF directory or hub id, e.g. the target's '-assistant'; with --speculative mtp or on-request)"),
    spec_k: int = typer.Option(4, help="tokens proposed per verify step by default: 2, 4 or 8"),
    log_level: str = typer.Option("info"),
    mesh: str = typer.Option(None, help="dp=D,tp=T[,ep=E]: data (decode slots), tensor and expert parallel over D*T*E devices (docs/mesh.md); default one device"),
    coordinator: str = typer.Option(None, help=_COORDINATOR_HELP),
    num_processes: int = typer.Option(None, min=1, help=_NUM_PROCESSES_HELP),
    process_id: int = typer.Option(None, min=0, help="several hosts: this process's index (0 serves HTTP, the others follow its schedule)"),
    warm_up: bool = typer.Option(True, "--warm-up/--no-warm-up", help="compile (or load) every declared shape and run it once before ready; --no-warm-up: ready once the model is loaded, each shape compiled or loaded by the first request that needs it (seconds to minutes for that request, reported as uncompiled_shape; for development, as llama.cpp's --no-warmup; one process only)"),
    quant=None,
) -> None:
    """OpenAI-compatible HTTP server (docs/server.md). /health answers 503 while loading and warming.

    Start-up of the built-in model on a 2-core CPU (README "Start-up"): 65-85 s with an empty
    compile cache (23 programs compiled; 65.1 s on 2026-12-07), 11-20 s with a warm one (loaded,
    not compiled; 10.9-15.2 s, median 13.2, on 2026-12-07); each program then runs before ready (a
    prefill chunk's below the largest bucket at each past it can read), so a shape's first request does not pay XLA's first-run set-up.
    --no-warm-up skips all of that: ready once the model is loaded, each shape's first request pays it."""
    _setup_logging()
    if on_degenerate not in ("flag", "error"):
        raise typer.BadParameter("--on-degenerate must be 'flag' or 'error'")
    spec = _mesh_spec(mesh)
    if batch_invariant and spec is not None:  # refused before anything loads
        raise typer.BadParameter("--batch-invariant decodes row by row on one device: it cannot be combined with --mesh")
    speculation = _speculation(speculative, spec_k, draft_model)
    if draft_model is not None and (spec is not None or _several_processes(coordinator, num_processes)):
        raise typer.BadParameter("--draft-model runs on one device and one process: not with --mesh, --coordinator, "
                                 "--num-processes or JAX_COORDINATOR_ADDRESS")
    if not warm_up and _several_processes(coordinator, num_processes):  # every process refuses, before it loads
        raise typer.BadParameter("--no-warm-up runs in one process: not with --coordinator, --num-processes or "
                                 "JAX_COORDINATOR_ADDRESS")
    engine_options = dict(max_model_len=max_model_len, max_batch=max_batch, max_queue=max_queue or None,
                          batch_invariant=batch_invariant, speculation=speculation, warm_up=warm_up,
                          prefix_cache_bytes=prefix_cache_bytes if spec is None else 0)  # one device only
    if _join_processes(spec, coordinator, num_processes, process_id):
        import jax

        if jax.process_index() != 0:  # no HTTP here: run process 0's schedule on this process's devices
            from gemmax.engine.loading import follow_engine

            follow_engine(model, dtype, quant, spec, **engine_options)
            return
    from gemmax.server.app import ServerSettings
    from gemmax.server.serve import serve as run_server

    if served_model_name is None:
        from gemmax.weights.builtin import NAME as BUILTIN_NAME

        served_model_name = model or BUILTIN_NAME
    settings = ServerSettings(served_model_name=served_model_name, model_root=model, api_key=api_key,
                              on_degenerate=on_degenerate, drain_timeout=drain_timeout, host=host,
                              allowed_hosts=tuple(allowed_host), max_choices=max_choices)

    def load():  # /health answers 503 until the engine's warm-up is done
        from gemmax.engine.loading import start_engine

        return start_engine(model, dtype, quant, mesh=spec, draft_model=draft_model, **engine_options)

    raise typer.Exit(run_server(load, settings, host=host, port=port, log_level=log_level, uds=uds))


cache_app = typer.Typer(help="Move JAX's persistent compilation cache between machines (tarball, path or fsspec URL).",
                        no_args_is_help=True)


def _check_cache_url(url: str) -> None:
    """s3:// without s3fs (or any URL whose filesystem is missing): one line saying what to install."""
    from gemmax.deploy.cache import check_url
    from gemmax.deploy.errors import DeployError

    try:
        check_url(url)
    except DeployError as exc:
        raise typer.BadParameter(str(exc)) from None


@contextlib.contextmanager
def _one_line_errors(*also: type[Exception]):
    """An expected failure (a missing file or bucket, a damaged tarball, a refused option) ends the
    command with `error: ...` on stderr and exit status 1, not a traceback."""
    try:
        yield
    except (OSError, ValueError, *also) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


@cache_app.command("export")
def cache_export(dest: str = typer.Argument(..., help="FILE.tar.gz or URL (s3://... with fsspec)"),
                 cache_dir: str = typer.Option(None, help="default: the user cache dir")) -> None:
    """Pack the compilation cache into DEST."""
    from gemmax.engine.compile_cache import export_cache

    _check_cache_url(dest)
    with _one_line_errors(RuntimeError):  # RuntimeError: a URL without fsspec
        typer.echo(f"wrote {export_cache(dest, cache_dir)} bytes to {dest}")


@cache_app.command("import")
def cache_import(src: str = typer.Argument(..., help="FILE.tar.gz or URL made by `gemmax cache export`"),
                 cache_dir: str = typer.Option(None, help="default: the user cache dir")) -> None:
    """Unpack SRC into the compilation cache."""
    from gemmax.engine.compile_cache import import_cache

    _check_cache_url(src)
    with _one_line_errors(RuntimeError):
        typer.echo(f"restored {import_cache(src, cache_dir)} files from {src}")


app.add_typer(cache_app, name="cache")

# `gemmax deploy`: the MCP deploy_* tools as commands (docs/deploy.md). The tool functions are the
# implementation; each command prints the tool's structured result as JSON.
deploy_app = typer.Typer(help="Deployments on a target: local, ssh (a host you have) or aws (EC2) (docs/deploy.md).",
                         no_args_is_help=True)


def _deploy_run(fn, *args, **kwargs) -> None:
    import asyncio

    from gemmax.mcp.deployments import DeploymentError
    from gemmax.mcp.remote import DeployError

    with _one_line_errors(DeployError, DeploymentError):
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(result)
    from pydantic import TypeAdapter

    typer.echo(TypeAdapter(type(result)).dump_json(result, indent=1).decode())


@deploy_app.command("launch")
def deploy_launch(
    name: str = typer.Argument(..., help="deployment name"),
    model: str = typer.Option("builtin", help="checkpoint path / hub id on the target; builtin: the built-in model"),
    target: str = typer.Option("aws", help="local, ssh or aws"),
    port: int = typer.Option(8000, min=1, max=65535),
    serve_arg: list[str] = typer.Option([], help="extra `gemmax serve` argument (repeatable)"),
    cache_url: str = typer.Option(None, help="compile cache tarball, e.g. s3://bucket/gemmax/g6-xla.tar.gz"),
    instance_type: str = typer.Option("g6.xlarge", help="aws: g6.xlarge (L4), g4dn.xlarge (T4), ..."),
    zone: list[str] = typer.Option([], help="aws: availability zone, tried in order (repeatable)"),
    image_id: str = typer.Option(None, help="aws: AMI with NVIDIA drivers and python3"),
    region: str = typer.Option(None, help="aws: default boto3's region"),
    on_demand: bool = typer.Option(False, "--on-demand", help="aws: on-demand instead of spot"),
    instance_profile: str = typer.Option(None, help="aws: IAM instance profile (S3 cache, SSM)"),
    security_group: list[str] = typer.Option([], help="aws: security group id (repeatable)"),
    key_name: str = typer.Option(None, help="aws: EC2 key pair"),
    hours: float = typer.Option(1.0, help="aws: instance-hours this launch counts against the cap"),
    endpoint: str = typer.Option(None, help="aws: reach the server at this URL (a tunnel, a load balancer) instead of PUBLIC_IP:PORT"),
    host: str = typer.Option(None, help="ssh: host"),
    ssh_port: int = typer.Option(22, help="ssh: port"),
    user: str = typer.Option(None, help="ssh: user"),
    key: str = typer.Option(None, help="ssh: private key file"),
    install: str = typer.Option(None, help="ssh: pip-install this spec on the host first, e.g. 'gemmax[cuda]'"),
    no_wait: bool = typer.Option(False, "--no-wait", help="return once it runs, without waiting for /health"),
    timeout: float = typer.Option(1200.0, help="seconds to wait for /health"),
) -> None:
    """Launch `gemmax serve` on a target and wait for /health 200; prints the record with its boot timeline."""
    from gemmax.mcp import remote

    aws = ssh = None
    if target == "aws":
        if not zone or not image_id:
            raise typer.BadParameter("target aws needs --zone (one or more) and --image-id")
        with _one_line_errors():  # pydantic's refusal (--hours 0, ...) as one line
            aws = remote.AwsOptions(instance_type=instance_type, zones=zone, image_id=image_id, region=region,
                                    market="on-demand" if on_demand else "spot", instance_profile=instance_profile,
                                    security_group_ids=security_group or None, key_name=key_name,
                                    planned_hours=hours, endpoint=endpoint)
    elif target == "ssh":
        if not host:
            raise typer.BadParameter("target ssh needs --host")
        ssh = remote.SshOptions(host=host, port=ssh_port, username=user, client_key=key, install=install)
    elif target != "local":
        raise typer.BadParameter("--target must be local, ssh or aws")
    _deploy_run(remote.deploy_launch, target, name, model, port=port, serve_args=serve_arg, cache_url=cache_url,
                aws=aws, ssh=ssh, wait=not no_wait, timeout_s=timeout)


@deploy_app.command("list")
def deploy_list() -> None:
    """Local and remote deployments, with their state."""
    from gemmax.mcp import remote

    _deploy_run(remote.deploy_list)


@deploy_app.command("status")
def deploy_status(name: str) -> None:
    """A remote deployment now: instance / process state, /health, boot timeline, cost so far."""
    from gemmax.mcp import remote

    _deploy_run(remote.deploy_status, name)


@deploy_app.command("logs")
def deploy_logs(name: str, tail: int = typer.Option(100, min=1)) -> None:
    """The last lines of a remote deployment's log."""
    from gemmax.mcp import remote

    _deploy_run(remote.deploy_logs, name, tail)


@deploy_app.command("tunnel")
def deploy_tunnel(name: str) -> None:
    """Hold an SSH tunnel to an ssh deployment's port (or print an aws one's address) until Ctrl-C; the
    first line printed is the URL to use from this machine."""
    import asyncio

    from gemmax.deploy.service import Deployer
    from gemmax.mcp.remote import DeployError

    async def hold() -> None:
        async with Deployer().endpoint(name) as (_, url):
            typer.echo(url)
            sys.stdout.flush()
            await asyncio.Event().wait()

    try:
        asyncio.run(hold())
    except DeployError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass


@deploy_app.command("bench")
def deploy_bench(name: str, input_len: list[int] = typer.Option([], help="repeatable"),
                 output_len: int = typer.Option(None), repeats: int = typer.Option(None),
                 concurrency: list[int] = typer.Option([], help="repeatable")) -> None:
    """The benchmark harness from this machine against a remote deployment."""
    from gemmax.mcp import remote

    _deploy_run(remote.deploy_benchmark, name, input_lens=input_len or None, output_len=output_len,
                repeats=repeats, concurrency=concurrency or None)


@deploy_app.command("push-cache")
def deploy_push_cache(name: str) -> None:
    """Push the deployment's compile cache to its cache URL."""
    from gemmax.mcp import remote

    _deploy_run(remote.deploy_cache_push, name)


@deploy_app.command("restore-cache")
def deploy_restore_cache(name: str) -> None:
    """Restore the compile cache from the cache URL on an ssh host."""
    from gemmax.mcp import remote

    _deploy_run(remote.deploy_cache_restore, name)


@deploy_app.command("terminate")
def deploy_terminate(name: str, no_push: bool = typer.Option(False, "--no-push", help="skip the cache push"),
                     timeout: float = typer.Option(600.0)) -> None:
    """Push the compile cache, then terminate (aws) or stop (ssh), and wait for it."""
    from gemmax.mcp import remote

    _deploy_run(remote.deploy_terminate, name, push_cache=not no_push, timeout_s=timeout)


@deploy_app.command("cleanup")
def deploy_cleanup(region: str = typer.Option(None), dry_run: bool = typer.Option(False, "--dry-run")) -> None:
    """Terminate instances tagged gemmax:deployment that the registry does not know as live."""
    from gemmax.mcp import remote

    _deploy_run(remote.deploy_cleanup, region, dry_run)


@deploy_app.command("cost")
def deploy_cost(name: str = typer.Argument(None)) -> None:
    """Instance-hours and cost of one deployment, or of all aws ones, with the caps."""
    from gemmax.mcp import remote

    _deploy_run(remote.deploy_cost, name)


app.add_typer(deploy_app, name="deploy")


@app.command("mcp")
def mcp_server(
    transport: str = typer.Option("stdio", help="stdio, or http (streamable HTTP at http://HOST:PORT/mcp)"),
    host: str = typer.Option("127.0.0.1", help="http: bind address"),
    port: int = typer.Option(8765, min=1, max=65535, help="http: port"),
    allow_urls: bool = typer.Option(False, "--allow-urls", help="let compile_cache_export/import use URL destinations (fsspec)"),
) -> None:
    """MCP server with tools to start, inspect and stop deployments, check the device, plan memory,
    run and compare sweeps and move the compile cache (docs/mcp.md)."""
    if transport not in ("stdio", "http"):
        raise typer.BadParameter("--transport must be 'stdio' or 'http'")
    from gemmax.mcp.server import run

    run(transport, host, port, allow_urls)


@app.command()
@with_quant_options
def profile(
    model: str = typer.Option(None, help="HF directory, .gguf file, hub id; default: the built-in model"),
    steps: int = typer.Option(20, min=1, help="decode steps timed and traced"),
    warmup: int = typer.Option(5, min=0, help="decode steps run first, untimed"),
    batch: int = typer.Option(1, min=1, help="decode rows, all active"),
    context: int = typer.Option(None, min=0, help="tokens already in the cache at every traced step "
                                "(default 128 for decode, 0 for --prefill)"),
    prefill: int = typer.Option(None, min=1, help="profile one prefill chunk of this many tokens (the last of its "
                                "prompt) instead of decode: FLOPs and the share of the compute peak, measured "
                                "by GEMMs in the same run (docs/profile.md)"),
    dtype: str = typer.Option("auto", help="weights: auto (device policy), float32, bfloat16, float16"),
    layout: str = typer.Option("auto", help="auto: the device's fast stored form; plain: every matrix in one piece "
                               "as loaded (on CPU, wide matrices then miss the fused matrix-vector dot)"),
    random_weights: bool = typer.Option(False, help="random weights of the model's config (only config.json is read)"),
    peak_bandwidth: float = typer.Option(None, help="GB/s for the roofline (default: spec of a known device, "
                                         "else measured here with all cores)"),
    out: str = typer.Option("gemmax-profile", help="directory for the trace (xprof / TensorBoard) and profile.json"),
    compare: tuple[str, str] = typer.Option(None, help="print two profile.json side by side, run nothing"),
    mesh: str = typer.Option(None, help="dp=D,tp=T[,ep=E]: the decode step on a mesh of D*T*E devices, with the collectives' share (docs/mesh.md); default one device"),
    speculative: str = typer.Option("off", help="ngram: also profile the verify step (k + 1 positions per row) and "
                                    "measure the accepted-length distribution of prompt lookup on a repeated text "
                                    "through the engine, with the predicted speed-up (docs/profile.md)"),
    spec_k: int = typer.Option(4, help="with --speculative: tokens proposed per verify step, 2, 4 or 8"),
    spec_tokens: int = typer.Option(64, min=2, help="with --speculative: tokens generated for the accepted lengths"),
    quant=None,
) -> None:
    """Trace decode steps with the JAX profiler: time by kind of op (from the compiled HLO), bytes per
    step and the share of the bandwidth roofline (docs/profile.md); with --speculative ngram the verify
    step too, and the accepted-length distribution; with --prefill T one prefill chunk instead, against
    the compute peak. Prints a table, then one JSON line."""
    from gemmax.profile import report as reports

    if compare:
        try:
            loaded = [reports.load(path) for path in compare]
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        try:
            typer.echo(reports.table(loaded, titles=list(compare)))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        except (KeyError, TypeError) as exc:  # a damaged report: its schema right, a field missing
            raise typer.BadParameter(f"a report lacks what the comparison reads ({type(exc).__name__}: {exc}): "
                                     "was it edited, or cut short?") from exc
        return
    _setup_logging()
    if layout not in ("auto", "plain"):
        raise typer.BadParameter("--layout must be 'auto' or 'plain'")
    from gemmax.profile.run import load_weights, profile_decode, profile_prefill

    spec = _mesh_spec(mesh)
    if prefill is not None and (spec is not None or speculative != "off" or batch != 1):
        raise typer.BadParameter("--prefill profiles one chunk of one request on one device: "
                                 "not with --mesh, --speculative or --batch")
    if spec is not None and layout != "auto":
        raise typer.BadParameter("--layout plain is a one-device form: it cannot be combined with --mesh")
    if speculative not in ("off", "ngram"):
        raise typer.BadParameter(f"--speculative for profile is off or ngram (prompt lookup), got {speculative!r}")
    speculation = _speculation(speculative, spec_k)
    if speculation is not None and spec is not None:
        raise typer.BadParameter("--speculative runs on one device: it cannot be combined with --mesh")
    try:
        params, config, device_policy, name = load_weights(model, dtype, random_weights, layout, quant, mesh=spec)
        name += "" if layout == "auto" else f" (layout {layout})"
        if prefill is not None:
            result = profile_prefill(params, config, device_policy, out_dir=out, tokens=prefill, context=context or 0,
                                     steps=steps, warmup=warmup, model=name)
        else:
            result = profile_decode(params, config, device_policy, out_dir=out, steps=steps, warmup=warmup, batch=batch,
                                    context=128 if context is None else context, peak_gbs=peak_bandwidth, mesh=spec,
                                    speculative=speculation, spec_tokens=spec_tokens, model=name)
    except ValueError as exc:  # includes a MeshError: a mesh this model or batch cannot split
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(reports.table([result]))
    typer.echo("\nslowest ops:\n" + reports.top_ops_table(result))
    if result["speculative"]:
        typer.echo("\nslowest ops of the verify step:\n" + reports.top_ops_table(result["speculative"]["verify"]))
    typer.echo(f"\ntrace: {out} (open with xprof or `tensorboard --logdir {out}`); report: {out}/profile.json")
    typer.echo(json.dumps(result))


# Benchmark harness and reference rigs (typer sub-apps; their heavy imports happen inside commands).
from gemmax.bench.cli import bench_app  # noqa: E402
from gemmax.rigs.cli import rig_app  # noqa: E402

app.add_typer(bench_app, name="bench")
app.add_typer(rig_app, name="rig")


if __name__ == "__main__":
    app()
