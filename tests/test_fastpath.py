"""The CPU fast path: column-split weights compute the same function, and the compiled decode step of
an E2B-shaped model reads every weight matrix (tied LM head and attention projections included)
through XLA:CPU's fused matrix-vector dot. A jax/XLA upgrade that loses the fusion fails here."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmax.engine.fastpath import (
    COPY,
    GATHER,
    GEMM,
    GEMM_LEFT,
    GEMV,
    cache_rewrites,
    check_decode_hlo,
    column_blocks,
    decode_weight_reads,
    prepare_params,
    split_columns,
)
from gemmax.engine.hlo import HloIndex
from gemmax.engine.policy import choose_policy
from gemmax.engine.shapes import kv_buckets
from gemmax.model.config import E2B_TEXT_CONFIG, FULL, SLIDING, ModelConfig
from gemmax.model.forward import Precision, forward
from gemmax.model.kv_cache import init_cache
from gemmax.model.linear import GEMV_MAX_IN, linear, lookup
from gemmax.model.params import abstract_params, random_params

CPU = choose_policy("cpu", "test", None, 1, cpu_gemv_fusion=True)
GPU = choose_policy("gpu", "NVIDIA L4", "8.9", 1)
SIX_LAYERS = {  # E2B shapes (hidden 1536, FFN 6144 / 12288 double-wide, vocab 262144, PLE 256), 6 layers
    **E2B_TEXT_CONFIG, "num_hidden_layers": 6, "num_kv_shared_layers": 2,
    "layer_types": [SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL],
}


def test_column_blocks():
    assert column_blocks(4095) == (4095,)
    assert column_blocks(4096) == (2048, 2048)
    assert column_blocks(6144) == (3072, 3072)
    assert column_blocks(12288) == (3072,) * 4
    assert column_blocks(8960) == (3008, 3008, 2944)
    for n in (5000, 8191, 20000, 262144):
        widths = column_blocks(n)
        assert sum(widths) == n and max(widths) <= GEMV_MAX_IN and len(widths) <= -(-n // GEMV_MAX_IN) + 1


def _compiled_reads(n_in: int, rows: int = 1, split: bool = False, dtype=jnp.bfloat16) -> tuple[str, ...]:
    w = jax.ShapeDtypeStruct((384, n_in), dtype)
    if split:
        w = tuple(jax.ShapeDtypeStruct((384, k), dtype) for k in column_blocks(n_in))
    x = jax.ShapeDtypeStruct((rows, 1, n_in), jnp.float32)
    reads = decode_weight_reads(jax.jit(linear).lower(x, w).compile().as_text())
    return tuple(sorted(k for kinds in reads.values() for k in kinds))


def test_gemv_fusion_limit_is_where_we_split():
    """The fused matrix-vector dot takes vectors up to 4095 floats; at 4096 XLA copies the weight to f32."""
    assert _compiled_reads(GEMV_MAX_IN) == (GEMV,)
    assert _compiled_reads(GEMV_MAX_IN + 1) == (COPY,)
    assert _compiled_reads(6144, split=True) == (GEMV, GEMV)
    assert _compiled_reads(6144, rows=8, split=True) == (GEMM_LEFT, GEMM_LEFT)


def test_few_rows_put_the_weight_on_the_gemm_left():
    """Up to 64 rows, a weight with 1024+ inputs whose rows are not a multiple of 4 KiB is the GEMM's
    left operand (YNNPACK streams it rather than repacking it; docs/cpu_decode.md has the numbers),
    and from 32 rows every weight is."""
    assert _compiled_reads(1536, rows=8) == (GEMM_LEFT,)
    assert _compiled_reads(1536, rows=2) == (GEMM_LEFT,)
    assert _compiled_reads(1536, rows=64) == (GEMM_LEFT,)
    assert _compiled_reads(1536, rows=8, dtype=jnp.float32) == (GEMM_LEFT,)
    assert _compiled_reads(1536, rows=65) == (GEMM,)  # prefill-sized
    assert _compiled_reads(640, rows=8) == (GEMM,)  # measured slower on the left below 1024 inputs
    assert _compiled_reads(2048, rows=8) == (GEMM,)  # 4 KiB bf16 rows
    assert _compiled_reads(1024, rows=8, dtype=jnp.float32) == (GEMM,)  # 4 KiB f32 rows
    assert _compiled_reads(640, rows=16) == (GEMM,)
    assert _compiled_reads(640, rows=32) == (GEMM_LEFT,)  # a 32-token prefill chunk of Gemma 3 270M
    assert _compiled_reads(2048, rows=64) == (GEMM_LEFT,)


@pytest.mark.parametrize("rows, n_in", [(2, 1088), (8, 1088), (64, 1088), (32, 640)])
def test_weight_on_the_left_computes_the_same_product(rows, n_in):
    """Every row equals the exact product of its bf16-rounded inputs, and the same row in a group of 2."""
    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((192, n_in)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, n_in)), jnp.float32)
    assert _compiled_reads(n_in, rows=rows) == (GEMM_LEFT,)
    y = np.asarray(jax.jit(linear)(x, w))
    assert y.shape == (rows, 192) and y.dtype == np.float32
    exact = np.asarray(x.astype(jnp.bfloat16), np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(y, exact, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(jax.jit(linear)(x[:2], w)), y[:2])


@pytest.mark.parametrize("rows", [1, 5])
def test_split_linear_matches_whole(rows):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((96, 300)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, 1, 300)), jnp.float32)
    whole = jax.jit(linear)(x, w)
    blocks = split_columns(w, column_blocks(300, 128))
    assert [b.shape[1] for b in blocks] == [128, 128, 44]
    split = jax.jit(linear)(x, blocks)
    assert split.shape == whole.shape == (rows, 1, 96) and split.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(split), np.asarray(whole), rtol=1e-5, atol=1e-5)
    # bf16 inputs (x is rounded to the weight dtype), exact products, float32 sums.
    exact = np.asarray(x.astype(jnp.bfloat16), np.float64).reshape(rows, 300) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(split).reshape(rows, 96), exact, rtol=1e-4, atol=1e-4)
    ids = jnp.asarray([[3, 0, 95]])
    np.testing.assert_array_equal(np.asarray(lookup(blocks, ids, jnp.float32)), np.asarray(lookup(w, ids, jnp.float32)))


def test_prepare_params_keeps_the_model_function():
    """A tiny E2B-like model with every matrix split (max_in=40) gives the same logits and cache."""
    config = ModelConfig.from_hf_config({
        **SIX_LAYERS, "vocab_size": 128, "vocab_size_per_layer_input": 128, "hidden_size": 48,
        "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 32,
        "sliding_window": 8, "hidden_size_per_layer_input": 8,
    })
    params = random_params(config, seed=1, weight_dtype=jnp.bfloat16)
    split = prepare_params(params, config, CPU, max_in=40)
    assert isinstance(split["layers"][0]["q"], tuple) and isinstance(split["layers"][5]["down"], tuple)
    assert prepare_params(params, config, GPU) is params
    assert jax.tree.structure(prepare_params(split, config, CPU, max_in=40)) == jax.tree.structure(split)
    step = jax.jit(functools.partial(forward, config=config, precision=Precision()))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 128, (3, 12)), jnp.int32)
    num = jnp.asarray([12, 7, 1], jnp.int32)
    for p in (params, split):
        cache = init_cache(config, 3, 32)
        logits, cache = step(p, cache, tokens, jnp.zeros(3, jnp.int32), num)  # prefill
        decoded, _ = step(p, cache, tokens[:, :1], num, jnp.ones(3, jnp.int32))  # one decode step
        if p is params:
            reference = (logits, decoded)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference[0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(reference[1]), rtol=1e-4, atol=1e-4)


def _decode_hlo(params, config: ModelConfig, batch: int) -> str:
    precision = Precision(jnp.float32, jnp.float32)

    def step(params, cache, tokens, start):
        logits, cache = forward(params, cache, tokens, start, jnp.ones_like(start), config=config, precision=precision)
        return jnp.argmax(logits, -1), cache

    cache = jax.eval_shape(lambda: init_cache(config, batch, 1024, jnp.float32))
    ints = (jax.ShapeDtypeStruct((batch, 1), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32))
    return jax.jit(step, donate_argnums=(1,)).lower(params, cache, *ints).compile().as_text()


@pytest.fixture(scope="module")
def six_layers():
    config = ModelConfig.from_hf_config(SIX_LAYERS)
    plain = abstract_params(config, jnp.bfloat16)
    return config, plain, jax.eval_shape(lambda p: prepare_params(p, config, CPU), plain)


def test_decode_step_reads_every_matrix_through_the_fused_dot(six_layers):
    config, _, params = six_layers
    reads = decode_weight_reads(_decode_hlo(params, config, 1))
    # The tied LM head (262144 x 1536) is one fused dot; its rows are also gathered for the embedding.
    # (jax 0.11's XLA may gather the rows in several ops: the head is still exactly one fused dot)
    assert reads["params['embed']"].count(GEMV) == 1 and set(reads["params['embed']"]) == {GATHER, GEMV}
    assert set(reads["params['ple_embed']"]) == {GATHER}
    layer0 = {k: v for k, v in reads.items() if k.startswith("params['layers'][0]")}
    assert set(layer0) == {f"params['layers'][0]['{n}']" for n in ("q", "k", "v", "o", "gate", "up", "ple_gate", "ple_proj")} | {
        "params['layers'][0]['down'][0]", "params['layers'][0]['down'][1]"}
    full_o = [k for k in reads if k.startswith("params['layers'][3]['o']")]
    assert len(full_o) == 2  # 8 heads x 512 = 4096 inputs: split
    wide = [k for k in reads if k.startswith("params['layers'][5]['down']")]
    assert len(wide) == 4  # double-wide MLP of a KV-sharing layer: 12288 inputs
    matrices = {k: v for k, v in reads.items() if k not in ("params['embed']", "params['ple_embed']")}
    assert len(matrices) == 63 and all(kinds == (GEMV,) for kinds in matrices.values())
    assert check_decode_hlo(_decode_hlo(params, config, 1), 1) == []


def test_decode_check_catches_the_slow_path(six_layers):
    """Unsplit down projections (6144 inputs) fall off the fusion: the check names them."""
    config, plain, _ = six_layers
    problems = check_decode_hlo(_decode_hlo(plain, config, 1), 1)
    assert any("['down']" in p for p in problems) and any("['layers'][3]['o']" in p for p in problems)
    assert not any("['q']" in p or "['embed']" in p for p in problems)


def test_batched_decode_reads_no_weight_copies(six_layers):
    config, _, params = six_layers
    hlo = _decode_hlo(params, config, 8)
    reads = decode_weight_reads(hlo)
    assert check_decode_hlo(hlo, 8) == []
    # 1536 / 3072 inputs: the weight is the GEMM's left operand; 2048 (o) and 256 (ple_proj) inputs: right.
    layer0 = "params['layers'][0]"
    left = ["params['embed']"] + [f"{layer0}['{n}']" for n in ("q", "k", "v", "gate", "up", "ple_gate")]
    assert all(GEMM_LEFT in reads[name] for name in left + [f"{layer0}['down'][0]", f"{layer0}['down'][1]"])
    assert reads[f"{layer0}['o']"] == (GEMM,) and reads[f"{layer0}['ple_proj']"] == (GEMM,)
    assert all({GEMM, GEMM_LEFT} & set(kinds) for name, kinds in reads.items() if name != "params['ple_embed']")


@pytest.mark.parametrize("batch", [1, 8])
def test_engine_decode_step_gets_the_fast_path(six_layers, batch):
    """The program the serving engine really runs (sampling included) reads every matrix fast."""
    from gemmax.engine.steps import decode_step, init_device_state

    config, _, params = six_layers
    precision = CPU.precision()
    device = jax.eval_shape(lambda: init_device_state(config, batch, 1024, precision))
    cache = device.cache
    hlo = decode_step.lower(params, device, jax.ShapeDtypeStruct((batch,), jnp.bool_), config=config,
                            precision=precision, kv_len=kv_buckets(1024)).compile().as_text()
    assert check_decode_hlo(hlo, batch) == []
    assert GEMV in decode_weight_reads(hlo)["params['embed']"] or batch > 1
    # The bf16 cache is written in place: no step converts or copies a whole cache array.
    assert cache_rewrites(hlo, _cache_shapes(cache)) == []


@pytest.mark.parametrize("rows, row_invariant", [(1, False), (2, True), (None, True)])
def test_engine_group_decode_writes_the_cache_in_place_and_gets_the_fast_path(six_layers, rows, row_invariant):
    """A decode forward as the engine compiles it (the KV buckets to choose from at run time) of a
    group (1 active request among 8 slots; 2 rows) or of every slot, row by row when row-invariant,
    writes and reads its rows of the cache in place (no cache array copied or converted whole) and
    reads every matrix fast."""
    from gemmax.engine.steps import decode_forward, init_device_state

    config, _, params = six_layers
    precision = CPU.precision()
    device = jax.eval_shape(lambda: init_device_state(config, 8, 1024, precision))
    cache = device.cache
    group = None if rows is None else jax.ShapeDtypeStruct((rows,), jnp.int32)
    hlo = decode_forward.lower(params, device, group, config=config, precision=precision, kv_len=kv_buckets(1024),
                               row_invariant=row_invariant).compile().as_text()
    assert check_decode_hlo(hlo, 1) == [] or rows != 1
    assert cache_rewrites(hlo, _cache_shapes(cache)) == []


def _cache_shapes(cache) -> list[tuple[int, ...]]:
    return sorted({leaf.shape for leaf in jax.tree.leaves(cache) if len(leaf.shape) == 4})


@pytest.mark.parametrize("step", ["prefill_step", "prefill_rows", "verify_rows"])
def test_engine_prefill_and_verify_write_the_cache_in_place(six_layers, step):
    """A one-slot prefill writes its chunk into the donated cache in place: a full layer before
    reading its rows, a ring after reading its rows out through `opaque`, whose result the write's
    row indices come from (passed through unchanged, XLA copied every ring twice: forward's
    `_attention`). No prefill or verify step copies or converts a whole cache array."""
    from gemmax.engine import steps

    config, _, params = six_layers
    precision = CPU.precision()
    device = jax.eval_shape(lambda: steps.init_device_state(config, 8, 1024, precision, ring_slack=4))
    i32, flag = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.bool_)
    if step == "prefill_step":
        args = (jax.ShapeDtypeStruct((1, 64), jnp.int32), i32, i32, i32, flag)
    elif step == "prefill_rows":
        args = (jax.ShapeDtypeStruct((2, 64), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32), i32,
                jax.ShapeDtypeStruct((2,), jnp.int32), flag)
    else:
        args = (jax.ShapeDtypeStruct((8,), jnp.bool_), jax.ShapeDtypeStruct((2,), jnp.int32),
                jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32))
    kv_len = 256 if step == "prefill_rows" else kv_buckets(1024)
    hlo = getattr(steps, step).lower(params, device, *args, config=config, precision=precision,
                                     kv_len=kv_len).compile().as_text()
    assert cache_rewrites(hlo, _cache_shapes(device.cache)) == []
    if step == "verify_rows":  # nor copies or rewrites its [g, k + 1, V] logits (`steps._verify`)
        assert _logits_rewrites(hlo, 2 * 5 * config.vocab_size) == []


def _logits_rewrites(hlo: str, size: int) -> list[str]:
    """Copies (a `copy` instruction of its own) and in-place updates (dynamic-update-slice or scatter,
    alone or inside a fusion) of float32 arrays of `size` elements: a step's logits. (A copy inside a
    fusion is a layout change computed on the way, not a buffer.) A verify step that set its penalised
    first position into its logits, which it still read afterwards, had XLA copy all of them four
    times and update two of the copies: 75 MB each at 8 rows and k = 8 on the built-in model."""
    index = HloIndex.read(hlo)
    fused = {i.calls for comp in index.computations.values() for i in comp.values() if i.opcode == "fusion"}
    found = []
    for name, comp in index.computations.items():
        if name in fused:  # reached through its fusion's body below
            continue
        for instr in comp.values():
            for op in index.body(instr):
                rewrites = op.opcode in ("dynamic-update-slice", "scatter") or (op is instr and op.opcode == "copy")
                if rewrites and op.dtype == "f32" and op.dims and np.prod(op.dims) == size:
                    found.append(f"{instr.name}: {op.name} = {op.shape}")
    return found


def _under_conditional(index, comp: str) -> bool:
    """Whether computation `comp` runs only inside a branch of some `conditional` instruction."""
    callers = [i for i in index.instrs.values() if comp in re.findall(r"%([\w.\-]+)", i.attrs)]
    if not callers:
        return False  # the entry computation: reached unconditionally
    return all(i.opcode == "conditional" or _under_conditional(index, index.home[i.name]) for i in callers)


def _head_dots(index, vocab: int) -> list:
    return [i for i in index.instrs.values() if i.opcode == "dot" and vocab in i.dims]  # [.., V] or, weight on the left, [V, B]


@pytest.mark.parametrize("step", ["prefill_step", "prefill_rows"])
def test_prefill_computes_the_head_only_on_the_last_chunk(six_layers, step):
    """A prefill chunk before a prompt's last needs no logits; the LM head (which reads the whole
    embedding table) sits in a conditional on `last_chunk` (model.forward's `head_on`). The decode
    step, which always samples, is the control: its head dot runs unconditionally."""
    from gemmax.engine import steps
    from gemmax.engine.hlo import HloIndex

    config, _, params = six_layers
    precision = CPU.precision()
    device = jax.eval_shape(lambda: steps.init_device_state(config, 8, 1024, precision))
    i32, flag = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.bool_)
    if step == "prefill_step":
        args = (jax.ShapeDtypeStruct((1, 64), jnp.int32), i32, i32, i32, flag)
    else:
        args = (jax.ShapeDtypeStruct((2, 64), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32), i32,
                jax.ShapeDtypeStruct((2,), jnp.int32), flag)
    kv_len = kv_buckets(1024) if step == "prefill_step" else 256
    prefill = HloIndex.read(getattr(steps, step).lower(params, device, *args, config=config, precision=precision,
                                                        kv_len=kv_len).compile().as_text())
    decode = HloIndex.read(steps.decode_step.lower(params, device, jax.ShapeDtypeStruct((8,), jnp.bool_),
                                                   config=config, precision=precision, kv_len=256).compile().as_text())
    for index, conditional in ((prefill, True), (decode, False)):
        dots = _head_dots(index, config.vocab_size)
        assert dots, "no dot produces the vocabulary-sized logits"
        assert all(_under_conditional(index, index.home[d.name]) == conditional for d in dots)
