"""`gemmax rig list | transformers | vllm`: other runtimes behind the same OpenAI-compatible API."""

from __future__ import annotations

import json
import shlex

import typer

rig_app = typer.Typer(help="Reference runtimes behind the same OpenAI-compatible API.", no_args_is_help=True)


@rig_app.command("list")
def list_rigs(json_output: bool = typer.Option(False, "--json")) -> None:
    """Known rigs and whether each can run here."""
    from gemmax.rigs.registry import RIGS

    rows = [{"name": r.name, "available": r.available(), "description": r.description} for r in RIGS.values()]
    if json_output:
        typer.echo(json.dumps(rows))
        return
    for row in rows:
        typer.echo(f"{row['name']:<13} {'yes' if row['available'] else 'no ':<4} {row['description']}")


@rig_app.command()
def transformers(
    model: str = typer.Option(..., help="HF checkpoint directory (or hub id when online)"),
    port: int = typer.Option(8001),
    host: str = typer.Option("127.0.0.1"),
    dtype: str = typer.Option("bfloat16", help="bfloat16 | float32 | float16 | auto (the checkpoint's if 16-bit, else bfloat16)"),
    max_model_len: int = typer.Option(None, help="default: the config's max_position_embeddings"),
    threads: int = typer.Option(None, help="torch intra-op threads (default: torch's choice)"),
    served_model_name: str = typer.Option(None, help="name in /v1/models (default: --model)"),
) -> None:
    """Serve a model with HF transformers (PyTorch), streaming tokens as they are sampled."""
    from gemmax.rigs.transformers_server import DTYPES, serve

    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    serve(model, host, port, dtype, max_model_len, threads, served_model_name)


@rig_app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def vllm(
    ctx: typer.Context,
    model: str = typer.Option(..., help="HF directory or hub id"),
    port: int = typer.Option(8002),
    host: str = typer.Option("127.0.0.1"),
    dtype: str = typer.Option(None, help="default: the device policy's (float16 below SM 8.0, else bfloat16)"),
    max_model_len: int = typer.Option(None),
    max_num_seqs: int = typer.Option(None, help="batch slots (= gemmax --max-batch)"),
    served_model_name: str = typer.Option(None),
    seed: int = typer.Option(0),
    api_key: str = typer.Option(None),
    python: str = typer.Option(None, help="an interpreter with vllm installed (default: the rig's own environment, "
                                          "created on first use under the user cache)"),
    setup: bool = typer.Option(False, "--setup", help="only create (or check) the vLLM environment, then exit"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the command instead of running it"),
) -> None:
    """Run vLLM's OpenAI server for the same model and settings (extra arguments pass through to vLLM)."""
    from gemmax.rigs.vllm import (
        VllmSettings,
        cpu_kv_cache_bytes,
        ensure_env,
        exec_vllm,
        vllm_command,
        vllm_dtype,
        vllm_python,
    )

    try:
        dtype = dtype or vllm_dtype()
        settings = VllmSettings(model=model, port=port, host=host, dtype=dtype, max_model_len=max_model_len,
                                max_num_seqs=max_num_seqs, served_model_name=served_model_name, seed=seed,
                                api_key=api_key,
                                kv_cache_memory_bytes=cpu_kv_cache_bytes(model, max_model_len, max_num_seqs, dtype),
                                extra_args=tuple(ctx.args))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if dry_run:
        typer.echo(shlex.join(vllm_command(settings, python=vllm_python(python) or "python")))
        return
    try:
        interpreter = ensure_env(python)
    except RuntimeError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    if setup:
        typer.echo(interpreter)
        return
    exec_vllm(vllm_command(settings, python=interpreter))
