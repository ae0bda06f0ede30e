"""The rest of the Gemma 4 family against transformers 5.23.0: E4B-, 31B- and 26B-A4B-shaped tiny random
checkpoints (float32), loaded by gemmax's real loader; and the parameter counts of the real E4B, 31B
and 26B-A4B configs (`jax.eval_shape`) against transformers' own model built on the meta device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gemmax.engine.generate import generate
from gemmax.model.config import FAMILY_TEXT_CONFIGS, ModelConfig
from gemmax.model.forward import forward_jit as forward
from gemmax.model.kv_cache import init_cache
from gemmax.model.params import abstract_params, count_params
from gemmax.weights.load import load_checkpoint
from hf_reference import FAMILY_CONFIGS, build_gemma4

TOL = 1e-4


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    built = {}
    for seed, name in enumerate(FAMILY_CONFIGS):
        model = build_gemma4(name, root / name, seed=10 + seed, configs=FAMILY_CONFIGS)
        built[name] = (load_checkpoint(root / name, weight_dtype=jnp.float32), model)
    return built


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_prompt_and_decode_logits_match_transformers(family, name):
    """A 2-row prompt longer than the window in one pass, then prefill 5 + 30 single-token steps
    (gather-form experts for the MoE) against transformers' full forward."""
    ck, model = family[name]
    ids = np.random.default_rng(1).integers(0, ck.config.vocab_size, (2, 35))
    reference = _hf_logits(model, ids)
    B, T = ids.shape
    logits, _ = forward(ck.params, init_cache(ck.config, B, 64), jnp.asarray(ids, jnp.int32), jnp.zeros(B, jnp.int32),
                        jnp.full(B, T, jnp.int32), config=ck.config, logits="all")
    prompt_diff = np.abs(np.asarray(logits) - reference).max()
    assert prompt_diff <= TOL, f"{name}: prompt logits differ by {prompt_diff:.2e}"

    cache = init_cache(ck.config, 1, 64)
    logits, cache = forward(ck.params, cache, jnp.asarray(ids[:1, :5], jnp.int32), jnp.array([0]), jnp.array([5]),
                            config=ck.config)
    got = [np.asarray(logits)[0]]
    for t in range(5, T):
        logits, cache = forward(ck.params, cache, jnp.asarray(ids[:1, t : t + 1], jnp.int32), jnp.array([t]),
                                jnp.array([1]), config=ck.config)
        got.append(np.asarray(logits)[0])
    decode_diff = np.abs(np.stack(got) - reference[0, 4:]).max()
    assert decode_diff <= TOL, f"{name}: decode logits differ by {decode_diff:.2e}"


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_greedy_64_tokens_equal_transformers_generate(family, name):
    ck, model = family[name]
    prompt = [2, 17, 33, 5, 61, 8, 40]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert generate(ck.params, ck.config, prompt, 64, stop_ids=()) == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", ["E4B", "31B", "26B-A4B"])
def test_real_config_parameter_count_equals_transformers_meta_model(variant):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    hf = dict(FAMILY_TEXT_CONFIGS[variant])
    config = ModelConfig.from_hf_config(hf)
    ours = count_params(jax.eval_shape(lambda: abstract_params(config)))
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    with torch.device("meta"):
        model = Gemma4ForCausalLM(Gemma4TextConfig(**fields))
    theirs = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("layer_scalar"))
    assert ours == theirs, f"{variant}: gemmax {ours:,} vs transformers {theirs:,}"
