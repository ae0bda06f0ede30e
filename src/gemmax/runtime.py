"""Resolve a `--model` argument into weights, tokenizer and device policy: the one loading path
shared by `generate`, `serve`, `profile` and the benchmarks."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from gemmax.checkpoint import Checkpoint, load_checkpoint
from gemmax.config import ModelConfig
from gemmax.engine.fastpath import prepare_params
from gemmax.engine.kernel_probe import live_probe
from gemmax.engine.memory import load_config
from gemmax.engine.policy import DevicePolicy, device_policy, log_policy
from gemmax.params import count_bytes
from gemmax.quant import QuantOptions
from gemmax.quant import resolve as resolve_quant
from gemmax.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("gemmax")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    checkpoint: Checkpoint
    tokenizer: Tokenizer | None
    policy: DevicePolicy
    name: str


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


def quantized_source(model: str) -> bool:
    """Whether a checkpoint stores its matrices at 8 bits or fewer: a quantised GGUF file, or the
    built-in model's conversion of one (`QuantOptions.for_source` decides quant="auto" from it)."""
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        from gguf import GGUFReader

        from gemmax.gguf_loader import stores_quantized

        return stores_quantized(GGUFReader(path))
    from gemmax.builtin import converted_from_quantized

    return path.is_dir() and converted_from_quantized(path)


def quant_for(model: str, dtype: str | None, quant: QuantOptions) -> QuantOptions:
    """`quant` with "auto" resolved for this checkpoint and --dtype (the file is opened only for auto)."""
    return quant.for_source(quant.quant == "auto" and quantized_source(model), dtype_given=dtype not in (None, "auto"))


def load_model(model: str | None, dtype: str | None = None, quant: QuantOptions | None = None) -> LoadedModel:
    """`model`: a local HF directory, a `.gguf` file, a hub id, or None for the built-in default.
    `quant`: load-time quantisation (gemmax.quant): tensors are quantised one at a time as they load,
    and the W4A16 Pallas tiles are checked against the device before any weight is read; quant="auto"
    is resolved here from the checkpoint (`QuantOptions.for_source`)."""
    quant = quant or QuantOptions()
    if model is None:
        from gemmax.builtin import default_model_path

        model = str(default_model_path())
    quant = quant_for(model, dtype, quant)
    quantizes = quant.changes_weights
    config = load_config(model) if quantizes else None  # shapes only: no weight is read yet
    policy, plan = resolve_policy(dtype, quant, config)
    quantizer = plan.quantizer(config) if quantizes else None
    checkpoint = load_checkpoint(model, weight_dtype=policy.weight_dtype,
                                 transform=None if quantizer is None else quantizer.transform)
    if quantizer is not None:  # adds the int8 LM head; bytes recounted exactly from what is kept
        params = quantizer.finish(checkpoint.params)
        checkpoint = dataclasses.replace(checkpoint, params=params, weight_bytes=count_bytes(params))
    # The stored form `linear` reads fastest on this device (K-split column blocks on CPU).
    checkpoint = dataclasses.replace(
        checkpoint, params=prepare_params(checkpoint.params, checkpoint.config, policy))
    if checkpoint.tokenizer is not None:
        tokenizer = checkpoint.tokenizer
    else:
        tokenizer = load_tokenizer(checkpoint.directory) if checkpoint.directory else None
    return LoadedModel(checkpoint=checkpoint, tokenizer=tokenizer, policy=policy, name=str(model))
