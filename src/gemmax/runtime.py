"""Resolve a `--model` argument into weights, tokenizer and device policy: the one loading path
shared by `generate`, `serve`, `profile` and the benchmarks."""

from __future__ import annotations

import dataclasses
import logging

from gemmax.checkpoint import Checkpoint, load_checkpoint
from gemmax.engine.fastpath import prepare_params
from gemmax.engine.policy import DevicePolicy, device_policy
from gemmax.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("gemmax")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    checkpoint: Checkpoint
    tokenizer: Tokenizer | None
    policy: DevicePolicy
    name: str


def load_model(model: str | None, dtype: str | None = None) -> LoadedModel:
    """`model`: a local HF directory, a `.gguf` file, a hub id, or None for the built-in default."""
    policy = device_policy(dtype)
    log.info(policy.log_line())
    if policy.warning:
        log.warning("WARNING: %s", policy.warning)
    if model is None:
        from gemmax.builtin import default_model_path

        model = str(default_model_path())
    checkpoint = load_checkpoint(model, weight_dtype=policy.weight_dtype)
    # The stored form `linear` reads fastest on this device (K-split column blocks on CPU).
    checkpoint = dataclasses.replace(
        checkpoint, params=prepare_params(checkpoint.params, checkpoint.config, policy))
    if checkpoint.tokenizer is not None:
        tokenizer = checkpoint.tokenizer
    else:
        tokenizer = load_tokenizer(checkpoint.directory) if checkpoint.directory else None
    return LoadedModel(checkpoint=checkpoint, tokenizer=tokenizer, policy=policy, name=str(model))
