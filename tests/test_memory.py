"""Memory plan arithmetic: KV bytes of the real cache layout, weight bytes from shapes, the workspace
estimate against XLA's own buffer assignment, `gemmax fit`, and decode-step traffic."""

from __future__ import annotations

import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import pytest
from typer.testing import CliRunner

from gemmax.cli import app
from gemmax.engine.fastpath import prepare_params
from gemmax.engine.memory import (
    MAP_SHARE,
    GiB,
    MapBudget,
    MapLimitError,
    MemoryPlanError,
    bytes_per_decode_step,
    check_fit,
    decode_traffic,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_fixed_bytes,
    measure_read_bandwidth,
    memory_maps,
    plan_memory,
    prefill_workspace_bytes,
    weight_bytes,
)
from gemmax.engine.policy import choose_policy
from gemmax.model.config import E2B_TEXT_CONFIG, FULL, SLIDING, ModelConfig
from gemmax.model.forward import Precision, forward
from gemmax.model.kv_cache import init_cache
from gemmax.model.params import abstract_params, count_params, param_specs
from gemmax.weights.load import open_source


@pytest.fixture(scope="module")
def e2b() -> ModelConfig:
    return ModelConfig.from_hf_config(E2B_TEXT_CONFIG)


def _cache_nbytes(config: ModelConfig, batch: int, max_len: int, dtype) -> int:
    """Bytes of the cache the model really allocates (shapes only)."""
    shapes = jax.eval_shape(lambda: init_cache(config, batch, max_len, dtype))
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(shapes))


def test_e2b_kv_bytes_per_token_match_the_spec(e2b):
    # 15 producers (12 sliding with 1 KV head x 256, 3 full with 1 x 512); 20 KV-sharing layers store nothing.
    assert sum(spec.owns_kv for spec in e2b.layers) == 15
    assert kv_bytes_per_token(e2b, jnp.bfloat16) == 3 * 2 * 512 * 2 == 6144  # 6 KiB, full layers only
    # gemmax's ring keeps W = 512 slots per sliding layer (HF keeps 511: 12 x 511 x 1024 = 6,279,168 B).
    assert kv_fixed_bytes(e2b, jnp.bfloat16) == 12 * 512 * 2 * 256 * 2 == 6_291_456
    for n in (1, 100, 511, 512, 513, 4096, 32768, 131072):
        expected = 6144 * n + 12288 * min(n, 512)
        assert kv_cache_bytes(e2b, n, 1, jnp.bfloat16) == expected
        assert _cache_nbytes(e2b, 1, n, jnp.bfloat16) == expected  # the layout of model.init_cache
    # Up to the window every producer keeps every token: the "18 KiB per token" figure.
    assert kv_cache_bytes(e2b, 512, 1, jnp.bfloat16) == 18432 * 512
    # The spec's table (MiB): 4K -> 30, 32K -> 198, 128K -> 774 (ours: 6 MiB of rings, not 5.99).
    assert kv_cache_bytes(e2b, 4096, 1, jnp.bfloat16) == 30 * 2**20
    assert kv_cache_bytes(e2b, 32768, 1, jnp.bfloat16) == 198 * 2**20
    assert kv_cache_bytes(e2b, 131072, 1, jnp.bfloat16) == 774 * 2**20
    # Slots scale it linearly; float32 doubles it.
    assert kv_cache_bytes(e2b, 4096, 8, jnp.float32) == 16 * kv_cache_bytes(e2b, 4096, 1, jnp.bfloat16)
    assert _cache_nbytes(e2b, 3, 700, jnp.float32) == kv_cache_bytes(e2b, 700, 3, jnp.float32)
    # int8: one byte per value plus a float32 scale per position and KV head, for K and V.
    assert kv_bytes_per_token(e2b, jnp.int8) == 3 * 2 * (512 + 4)
    assert _cache_nbytes(e2b, 2, 1000, jnp.int8) == kv_cache_bytes(e2b, 1000, 2, jnp.int8)


def test_kv_without_sharing_counts_every_layer():
    config = ModelConfig.from_hf_config({**E2B_TEXT_CONFIG, "num_kv_shared_layers": 0})
    assert kv_bytes_per_token(config, jnp.bfloat16) == 7 * 2048  # 14 KiB: all 7 full layers store
    assert kv_fixed_bytes(config, jnp.bfloat16) == 28 * 512 * 1024
    assert _cache_nbytes(config, 1, 1000, jnp.bfloat16) == kv_cache_bytes(config, 1000, 1, jnp.bfloat16)


def test_e2b_weight_bytes_from_shapes(e2b):
    specs = param_specs(e2b)
    scalars = sum(math.prod(s.shape) for s in specs if s.kind == "scalar")
    norms = sum(math.prod(s.shape) for s in specs if s.kind == "norm")
    # The spec's 4,628,569,344 parameters; HF registers the 35 layer_scalars as buffers, gemmax as leaves.
    assert scalars == 35
    assert count_params(abstract_params(e2b)) - scalars == 4_628_569_344
    # Spec: 9,257,138,688 B with everything in bf16; gemmax keeps norms and scalars in float32.
    assert norms == 268_800 + 15_360 + 1_536 + 256
    assert weight_bytes(e2b, jnp.bfloat16) == 9_257_138_688 + 2 * norms + 4 * scalars
    # The CPU fast path's column blocks move no bytes.
    cpu = choose_policy("cpu", "test", None, 1, cpu_gemv_fusion=True)
    prepared = jax.eval_shape(lambda p: prepare_params(p, e2b, cpu), abstract_params(e2b))
    assert jax.tree.structure(prepared) != jax.tree.structure(abstract_params(e2b))
    assert sum(math.prod(x.shape) * 2 for x in jax.tree.leaves(prepared) if x.dtype == jnp.bfloat16) == (
        (4_628_569_344 - norms) * 2
    )


def test_impossible_plan_is_refused_with_the_arithmetic(e2b):
    memory = 16 * GiB
    plan = plan_memory(e2b, 131072, 64, memory, kv_dtype=jnp.bfloat16, prefill_tokens=1024, model="e2b")
    assert not plan.fits
    kv = 64 * (6144 * 131072 + 12288 * 512)
    assert plan.kv_cache == kv
    assert plan.weights == weight_bytes(e2b, jnp.bfloat16)
    assert plan.required == plan.weights + kv + plan.workspace
    assert plan.available == memory - int(memory * 0.05)
    with pytest.raises(MemoryPlanError) as refused:
        check_fit(plan)
    text = str(refused.value)
    for number in (plan.weights, kv, plan.workspace, plan.required, memory, plan.required - plan.available):
        assert f"{number:,} B" in text
    assert "DOES NOT FIT" in text and "6,144 B/token" in text
    # The largest values it offers do fit, and one more does not.
    n, b = plan.largest_max_model_len, plan.largest_batch
    assert n is not None and 0 < n < 131072 and b < 64
    assert plan_memory(e2b, n, 64, memory, kv_dtype=jnp.bfloat16, prefill_tokens=1024).fits
    assert not plan_memory(e2b, n + 1, 64, memory, kv_dtype=jnp.bfloat16, prefill_tokens=1024).fits
    if b:
        assert plan_memory(e2b, 131072, b, memory, kv_dtype=jnp.bfloat16, prefill_tokens=1024).fits
    assert not plan_memory(e2b, 131072, b + 1, memory, kv_dtype=jnp.bfloat16, prefill_tokens=1024).fits
    # Weights alone over the device: nothing fits.
    tiny = plan_memory(e2b, 128, 1, 4 * GiB)
    assert not tiny.fits and tiny.largest_max_model_len is None and tiny.largest_batch == 0
    assert "weights alone do not fit" in tiny.explain()


def test_prefill_workspace_is_quadratic_in_the_chunk(e2b):
    w = [prefill_workspace_bytes(e2b, t, 8192) for t in (1024, 2048, 4096)]
    assert w[0] < w[1] < w[2]
    # Doubling a long chunk more than doubles the transient (scores over slots + T keys).
    assert prefill_workspace_bytes(e2b, 8192, 8192) > 2.5 * prefill_workspace_bytes(e2b, 4096, 8192)


def test_workspace_estimate_bounds_xla_buffer_assignment():
    """The estimate must cover what XLA really allocates for a prefill, without overshooting 2x."""
    config = ModelConfig.from_hf_config({
        **E2B_TEXT_CONFIG, "vocab_size": 512, "vocab_size_per_layer_input": 512, "hidden_size": 256, "intermediate_size": 1024,
        "num_hidden_layers": 4, "layer_types": [SLIDING, SLIDING, FULL, FULL], "num_kv_shared_layers": 1,
        "num_attention_heads": 4, "head_dim": 64, "global_head_dim": 128, "sliding_window": 128,
        "hidden_size_per_layer_input": 64,
    })
    cpu = choose_policy("cpu", "test", None, 1, cpu_gemv_fusion=True)
    params = jax.eval_shape(lambda p: prepare_params(p, config, cpu), abstract_params(config))
    precision = Precision(jnp.float32, jnp.float32)
    step = jax.jit(functools.partial(forward, config=config, precision=precision), donate_argnums=(1,))
    for tokens, max_len in ((256, 1024), (1024, 1024), (1024, 2048)):
        cache = jax.eval_shape(lambda n=max_len: init_cache(config, 1, n, jnp.float32))
        ints = [jax.ShapeDtypeStruct(s, jnp.int32) for s in ((1, tokens), (1,), (1,))]
        temp = step.lower(params, cache, *ints).compile().memory_analysis().temp_size_in_bytes
        estimate = prefill_workspace_bytes(config, tokens, max_len)
        assert temp <= estimate <= 2 * temp, (tokens, max_len, temp, estimate)


def test_fit_cli_works_from_a_config_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(E2B_TEXT_CONFIG))
    assert open_source(str(tmp_path), weights=False).config.num_layers == 35
    runner = CliRunner()
    ok = runner.invoke(app, ["fit", "--model", str(tmp_path), "--max-model-len", "4096", "--max-batch", "2",
                             "--device-memory-gib", "24", "--kv-dtype", "bfloat16", "--json"])
    assert ok.exit_code == 0, ok.output
    plan = json.loads(ok.output)
    assert plan["fits"] and plan["kv_per_token"] == 6144 and plan["kv_cache"] == 2 * 30 * 2**20
    refused = runner.invoke(app, ["fit", "--model", str(tmp_path / "config.json"), "--max-model-len", "131072",
                                  "--max-batch", "64", "--device-memory-gib", "16", "--kv-dtype", "bfloat16"])
    assert refused.exit_code == 1
    assert "DOES NOT FIT" in refused.output and "largest max_model_len at max_batch=64" in refused.output
    # what cannot be used is a usage error (status 2, one line), never status 1, which means "does not fit"
    for args, reason in ((["--model", str(tmp_path / "nowhere")], "nowhere"),
                         (["--model", str(tmp_path), "--dtype", "foo"], "foo"),
                         (["--model", str(tmp_path), "--draft-model", str(tmp_path / "no-draft")], "no-draft")):
        refused = runner.invoke(app, ["fit", *args, "--device-memory-gib", "16"])
        assert refused.exit_code == 2 and unboxed(reason) in unboxed(refused.output), (args, refused.output)
    refused = runner.invoke(app, ["fit", "--model", str(tmp_path), "--max-model-len", "1000000", "--device-memory-gib", "16"])
    assert refused.exit_code == 2 and unboxed("exceeds the 131,072 positions") in unboxed(refused.output)
    refused = runner.invoke(app, ["policy", "--dtype", "foo"])
    assert refused.exit_code == 2 and "foo" in refused.output


def unboxed(text: str) -> str:
    """Text without whitespace or box-drawing characters: rich boxes and wraps a usage error at the
    terminal's width (COLUMNS=80 in CI), anywhere in a long path."""
    return re.sub(r"[\s\u2500-\u257f]+", "", text)


def test_decode_traffic_counts_what_a_step_reads(e2b):
    config = ModelConfig.from_hf_config({**E2B_TEXT_CONFIG, "num_hidden_layers": 6, "num_kv_shared_layers": 2,
                                         "layer_types": [SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL]})
    params = abstract_params(config, jnp.bfloat16)
    H, V, P = 1536, 262144, 256
    t = decode_traffic(config, params, batch=8, context=2000)
    assert t.lm_head == V * H * 2  # the tied table, read once per step whatever the batch
    assert t.gathered == 8 * (H + 6 * P) * 2  # token rows of the embedding and PLE tables only
    matrices = sum(math.prod(s.shape) for s in param_specs(config) if s.kind == "matrix")
    assert t.matrices == matrices * 2
    # KV: every attention layer reads what it sees; sliding layers see at most the window.
    sliding, full = 2 * 256 * 2, 2 * 512 * 2  # K+V bytes per token, one KV head, bf16
    assert t.kv == 8 * (4 * 512 * sliding + 2 * 2000 * full)
    assert t.total == t.matrices + t.lm_head + t.gathered + t.norms + t.kv
    # Prepared (column-split) params read the same bytes; KV grows with context on full layers only.
    cpu = choose_policy("cpu", "test", None, 1, cpu_gemv_fusion=True)
    prepared = jax.eval_shape(lambda p: prepare_params(p, config, cpu), params)
    assert bytes_per_decode_step(config, prepared, 8, 2000) == t.total
    assert bytes_per_decode_step(config, params, 1, 300) - bytes_per_decode_step(config, params, 1, 200) == (
        100 * (4 * sliding + 2 * full)
    )
    assert bytes_per_decode_step(config, params, 1, 3000) - bytes_per_decode_step(config, params, 1, 2000) == (
        1000 * 2 * full
    )


def test_measure_read_bandwidth_is_a_plausible_rate():
    gbps = measure_read_bandwidth(size_mib=64, repeats=3)
    assert 0.5 < gbps < 2000


# Gemma 3 1B's text config (as transformers writes it): 26 layers, 5 sliding to 1 full, one KV head.
GEMMA3_1B_CONFIG = {
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
    "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "sliding_window": 512, "query_pre_attn_scalar": 256, "max_position_embeddings": 32768, "rope_theta": 1e6,
    "rope_local_base_freq": 1e4, "rms_norm_eps": 1e-6, "sliding_window_pattern": 6, "bos_token_id": 2,
    "eos_token_id": 1, "pad_token_id": 0,
}


@pytest.mark.parametrize(("hf", "kv_dtype"), [
    (E2B_TEXT_CONFIG, "bfloat16"),  # KV sharing: 20 of 35 layers read a donor's cache
    ({**E2B_TEXT_CONFIG, "num_kv_shared_layers": 0}, "float32"),  # every layer stores its own
    (GEMMA3_1B_CONFIG, "bfloat16"),
], ids=["e2b", "e2b-no-sharing", "gemma3-1b"])
def test_fit_counts_the_kv_bytes_the_engine_allocates(hf, kv_dtype, tmp_path):
    """`gemmax fit`'s KV-cache figure is the byte count of the device state the engine allocates
    (`steps.init_device_state`, shapes only) for the same max_model_len, slots and KV dtype."""
    from gemmax.engine.steps import init_device_state

    (tmp_path / "config.json").write_text(json.dumps(hf))
    max_len, slots = 3000, 3
    out = CliRunner().invoke(app, ["fit", "--model", str(tmp_path), "--max-model-len", str(max_len), "--max-batch",
                                   str(slots), "--device-memory-gib", "1000", "--kv-dtype", kv_dtype, "--json"])
    assert out.exit_code == 0, out.output
    plan = json.loads(out.output)
    config = ModelConfig.from_hf_config(hf)
    device = jax.eval_shape(lambda: init_device_state(config, slots, max_len, Precision(jnp.float32, jnp.dtype(kv_dtype))))
    allocated = sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(device.cache))
    assert plan["kv_cache"] == allocated and plan["kv_dtype"] == kv_dtype


def test_fit_counts_the_prefix_cache(tmp_path):
    """By default the prefix cache takes what the plan leaves free, at most 1 GiB (it never makes a
    plan fail); an explicit budget counts in full and can; 0 turns it off."""
    (tmp_path / "config.json").write_text(json.dumps(E2B_TEXT_CONFIG))
    runner = CliRunner()

    def plan(*extra):
        out = runner.invoke(app, ["fit", "--model", str(tmp_path), "--max-model-len", "4096", "--max-batch", "2",
                                  "--kv-dtype", "bfloat16", "--json", *extra])
        return out.exit_code, json.loads(out.output)

    code, roomy = plan("--device-memory-gib", "24")
    assert code == 0 and roomy["prefix_cache"] == GiB and roomy["prefix_cache_auto"]
    assert roomy["required"] == roomy["weights"] + roomy["kv_cache"] + roomy["workspace"] + GiB
    code, tight = plan("--device-memory-gib", "10")
    free = tight["available"] - (tight["weights"] + tight["kv_cache"] + tight["workspace"])
    assert code == 0 and 0 < tight["prefix_cache"] == free < GiB
    code, explicit = plan("--device-memory-gib", "10", "--prefix-cache-bytes", str(2 * GiB))
    assert code == 1 and not explicit["fits"] and explicit["prefix_cache"] == 2 * GiB
    assert plan("--device-memory-gib", "24", "--prefix-cache-bytes", "0")[1]["prefix_cache"] == 0


def test_map_budget_refuses_with_the_arithmetic_before_the_limit():
    """Ten programs, four ready, each of which added 1,000 memory maps: the six left take the process
    to its current maps + 6,000. A limit of exactly that is refused (over MAP_SHARE of it), with the
    numbers; a limit with that as MAP_SHARE of it and room to spare passes."""
    used = memory_maps()
    assert used is not None and used > 0  # Linux: /proc says
    with pytest.raises(MapLimitError) as refused:
        MapBudget(10, limit=used + 6000, start=used - 4000).check(4)
    message = str(refused.value)
    each = int(re.search(r"about ([\d,]+) each", message)[1].replace(",", ""))
    assert 950 <= each <= 1050 and "6 to go" in message and f"{used + 6000:,}" in message  # the maps move a little
    assert "vm.max_map_count" in message
    MapBudget(10, limit=int((used + 6000) / MAP_SHARE) + 2000, start=used - 4000).check(4)
    MapBudget(10, limit=None, start=used).check(4)  # no limit known: nothing to check
