"""The `gemmax` command line. Each command is a thin shell over a library function; heavy imports
(jax, torch) happen inside the commands so `gemmax --help` stays instant."""

from __future__ import annotations

import json
import logging
import sys

import typer

app = typer.Typer(help="gemmax: Gemma 4 / Gemma 3 inference in pure JAX.", no_args_is_help=True,
                  pretty_exceptions_enable=False)


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise typer.BadParameter(f"--prompt-ids must be comma-separated integers, got {text!r}") from exc


@app.command()
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
) -> None:
    """Generate from one prompt (greedy when temperature is 0)."""
    _setup_logging()
    if (prompt is None) == (prompt_ids is None):
        raise typer.BadParameter("give exactly one of --prompt or --prompt-ids")
    from gemmax.engine.api import SamplingParams
    from gemmax.generate import generate as run
    from gemmax.runtime import load_model

    loaded = load_model(model, dtype)
    if prompt is not None:
        if loaded.tokenizer is None:
            raise typer.BadParameter("this checkpoint has no tokenizer: use --prompt-ids")
        ids = loaded.tokenizer.encode(prompt)
    else:
        ids = _parse_ids(prompt_ids)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    out = run(loaded.checkpoint.params, loaded.checkpoint.config, ids, max_tokens, sampling,
              loaded.policy.precision())
    text = loaded.tokenizer.decode(out) if loaded.tokenizer is not None else None
    if json_output:
        payload = {"token_ids": out, **({"text": text} if text is not None else {})}
        typer.echo(json.dumps(payload))
    else:
        typer.echo(text if text is not None else ",".join(map(str, out)))


@app.command()
def policy(dtype: str = typer.Option("auto"), json_output: bool = typer.Option(False, "--json")) -> None:
    """Print the device policy (platform, device, compute capability, dtypes)."""
    from gemmax.engine.policy import device_policy

    p = device_policy(dtype)
    typer.echo(json.dumps(p.as_dict()) if json_output else p.log_line())
    if p.warning:
        typer.echo(f"WARNING: {p.warning}", err=True)


if __name__ == "__main__":
    app()
