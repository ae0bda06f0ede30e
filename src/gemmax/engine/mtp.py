"""Speculative decoding with Gemma 4's MTP assistant (gemmax.model.assistant, docs/speculative.md):
the assistant drafts k tokens per verify step from the target's own state, with no cache of its own.

What it reads, per drafting row of a decode group, all already on the device:
- `DeviceState.tokens` (t_n, the next input, at position n = `DeviceState.positions`) and
  `DeviceState.hidden`: the target's final-normed hidden state at position n - 1, the one that drew
  t_n. The engine keeps `hidden` only when an assistant is loaded (`init_device_state(hidden=True)`);
  every step that draws a token (prefill's last chunk, decode, verify: the input after the last kept
  proposal) writes it, so a row that decoded plainly for a while needs no catch-up;
- the target's KV cache of its last KV-owning full and sliding layers (`target_kv_donors`), at
  positions [0, n): full layers see all of them, sliding layers the last W + 1. Rings carry
  k_max + 1 slots of slack when an assistant drafts (not k_max): the one more position W + 1 back
  must survive the rejected positions a verify step wrote.

Each of the k steps is `assistant_step` at the fixed position n, fed the target's scaled embedding
of the last drafted token and the assistant's own projected hidden state (transformers'
`SinglePositionMultiTokenCandidateGenerator`). Proposals are drawn as a draft model's are
(`draft.draw_proposal`: argmax for greedy rows, a seeded draw from q for sampled ones), and the
verify step takes the draft model's rejection rule with q, so greedy output stays the target's and
sampled output keeps the target's distribution.

transformers slices `shared_kv_states` to the sequence's length after a verify step; when some
proposals were rejected, that keeps the K/V of the first rejected proposal at position n, which its
drafter then sees. gemmax reads exactly the positions the target has kept, so its proposals equal
transformers' after the prefill and after verify steps that kept every proposal (tested), and may
differ after partial rejections; either way the output is the target's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gemmax.engine.draft import draw_proposal, light_rows
from gemmax.model.assistant import (
    AssistantConfig,
    assistant_step,
    check_assistant,
    target_kv_donors,
)
from gemmax.model.config import ModelConfig
from gemmax.model.forward import Keys, Precision, embed
from gemmax.model.kv_cache import slot_positions


class AssistantMismatch(ValueError):
    """The MTP assistant cannot draft for this target (hidden size, vocabulary, K/V shapes, family)."""


def check_mtp(target, assistant) -> None:
    """Refuse (AssistantMismatch, with the values) an assistant that was not built for this target.
    `target`: gemmax.engine.loading.LoadedModel; `assistant`: gemmax.weights.assistant.AssistantCheckpoint."""
    problems = check_assistant(target.checkpoint.config, assistant.config)
    if problems:
        raise AssistantMismatch(f"MTP assistant {assistant.name} cannot draft for {target.name}: " + "; ".join(problems))


def shared_kv(device, rows, config: ModelConfig, dtype, kv_len: int | None) -> dict[str, Keys]:
    """The target's K/V the assistant reads, for the rows `rows` [g] of the device state: each donor
    layer's first kv_len slots (`LayerCache.visible`), with the positions they hold."""
    positions = device.positions[rows]
    out = {}
    for layer_type, index in target_kv_donors(config).items():
        layer = jax.tree.map(lambda a: a[rows], device.cache.layers[index].visible(kv_len))
        key_pos, key_valid = slot_positions(positions, layer.slots)
        out[layer_type] = Keys(k=layer.read("k", dtype), v=layer.read("v", dtype), key_pos=key_pos,
                               key_valid=key_valid)
    return out


@functools.partial(jax.jit, static_argnames=("k", "config", "assistant_config", "precision", "kv_len"))
def mtp_propose_rows(target_params, params, device, rows, drafting, table, *, k: int, config: ModelConfig,
                     assistant_config: AssistantConfig, precision: Precision, kv_len: int | None = None):
    """k proposals for the drafting rows (`drafting` [g] bool) of the group `rows` [g] (module
    docstring); the other rows' proposals are `table` [g, k]. Reads the device state, writes nothing.
    Returns (proposals [g, k], q [g, k, V]: the distribution each proposal was drawn from)."""
    state = light_rows(device.sampling, rows)
    position = device.positions[rows]
    shared = shared_kv(device, rows, config, precision.activation, kv_len)

    def step(carry, j):
        token, hidden = carry
        token_embeds = embed(target_params, token[:, None], config, precision.activation)[:, 0]
        logits, hidden = assistant_step(params, assistant_config, token_embeds, hidden, position, shared)
        x, q = draw_proposal(logits, j, state)
        return (x, hidden.astype(precision.activation)), (x, q)

    start = (device.tokens[rows], device.hidden[rows].astype(precision.activation))
    _, (xs, qs) = lax.scan(step, start, jnp.arange(k))
    proposals = jnp.where(drafting[:, None], xs.T, table)
    return proposals, jnp.moveaxis(qs, 0, 1)


class MtpProposer:
    """The MTP assistant of one engine: its params and config; proposes on the device from the
    target's state (no cache, no host-side lengths). `assistant`: AssistantCheckpoint."""

    def __init__(self, assistant, target_config: ModelConfig, precision: Precision):
        self.assistant = assistant
        self.config: AssistantConfig = assistant.config
        self.params = assistant.params
        self.target_config = target_config
        self.precision = precision

    def describe(self) -> dict:
        return {"model": self.assistant.name, "kind": "mtp", "layers": len(self.config.text.layers),
                "weight_bytes": self.assistant.weight_bytes, "kv_cache_bytes": 0,
                "ordered_embeddings": self.config.use_ordered_embeddings}

    def propose(self, target_params, device, rows, drafting: dict, table: np.ndarray, k: int, kv_len: int):
        """Proposals and q ([g, k], [g, k, V], on the device) for the rows j in `drafting` of the group
        `rows`; the others' proposals are `table`'s."""
        active = np.isin(np.arange(len(rows)), list(drafting))
        return mtp_propose_rows(target_params, self.params, device, jnp.asarray(rows, jnp.int32), jnp.asarray(active),
                                jnp.asarray(table, jnp.int32), k=k, config=self.target_config,
                                assistant_config=self.config, precision=self.precision, kv_len=kv_len)
