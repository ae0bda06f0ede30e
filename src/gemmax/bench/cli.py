"""`gemmax bench ...` (a sweep) and `gemmax bench compare A.json B.json ...`."""

from __future__ import annotations

from pathlib import Path

import typer

bench_app = typer.Typer(help="Benchmark any OpenAI-compatible endpoint from the wire.",
                        invoke_without_command=True, no_args_is_help=False)


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"{name} must be comma-separated integers, got {text!r}") from exc


def _floats(text: str, name: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"{name} must be comma-separated numbers, got {text!r}") from exc


@bench_app.callback()
def bench(
    ctx: typer.Context,
    base_url: str = typer.Option(None, help="server root, e.g. http://127.0.0.1:8000 (with --uds: http://localhost)"),
    uds: Path = typer.Option(None, help="connect through this Unix socket (a server started with `gemmax serve --uds`); "
                             "--base-url then only names the Host sent"),
    model: str = typer.Option(None, help="model name to send; default: first entry of /v1/models"),
    input_lens: str = typer.Option("41,521,2057,3593", help="prompt lengths in tokens (exact)"),
    output_len: int = typer.Option(64, min=1, help="output tokens (forced with ignore_eos/min_tokens)"),
    repeats: int = typer.Option(3, min=1, help="measured rounds per cell (median with min/max)"),
    concurrency: str = typer.Option("1", help="concurrency levels, e.g. 1,2,4,8"),
    request_rate: str = typer.Option(None, help="request-rate mode: rates in req/s (Poisson arrivals)"),
    num_prompts: int = typer.Option(8, min=1, help="requests per round in request-rate mode"),
    decode_source: str = typer.Option("auto", help="auto | stream | gauge | both"),
    prompt_mode: str = typer.Option("auto", help="auto | server (/tokenize) | local (--tokenizer) | ids"),
    tokenizer: Path = typer.Option(None, help="local tokenizer directory when the server has no /tokenize"),
    vocab_size: int = typer.Option(None, help="vocabulary size for token-id prompts"),
    label: str = typer.Option(None, help="rig label in tables and compare (default: model@host:port, or model@socket)"),
    api_key: str = typer.Option(None, envvar="OPENAI_API_KEY", help="bearer token"),
    price_per_hour: float = typer.Option(None, help="machine price in $/hour: adds $ per million output tokens"),
    seed: int = typer.Option(0),
    sampling: str = typer.Option("greedy", help="greedy, or name=value pairs of temperature, top_p, top_k, "
                                 "min_p sent with every request, e.g. temperature=0.7,top_p=0.9"),
    out: Path = typer.Option(None, help="write the full result JSON here"),
    plot: Path = typer.Option(None, help="write a PNG of decode tok/s and TTFT against input length"),
) -> None:
    """Run a sweep against --base-url (subcommand `compare` compares result files)."""
    if ctx.invoked_subcommand is not None:
        return
    if base_url is None and uds is not None:
        base_url = "http://localhost"
    if base_url is None:
        raise typer.BadParameter("--base-url is required (or use `gemmax bench compare A.json B.json`)")
    import httpx
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from gemmax.bench.report import print_run, summary_line, write_json
    from gemmax.bench.sweep import SweepConfig, parse_sampling, run_sweep

    try:
        config = SweepConfig(
            base_url=base_url, uds=uds, model=model, input_lens=_ints(input_lens, "--input-lens"), output_len=output_len,
            repeats=repeats, concurrency=_ints(concurrency, "--concurrency"),
            request_rates=_floats(request_rate, "--request-rate") if request_rate else (),
            num_prompts=num_prompts, decode_source=decode_source, prompt_mode=prompt_mode,
            tokenizer=tokenizer, vocab_size=vocab_size, label=label, api_key=api_key,
            price_per_hour=price_per_hour, seed=seed, sampling=parse_sampling(sampling))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("", total=config.planned_requests())

        def on_request(record) -> None:
            status = "ok" if record.success else "FAILED"
            progress.update(task, advance=1, description=f"input {record.input_len}: {status}")

        try:
            result = run_sweep(config, on_request)  # a sweep that stopped halfway keeps its measured cells
        except (RuntimeError, ValueError, httpx.HTTPError) as exc:
            console.print(f"[red]bench failed:[/red] {exc}")
            raise typer.Exit(1) from exc
    print_run(result)
    if out is not None:
        write_json(result, out)
        console.print(f"wrote {out}")
    if plot is not None and result["cells"]:
        from gemmax.bench.plots import plot_runs

        console.print(f"wrote {plot_runs([result], plot)}")
    typer.echo(summary_line(result))
    if result["aborted"]:
        console.print(f"[red]bench aborted:[/red] {result['aborted']}")
        raise typer.Exit(1)


@bench_app.command()
def compare(
    files: list[Path] = typer.Argument(..., exists=True, dir_okay=False, help="result JSON files; first = baseline"),
    markdown: bool = typer.Option(False, "--markdown", help="print a Markdown table instead of a rich one"),
    plot: Path = typer.Option(None, help="write a PNG with one line per rig"),
) -> None:
    """Side-by-side table of several runs, with ratios against the first."""
    from gemmax.bench.compare import compare_runs, to_markdown, to_rich
    from gemmax.bench.report import load_run, wide_console

    try:
        runs = [load_run(f) for f in files]
        comparison = compare_runs(runs)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if markdown:
        typer.echo(to_markdown(comparison), nl=False)
    else:
        console = wide_console()
        console.print(to_rich(comparison))
        for note in comparison.notes:
            console.print(f"- {note}")
    if plot is not None:
        from gemmax.bench.plots import plot_runs

        typer.echo(f"wrote {plot_runs(runs, plot)}", err=True)
