"""Resolve a `--model` argument into weights, tokenizer and device policy: the one loading path
shared by `generate`, `serve`, `profile` and the benchmarks."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax

from gemmax.engine import compile_cache
from gemmax.engine.engine import BatchEngine
from gemmax.engine.fastpath import prepare_params
from gemmax.engine.kernel_probe import live_probe
from gemmax.engine.mesh import MeshSpec
from gemmax.engine.policy import DevicePolicy, device_policy, log_policy
from gemmax.engine.schedule import Leader, follow
from gemmax.model.config import ModelConfig
from gemmax.model.params import count_bytes
from gemmax.quant.options import QuantOptions
from gemmax.quant.plan import resolve as resolve_quant
from gemmax.weights.assistant import is_assistant, load_assistant
from gemmax.weights.checkpoint import Checkpoint
from gemmax.weights.load import load_checkpoint, open_source
from gemmax.weights.source import ModelSource
from gemmax.weights.tokenizer import Tokenizer

log = logging.getLogger("gemmax")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    checkpoint: Checkpoint
    policy: DevicePolicy
    name: str

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint source's tokenizer, loaded on first use (`ModelSource.tokenizer`)."""
        source = self.checkpoint.source
        return None if source is None else source.tokenizer


def resolve_policy(dtype: str | None, quant: QuantOptions, config: ModelConfig | None):
    """The device policy with the quantisation plan folded in (kernels picked for this device, the
    W4A16 tiles checked from the config alone), logged as the first line. Returns (policy, plan)."""
    policy = device_policy(dtype)
    plan = resolve_quant(quant, policy.platform, policy.compute_capability, config,
                         probe=live_probe(policy.platform))
    policy = dataclasses.replace(policy, quant=plan.options,
                                 kv_cache="int8" if quant.kv_cache == "int8" else policy.kv_cache)
    log_policy(policy)
    if plan.note:
        log.info("%s", plan.note)
    return policy, plan


def quant_for(source: ModelSource, dtype: str | None, quant: QuantOptions) -> QuantOptions:
    """`quant` with "auto" resolved for this checkpoint's stored precision and --dtype."""
    return quant.for_source(source.stored_quantized, dtype_given=dtype not in (None, "auto"))


def load_model(model: str | Path | ModelSource | None, dtype: str | None = None,
               quant: QuantOptions | None = None, mesh: MeshSpec | None = None) -> LoadedModel:
    """`model`: a local HF directory, a `.gguf` file, a hub id, None for the built-in default, or a
    source already opened. `quant`: load-time quantisation (gemmax.quant): tensors are quantised one at
    a time as they load, and the W4A16 Pallas tiles are checked against the device before any weight
    is read; quant="auto" is resolved here from the checkpoint (`QuantOptions.for_source`).
    `mesh`: the weights stay plain arrays (the engine places them on the mesh; the CPU column split
    below is a one-device form)."""
    source = model if isinstance(model, ModelSource) else open_source(model)
    quant = quant_for(source, dtype, quant or QuantOptions())
    quantizes = quant.changes_weights
    policy, plan = resolve_policy(dtype, quant, source.config if quantizes else None)
    quantizer = plan.quantizer(source.config) if quantizes else None
    checkpoint = load_checkpoint(source, weight_dtype=policy.weight_dtype,
                                 transform=None if quantizer is None else quantizer.transform)
    if quantizer is not None:  # adds the int8 LM head; bytes recounted exactly from what is kept
        params = quantizer.finish(checkpoint.params)
        checkpoint = dataclasses.replace(checkpoint, params=params, weight_bytes=count_bytes(params))
    # The stored form `linear` reads fastest on this device (K-split column blocks on CPU).
    if mesh is None:
        checkpoint = dataclasses.replace(
            checkpoint, params=prepare_params(checkpoint.params, checkpoint.config, policy))
    return LoadedModel(checkpoint=checkpoint, policy=policy, name=source.name)


def start_engine(model: str | None, dtype: str | None, quant: QuantOptions | None, mesh: MeshSpec | None = None,
                 draft_model: str | None = None, **engine_options):
    """What `gemmax serve` runs before it can answer: resolve and load the model (and the draft
    model, through the same path, or a Gemma 4 MTP assistant: a `--draft-model` whose config is
    `gemma4_assistant`, loaded unquantised in the target's weight dtype), build the batching engine
    and start its warm-up (in the engine's thread; it reports ready when done), then read the tokenizer
    of an HF directory while the warm-up runs: its parse holds the GIL for 1.1-1.4 s (the built-in
    model's), the warm-up's program runs do not, so it saves a start up to that much (docs/measurements.md,
    "The tokenizer beside the warm-up"). With a draft model the engine reads both tokenizers before it
    starts (`check_draft`), so nothing overlaps. A tokenizer that fails to load shuts the engine down (a
    warm-up in progress is not interrupted: it runs on in its daemon thread) and `serve` then exits, now
    after the weights have loaded. Returns (engine, tokenizer).

    JAX's persistent compilation cache is on before the weights load, in the directory the warm-up
    uses: loading compiles small programs of its own (dtype conversions, int8 quantisation: 31 for the
    built-in model, 1.3 s of XLA), which a warm start then reads back (README, "Start-up"). The
    warm-up's `compile_cache.track` scrubs corrupted entries afterwards, so a corrupted entry of such
    a program costs the start that finds it one compile (JAX warns), and the next writes it anew.
    Not in `follow_engine`: a follower replays the warm-up's device calls but never turns the cache
    on, and JAX writes entries from process 0 only."""
    compile_cache.enable(engine_options.get("compile_cache_dir"))
    loaded = load_model(model, dtype, quant, mesh=mesh)
    draft = assistant = None
    if draft_model is not None:
        method = getattr(engine_options.get("speculation"), "method", None)
        if is_assistant(draft_model):
            if method == "draft":
                raise ValueError(f"{draft_model} is a Gemma 4 MTP assistant, not a draft model: give --speculative mtp")
            assistant = load_assistant(draft_model, loaded.policy.weight_dtype)
        elif method == "mtp":
            raise ValueError(f"--speculative mtp needs a Gemma 4 MTP assistant (config model_type gemma4_assistant) "
                             f"as --draft-model, {draft_model} is not one")
        else:
            draft = load_model(draft_model, dtype, quant, mesh=mesh)
    schedule = Leader() if jax.process_count() > 1 else None  # process 0 of several: the others follow
    engine = BatchEngine(loaded, mesh=mesh, schedule=schedule, draft=draft, assistant=assistant, **engine_options)
    engine.start()
    try:
        return engine, loaded.tokenizer
    except BaseException:
        engine.shutdown(0)
        raise


def follow_engine(model: str | None, dtype: str | None, quant: QuantOptions | None, mesh: MeshSpec,
                  **engine_options) -> int:
    """What `gemmax serve` runs on every process but 0 (`jax.distributed`): load the same model,
    build the same engine, and replay process 0's device calls (gemmax.engine.schedule) until it
    stops. Returns the number of calls replayed."""
    loaded = load_model(model, dtype, quant, mesh=mesh)
    return follow(BatchEngine(loaded, mesh=mesh, **engine_options))
