"""Quantised models against the unquantised one on random checkpoints loaded by the real loader, and
the options end to end: `load_model`, the policy line and the engine's info (what /health serves),
`gemmax generate`, the batching engine.

Bounds. Rounding a weight to a grid of step d acts like noise of RMS d/sqrt(12), independent of the
activations. So the logit error of a quantised model is predicted by its "noise twin": the same
model with Gaussian noise of the quantisation error's RMS (per output row, per tensor) added to every
weight the option quantises. The tests require the measured error to lie within [0.5, 2] x the
twins' mean over three seeds, and the twins' error to stay below 0.7 (a model whose logits the
noise decorrelates, error ~1, would pass any ratio). Measured ratios here: 0.80-1.06; on other
seeds up to 1.8 for the 4-bit PLE table, whose error comes from the few rows the tokens touch, in
groups of only P = 8 (twins of different seeds alone differ by +-25% there). A wrong scale, nibble
order or group gives many times more error; a quantisation that silently does nothing gives none;
either fails. Greedy agreement (teacher-forced top-1 over decode steps) must reach the twins'
lowest minus 0.1. These tiny random models are far more sensitive than
trained ones (median top-2 logit gap 0.04 for a logit spread of 0.17): the absolute levels here say
little, docs/quantization.md has them for the E2B-shaped benchmark model and the real default model.

The int8 KV cache stores each position's K and V per head with a step of absmax/127: a perturbation
of the attention inputs no larger, relatively, than int8 weights' per-row step on every matmul
output, and of fewer quantities. Its logit error must be above zero (the cache is really int8 and
really read) and at most that of int8 weights on the same model (their noise twin's, which the
test above ties to it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from gemmax import quant as Q
from gemmax.cli import app
from gemmax.engine.api import GenerationRequest, SamplingParams
from gemmax.engine.engine import BatchEngine
from gemmax.engine.generate import generate
from gemmax.engine.loading import load_model
from gemmax.model.forward import Precision, forward
from gemmax.model.kv_cache import init_cache
from gemmax.model.params import count_bytes, param_specs, tree_from_leaves
from gemmax.quant.cpu import gemm_dtype

TOKENS, ROWS = 25, 3  # 24 teacher-forced decode steps on 3 rows
_forward = jax.jit(forward, static_argnames=("config", "precision", "logits"))

OPTIONS = {
    "int8": Q.QuantOptions(quant="int8"),
    "w4a16": Q.QuantOptions(quant="w4a16"),
    "ple8": Q.QuantOptions(ple_bits=8),
    "ple4": Q.QuantOptions(ple_bits=4),
    "int8_lm_head": Q.QuantOptions(int8_lm_head=True),
}
# W4A16 runs on the models whose twin error stays well below saturation (g4_shared's reaches ~1).
CASES = ([("g4_shared", name) for name in ("int8", "ple8", "ple4", "int8_lm_head")]
         + [("g3_small", name) for name in ("int8", "w4a16", "int8_lm_head")] + [("g4_plain", "w4a16")])


def decode_logits(params, config, tokens: jax.Array, kv_dtype) -> np.ndarray:
    """Logits [B, T-1, V] of teacher-forced decode steps from an empty cache, one token per row per
    step: the CPU matrix-vector forms (row by row for B > 1), every step reading the KV cache."""
    B, T = tokens.shape
    precision = Precision(jnp.float32, kv_dtype)
    cache = init_cache(config, B, T, kv_dtype)
    out = []
    for t in range(T - 1):
        logits, cache = _forward(params, cache, tokens[:, t : t + 1], jnp.full(B, t, jnp.int32), jnp.ones(B, jnp.int32),
                                 config=config, precision=precision)
        out.append(np.asarray(logits))
    return np.stack(out, axis=1)


def relative_error(logits: np.ndarray, reference: np.ndarray) -> float:
    """||Δ|| / ||reference|| over all positions, each position's logits centred (softmax ignores offsets)."""
    def centre(x):
        return x - x.mean(-1, keepdims=True)
    return float(np.linalg.norm(centre(logits) - centre(reference)) / np.linalg.norm(centre(reference)))


def agreement(logits: np.ndarray, reference: np.ndarray) -> float:
    return float((logits.argmax(-1) == reference.argmax(-1)).mean())


def _dequantized(form) -> np.ndarray:
    if isinstance(form, Q.QuantizedTable):
        return np.asarray(form.rows(jnp.arange(form.shape[0])))
    return np.asarray(form.dequantize())


def noise_twin(plain, quantized, config, seed: int):
    """`plain` params with Gaussian noise of the quantisation error's per-row RMS on every leaf
    `quantized` quantises (an lm_head entry gets a noisy copy of the embedding)."""
    rng = np.random.default_rng(seed)

    def perturb(w, form):
        w32 = np.asarray(w, np.float32)
        rms = np.sqrt(((w32 - _dequantized(form)) ** 2).mean(-1, keepdims=True))
        return jnp.asarray(w32 + rng.standard_normal(w32.shape, dtype=np.float32) * rms, w.dtype)

    leaves = {}
    for spec in param_specs(config):
        value, form = plain, quantized
        for key in spec.path:
            value, form = value[key], form[key]
        leaves[spec.path] = perturb(value, form) if Q.is_quantized(form) else value
    twin = tree_from_leaves(config, leaves)
    if "lm_head" in quantized:
        twin["lm_head"] = perturb(plain["embed"], quantized["lm_head"])
    return twin


@pytest.fixture(scope="module")
def references(hf_checkpoints):
    """{model: (loaded plain model, tokens, reference logits)}, computed once."""
    out = {}
    for name in ("g4_shared", "g3_small", "g4_plain"):
        loaded = load_model(str(hf_checkpoints[name][0]))
        config = loaded.checkpoint.config
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (ROWS, TOKENS)), jnp.int32)
        out[name] = (loaded, tokens, decode_logits(loaded.checkpoint.params, config, tokens, jnp.float32))
    return out


def twin_errors(plain, quantized, config, tokens, reference, seeds=(1, 2, 3)) -> list[tuple[float, float]]:
    """[(relative error, agreement)] of noise twins (plain structure: compiled once per model)."""
    out = []
    for seed in seeds:
        logits = decode_logits(noise_twin(plain, quantized, config, seed), config, tokens, jnp.float32)
        out.append((relative_error(logits, reference), agreement(logits, reference)))
    return out


@pytest.mark.parametrize(("model", "option"), CASES)
def test_quantised_logits_match_their_noise_twin(model, option, references, hf_checkpoints):
    plain, tokens, reference = references[model]
    loaded = load_model(str(hf_checkpoints[model][0]), quant=OPTIONS[option])
    config = loaded.checkpoint.config
    assert loaded.checkpoint.params is not plain.checkpoint.params
    logits = decode_logits(loaded.checkpoint.params, config, tokens, jnp.float32)
    error, agree = relative_error(logits, reference), agreement(logits, reference)
    twins = twin_errors(plain.checkpoint.params, loaded.checkpoint.params, config, tokens, reference)
    predicted = float(np.mean([e for e, _ in twins]))
    assert predicted < 0.7, "saturated: decorrelated logits (error ~1) would pass the ratio bound whatever happened"
    ratio = error / predicted
    assert 0.5 <= ratio <= 2.0, (option, error, twins)
    assert agree >= min(a for _, a in twins) - 0.1, (option, agree, twins)


@pytest.mark.parametrize("model", ["g4_shared", "g3_small"])
def test_int8_kv_cache_error_is_at_most_int8_weights(model, references):
    plain, tokens, reference = references[model]
    policy = dataclasses.replace(plain.policy, kv_cache="int8")  # what --kv-cache-dtype int8 sets
    assert policy.precision().kv_cache == jnp.int8
    config, params = plain.checkpoint.config, plain.checkpoint.params
    cache = init_cache(config, 1, 8, policy.precision().kv_cache)
    layer = cache.layers[0]
    assert layer.k.dtype == jnp.int8 and layer.k_scale.shape == layer.k.shape[:3]  # [B, S, nkv]
    logits = decode_logits(params, config, tokens, policy.precision().kv_cache)
    error = relative_error(logits, reference)
    int8_weights = Q.quantize_params(params, config, OPTIONS["int8"], "cpu")
    twins = twin_errors(params, int8_weights, config, tokens, reference, seeds=(1, 2))
    bound = float(np.mean([e for e, _ in twins]))
    assert 0 < error <= bound, (error, bound)
    # Greedy agreement no worse than int8 weights' noise twins allow (an absolute floor of 0.85 moved
    # with the random reference checkpoint: 61 of 72 positions here).
    agree = agreement(logits, reference)
    assert agree >= min(a for _, a in twins) - 0.05, (agree, twins)


ALL = Q.QuantOptions(quant="int8", ple_bits=4, int8_lm_head=True, kv_cache="int8")
KERNEL = "cpu" if jax.default_backend() == "cpu" else "xla"
HOLDS_COPIES = KERNEL == "cpu" and gemm_dtype("bfloat16") == "bfloat16"  # int8 layers' bf16 GEMM copies


def test_load_model_quantises_counts_and_reports(hf_checkpoints, caplog):
    directory = str(hf_checkpoints["g4_shared"][0])
    with caplog.at_level(logging.INFO, logger="gemmax"):
        loaded = load_model(directory, quant=ALL)
    params, config = loaded.checkpoint.params, loaded.checkpoint.config
    assert isinstance(params["layers"][0]["q"], Q.Int8Weight) and params["layers"][0]["q"].kernel == "cpu"
    assert isinstance(params["ple_embed"], Q.QuantizedTable) and params["ple_embed"].bits == 4
    assert params["ple_embed"].group == config.hidden_size_per_layer_input  # one scale per token per layer
    assert isinstance(params["lm_head"], Q.Int8Weight) and params["embed"].dtype == jnp.bfloat16
    # exact bytes: what the loader kept == the eval_shape figure `gemmax fit` prints on this device
    assert loaded.checkpoint.weight_bytes == count_bytes(params) == Q.quantized_weight_bytes(config, ALL, kernel=KERNEL)
    # a CPU with bf16 GEMMs holds every layer matrix again in bf16 (3 bytes a weight), nothing else
    copies = 2 * sum(math.prod(s.shape) for s in param_specs(config) if s.kind == "matrix") if HOLDS_COPIES else 0
    assert Q.gemm_copy_bytes(params) == copies and (params["layers"][0]["q"].gemm is not None) == HOLDS_COPIES
    lean = load_model(directory, quant=dataclasses.replace(ALL, int8_gemm_copy=False))
    assert Q.gemm_copy_bytes(lean.checkpoint.params) == 0
    assert lean.checkpoint.weight_bytes == Q.quantized_weight_bytes(config, ALL) == loaded.checkpoint.weight_bytes - copies
    plain = load_model(directory)
    assert lean.checkpoint.weight_bytes < plain.checkpoint.weight_bytes
    line = loaded.policy.log_line()
    assert "quant=int8 ple_bits=4 int8_lm_head=True" in line and "kv_cache=int8" in line
    assert line in caplog.text  # the first log line of the load
    policy = loaded.policy.as_dict()
    assert policy["quant"]["quant"] == "int8" and policy["quant"]["ple_bits"] == 4 and policy["kv_cache"] == "int8"


def test_engine_serves_the_quantised_model_and_reports_it(hf_checkpoints):
    loaded = load_model(str(hf_checkpoints["g4_shared"][0]), quant=ALL)
    engine = BatchEngine(loaded, max_model_len=64, max_batch=2, buckets=(16,), steps_per_dispatch=2,
                         warm_up=False).start(background=False)
    try:
        assert engine.wait_ready(300)
        prompt = (2, 17, 33, 5, 90, 41, 7)
        result = engine.submit(GenerationRequest(prompt, max_tokens=10, ignore_eos=True)).wait()
        ck = loaded.checkpoint
        solo = generate(ck.params, ck.config, list(prompt), 10, SamplingParams(), loaded.policy.precision(), stop_ids=())
        assert list(result.token_ids) == solo
        info = engine.info  # what /health serves
        assert info["policy"]["quant"] == dataclasses.asdict(ALL)
        assert "int8" in info["precision"]["kv_cache"] and "int8" in info["precision"]["weights"]
        assert info["weight_bytes"] == Q.quantized_weight_bytes(ck.config, ALL, kernel=KERNEL)
        copies = 2 * sum(math.prod(s.shape) for s in param_specs(ck.config) if s.kind == "matrix") if HOLDS_COPIES else 0
        assert engine.memory_plan.weight_copies == copies  # named in the plan: "of which ... int8 GEMM copies"
        assert ("int8 GEMM copies" in engine.memory_plan.explain()) == HOLDS_COPIES
    finally:
        engine.shutdown(drain_timeout=1)


def test_generate_cli_applies_the_options(hf_checkpoints):
    directory = str(hf_checkpoints["g3_small"][0])
    runner = CliRunner()
    args = ["generate", "--model", directory, "--prompt-ids", "2,40,41,42", "--max-tokens", "6", "--json"]
    out = runner.invoke(app, args + ["--quant", "w4a16", "--int8-lm-head", "--kv-cache-dtype", "int8"])
    assert out.exit_code == 0, out.output
    options = Q.QuantOptions(quant="w4a16", int8_lm_head=True, kv_cache="int8")
    loaded = load_model(directory, quant=options)
    ck = loaded.checkpoint
    want = generate(ck.params, ck.config, [2, 40, 41, 42], 6, SamplingParams(), loaded.policy.precision())
    printed = json.loads(next(line for line in out.output.splitlines() if line.startswith("{")))
    assert printed["token_ids"] == want
    refused = runner.invoke(app, args + ["--quant", "w4a16", "--w4a16-kernel", "pallas"])
    assert refused.exit_code == 2 and "interpret mode" in refused.output and "--allow-pallas-interpret" in refused.output
    vocab = ck.config.vocab_size
    for ids, reason in ((f"2,{vocab}", "outside the vocabulary"), ("2,-5", "outside the vocabulary"), (",", "no id")):
        refused = runner.invoke(app, ["generate", "--model", directory, "--prompt-ids", ids, "--max-tokens", "2"])
        # rich boxes and wraps the usage error at the terminal's width: compared without the layout
        layout = re.compile(r"[\s\u2500-\u257f]+")
        assert refused.exit_code == 2 and layout.sub("", reason) in layout.sub("", refused.output), refused.output


def test_pallas_interpret_runs_the_model_when_allowed(hf_checkpoints):
    """The fused kernel inside the real model (interpret mode), against the XLA W4A16 path."""
    directory = str(hf_checkpoints["g4_plain"][0])
    fused = load_model(directory, quant=Q.QuantOptions(quant="w4a16", w4a16_kernel="pallas", allow_pallas_interpret=True))
    assert fused.policy.pallas_interpret and "w4a16_kernel=pallas_interpret" in fused.policy.log_line()
    xla = load_model(directory, quant=Q.QuantOptions(quant="w4a16", w4a16_kernel="xla"))
    config = xla.checkpoint.config
    tokens = jnp.asarray([[2, 5, 9, 14, 20, 27]], jnp.int32)
    cache = init_cache(config, 1, 8)
    want, _ = _forward(xla.checkpoint.params, cache, tokens, jnp.zeros(1, jnp.int32), jnp.full(1, 6, jnp.int32),
                       config=config, precision=Precision(), logits="all")
    got, _ = _forward(fused.checkpoint.params, cache, tokens, jnp.zeros(1, jnp.int32), jnp.full(1, 6, jnp.int32),
                      config=config, precision=Precision(), logits="all")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-4 * float(jnp.abs(want).max()))
