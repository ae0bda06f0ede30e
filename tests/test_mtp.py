"""Gemma 4's MTP assistant (gemmax.model.assistant) against transformers' `Gemma4AssistantForCausalLM`
on tiny random checkpoints the tests write (save_pretrained, loaded by gemmax's loader): the same
inputs give the same logits and projected hidden state, with and without the ordered (centroid
masked) embeddings; the drafted candidates of gemmax's MTP proposer equal transformers'
`SinglePositionMultiTokenCandidateGenerator` (what `generate(assistant_model=...)` drives) after the
prefill and after a verify round that kept every proposal; and through the batching engine, greedy
output with the MTP proposer equals plain decoding, a seeded sampled request repeats itself, and a
mismatched assistant is refused at start-up.

transformers 5.23 cannot build a Gemma4AssistantForCausalLM as released: its text config's
`kv_sharing_modes` raises when every layer is shared (no layer of any type produces a cache),
which the assistant requires. `_hf_assistant_modes` makes that property answer "reuse" for every
layer in that case, which is what the assistant's modelling code expects (each layer reads
`shared_kv_states`); nothing else of the reference is touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gemmax.model.assistant import SharedKV, assistant_step
from gemmax.weights.assistant import load_assistant
from hf_reference import FULL, ROPE4, SLIDING
from tiny_checkpoint import VOCAB_SIZE, write_tiny_checkpoint

TARGET_HIDDEN = 64  # tiny_checkpoint's g4_shared
ASSISTANT_TEXT = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, layer_types=[SLIDING, SLIDING, FULL],
    num_kv_shared_layers=3, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, sliding_window=4,
    final_logit_softcapping=30.0, rope_parameters=ROPE4,
)


@contextlib.contextmanager
def _hf_assistant_modes():
    from transformers import Gemma4TextConfig

    original = Gemma4TextConfig.kv_sharing_modes

    def modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return original.fget(self)

    Gemma4TextConfig.kv_sharing_modes = property(modes)
    try:
        yield
    finally:
        Gemma4TextConfig.kv_sharing_modes = original


def build_assistant(directory, ordered: bool, seed: int = 1, backbone: int = TARGET_HIDDEN, **text):
    """A random Gemma4AssistantForCausalLM saved to `directory`; returns the torch model."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    from hf_reference import randomize_norms

    torch.manual_seed(seed)
    with _hf_assistant_modes():
        text_config = Gemma4TextConfig(**{**ASSISTANT_TEXT, **text}, attn_implementation="eager")
        config = Gemma4AssistantConfig(text_config=text_config.to_dict(), backbone_hidden_size=backbone,
                                       use_ordered_embeddings=ordered, num_centroids=16,
                                       centroid_intermediate_top_k=4, attn_implementation="eager")
        model = Gemma4AssistantForCausalLM(config).eval()
        randomize_norms(model, seed)
        with torch.no_grad():
            # wider random weights than the init's 0.02: the drafts differ step to step
            for name, tensor in model.named_parameters():
                if name.endswith("proj.weight") or name.endswith("embed_tokens.weight"):
                    tensor.normal_(0.0, tensor.shape[-1] ** -0.5)
            if ordered:
                model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)))
        model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def mtp_files(tmp_path_factory):
    """The tiny target (tokenizer and all) and two assistants for it: plain head, ordered embeddings."""
    root = tmp_path_factory.mktemp("mtp")
    target = write_tiny_checkpoint(root / "target")
    plain = build_assistant(root / "assistant", ordered=False)
    ordered = build_assistant(root / "assistant_ordered", ordered=True, seed=2)
    return {"target": target, "assistant": (root / "assistant", plain),
            "assistant_ordered": (root / "assistant_ordered", ordered)}


def _shared_from_hf(shared_kv_states, length: int) -> dict[str, SharedKV]:
    """HF's {type: (k, v) [B, nkv, S, hd]} (S = length positions from 0) -> gemmax's SharedKV."""
    out = {}
    for layer_type, (k, v) in shared_kv_states.items():
        k, v = (jnp.asarray(t[:, :, :length].transpose(1, 2).numpy()) for t in (k, v))
        pos = jnp.broadcast_to(jnp.arange(k.shape[1])[None], k.shape[:2])
        out[layer_type] = SharedKV(k=k, v=v, key_pos=pos, key_valid=jnp.ones(k.shape[:2], bool))
    return out


@pytest.mark.parametrize("ordered", [False, True], ids=["plain_head", "ordered_embeddings"])
def test_assistant_step_matches_transformers(mtp_files, ordered):
    """Random embeddings, hidden state and shared K/V longer than the window (9 cached positions,
    window 4: sliding layers see the last 5): logits and projected hidden within float32 tolerance."""
    directory, hf = mtp_files["assistant_ordered" if ordered else "assistant"]
    checkpoint = load_assistant(directory, jnp.float32)
    gen = torch.Generator().manual_seed(3)
    S, B = 9, 1
    inputs = torch.randn(B, 1, 2 * TARGET_HIDDEN, generator=gen)
    shared = {FULL: tuple(torch.randn(B, 2, S, 32, generator=gen) for _ in range(2)),
              SLIDING: tuple(torch.randn(B, 2, S, 16, generator=gen) for _ in range(2))}
    with torch.no_grad(), _hf_assistant_modes():
        ref = hf(inputs_embeds=inputs, position_ids=torch.tensor([[S]]), attention_mask=torch.ones(B, S + 1, dtype=torch.long),
                 shared_kv_states=shared)
    x = jnp.asarray(inputs[:, 0].numpy())
    logits, hidden = assistant_step(checkpoint.params, checkpoint.config, x[:, :TARGET_HIDDEN], x[:, TARGET_HIDDEN:],
                                    jnp.full((B,), S, jnp.int32), _shared_from_hf(shared, S))
    ref_logits, ref_hidden = ref.logits[:, 0].numpy(), ref.last_hidden_state[:, 0].numpy()
    np.testing.assert_allclose(np.asarray(hidden), ref_hidden, atol=2e-5, rtol=2e-5)
    if ordered:  # the masked tokens' fill value is the batch's smallest real logit - 1 in both
        real = ref_logits > ref_logits.min()
        assert 0 < real.sum() <= 4 * VOCAB_SIZE // 16
        np.testing.assert_array_equal(np.asarray(logits) > np.asarray(logits).min(), real)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=2e-5, rtol=2e-5)
    # the window matters here: sliding layers that saw every cached position would give other logits
    text = checkpoint.config.text
    unwindowed = dataclasses.replace(checkpoint.config, text=dataclasses.replace(
        text, layers=tuple(dataclasses.replace(spec, sliding_window=None) for spec in text.layers)))
    other, _ = assistant_step(checkpoint.params, unwindowed, x[:, :TARGET_HIDDEN], x[:, TARGET_HIDDEN:],
                              jnp.full((B,), S, jnp.int32), _shared_from_hf(shared, S))
    assert np.max(np.abs(np.asarray(other) - ref_logits)) > 1e-3


def test_assistant_config_is_refused_when_not_all_layers_share(mtp_files, tmp_path):
    from gemmax.model.assistant import AssistantConfig
    from gemmax.model.config import ConfigError

    hf = json.loads((mtp_files["assistant"][0] / "config.json").read_text())
    hf["text_config"]["num_kv_shared_layers"] = 1
    with pytest.raises(ConfigError, match="shared K/V"):
        AssistantConfig.from_hf_config(hf)
