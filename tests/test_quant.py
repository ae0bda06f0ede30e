"""Quantised weight forms, their matmul kernels, the W4A16 fit check and the weight bytes per option.

Model-level quality against the unquantised model lives in test_quant_model.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from gemmax import quant as Q
from gemmax.cli import app
from gemmax.engine.fastpath import COPY, GEMV, column_blocks, decode_weight_reads, split_columns
from gemmax.engine.memory import weight_bytes
from gemmax.model.config import E2B_TEXT_CONFIG, ModelConfig
from gemmax.model.linear import linear, lookup
from gemmax.model.params import param_specs
from gemmax.model.stored import StoredWeight, static
from gemmax.quant.pallas_w4a16 import (
    SMEM_PER_BLOCK,
    TPU_SCOPED_VMEM,
    TPU_TILES,
    W4A16FitError,
    W4Tiles,
    check_w4a16_fits,
    w4a16_matmul,
)

E2B = {**E2B_TEXT_CONFIG, "use_bidirectional_attention": None}


@pytest.fixture(scope="module")
def e2b() -> ModelConfig:
    return ModelConfig.from_hf_config(E2B)


def _weight(out: int, k: int, seed: int = 0, dtype=jnp.float32) -> jax.Array:
    w = np.random.default_rng(seed).standard_normal((out, k), dtype=np.float32) / np.sqrt(k)
    return jnp.asarray(w, dtype)


# ------------------------------------------------------------------------------------------- forms


def test_int8_per_channel_error_is_at_most_half_a_step():
    w = _weight(48, 200).at[5].set(0.0)  # an all-zero row must not divide by zero
    q = Q.quantize_int8(w)
    assert q.q.dtype == jnp.int8 and q.q.shape == (48, 200) and q.scale.dtype == jnp.bfloat16
    scale = np.asarray(q.scale, np.float32)
    np.testing.assert_allclose(scale, np.abs(np.asarray(w)).max(1) / 127, rtol=2**-8)  # bf16-rounded absmax / 127
    err = np.abs(np.asarray(w) - np.asarray(q.dequantize()))
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    assert np.asarray(q.q)[5].tolist() == [0] * 200 and scale[5] == 0


def test_int4_packs_each_chunk_as_two_nibble_planes_with_group_scales():
    k = 5000  # two packing chunks: the fast-path column blocks of 5000 inputs
    w = _weight(8, k, seed=1)
    q4 = Q.quantize_int4(w)
    assert q4.chunks == column_blocks(k) == (2560, 2440)
    assert q4.group == Q.int4_group(k) == 4  # 2440 / 2 = 1220 columns per plane: groups of 4
    assert q4.packed.shape == (8, k // 2) and q4.packed.dtype == jnp.uint8
    assert q4.scales.shape == (8, k // q4.group) and q4.scales.dtype == jnp.bfloat16
    # Q4_0 rounding from the stored scales, unpacked by hand from the bytes
    g = q4.group
    scales = np.repeat(np.asarray(q4.scales, np.float32), g, axis=1)  # [8, k]
    levels = np.clip(np.round(np.asarray(w) / np.where(scales != 0, scales, 1)), -8, 7)
    packed = np.asarray(q4.packed)
    start = 0
    for width in q4.chunks:
        half = width // 2
        block = packed[:, start // 2 : (start + width) // 2]
        low = ((block & 15).astype(np.int16) ^ 8) - 8  # two's-complement nibble
        high = ((block >> 4).astype(np.int16) ^ 8) - 8
        np.testing.assert_array_equal(low, levels[:, start : start + half])
        np.testing.assert_array_equal(high, levels[:, start + half : start + width])
        start += width
    deq = np.asarray(q4.dequantize())
    np.testing.assert_array_equal(deq, levels * scales)
    # each group's largest-magnitude value m is the level -8 (scale m / -8, rounded to bf16); the
    # opposite extreme rounds to +8 and is clipped to 7: nothing is off by more than a step (+ 2^-9 x 8)
    groups = np.asarray(w).reshape(8, k // g, g)
    extreme = np.take_along_axis(groups, np.abs(groups).argmax(-1)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(q4.scales, np.float32), extreme / -8, rtol=2**-8)
    assert (np.abs(np.asarray(w) - deq) <= np.abs(scales) * (1 + 8 * 2**-9) + 1e-7).all()
    assert np.abs(np.asarray(w) - deq).mean() < 0.3 * np.abs(scales).mean()  # ~ step / 4 for uniform rounding


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_table_rows(bits):
    table = _weight(40, 24, seed=2, dtype=jnp.bfloat16)  # 3 layers of P = 8
    qt = Q.quantize_table(table, bits, group=8)
    assert qt.shape == (40, 24) and qt.compute_dtype == "bfloat16"
    assert qt.q.shape == ((40, 24) if bits == 8 else (40, 12))
    ids = jnp.asarray([[3, 39, 0], [7, 7, 1]])
    rows = np.asarray(lookup(qt, ids, jnp.float32))
    want = np.asarray(table, np.float32)[np.asarray(ids)]
    step = np.repeat(np.abs(np.asarray(qt.scales, np.float32)), 8, axis=1)[np.asarray(ids)]
    assert rows.shape == (2, 3, 24)
    assert (np.abs(rows - want) <= (step / 2 if bits == 8 else step) + 1e-7).all()
    assert lookup(qt, ids, jnp.bfloat16).dtype == jnp.bfloat16
    if bits == 4:  # pairs layout: byte j = column 2j (low nibble) | column 2j+1 (high nibble)
        q, _ = Q.grouped(table, bits=4, group=8)
        q = np.asarray(q).astype(np.uint8)
        np.testing.assert_array_equal(np.asarray(qt.q), (q[:, 0::2] & 15) | (q[:, 1::2] << 4))


# ------------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("kernel", ["cpu", "xla"])
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_linear_equals_the_dequantised_product(kind, kernel, rows):
    """Every spelling (one row, row by row, dequantise-then-dot) and the column-blocked form equal
    x @ dequant(W).T (float32 weights: no rounding of x anywhere, so only the summation order differs)."""
    k = 4600  # > GEMV_MAX_IN: the CPU fast path splits it into column blocks
    w = _weight(64, k, seed=3)
    qw = Q.quantize_int8(w, kernel) if kind == "int8" else Q.quantize_int4(w, kernel)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((rows, k), dtype=np.float32))
    want = np.asarray(x) @ np.asarray(qw.dequantize()).T
    for form in (qw, split_columns(qw, column_blocks(k))):
        y = jax.jit(linear)(x.reshape(1, rows, k), form)  # 3-D activations, as the model passes them
        assert y.shape == (1, rows, 64) and y.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y)[0], want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_column_blocks_of_int4_must_follow_its_packing():
    q4 = Q.quantize_int4(_weight(8, 5000))
    with pytest.raises(ValueError, match="packing chunks"):
        q4[:, 0:1000]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _HalfWeight(StoredWeight):
    """A form written only for the test below: W stored as float16 with one float32 scale."""

    w: jax.Array  # float16 [out, in]
    s: jax.Array  # float32 []
    compute_dtype: str = static("float32")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    def __getitem__(self, index) -> _HalfWeight:
        return dataclasses.replace(self, w=self.w[index])

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.w.astype(jnp.float32) * self.s).astype(dtype)


@pytest.mark.parametrize("rows", [1, 5])
def test_a_new_stored_form_needs_only_the_protocol(rows):
    """A form that implements StoredWeight's few abstract methods is multiplied (whole or as column
    blocks), gathered and counted by the model's own `linear` / `lookup`, with no branch for it anywhere."""
    w = _weight(40, 4200, seed=8)
    form = _HalfWeight(w.astype(jnp.float16) / 2, jnp.asarray(2.0))
    x = jnp.asarray(np.random.default_rng(9).standard_normal((rows, 4200), dtype=np.float32))
    want = np.asarray(x) @ np.asarray(form.dequantize()).T
    blocks = split_columns(form, column_blocks(4200))
    assert len(blocks) == 2 and all(isinstance(b, _HalfWeight) for b in blocks)
    for stored in (form, blocks):
        np.testing.assert_allclose(np.asarray(jax.jit(linear)(x, stored)), want, rtol=1e-4, atol=1e-4)
    ids = jnp.asarray([[3, 0], [39, 3]])
    np.testing.assert_array_equal(np.asarray(lookup(form, ids, jnp.float32)), np.asarray(form.dequantize())[np.asarray(ids)])
    assert form.nbytes == 40 * 4200 * 2 + 4 and Q.is_quantized(blocks)


def test_the_model_layer_imports_no_quantisation():
    """model < quant: `linear` reads every stored form through the protocol, never a concrete one."""
    code = "import sys, gemmax.model.forward, gemmax.model.linear; print(any(m.startswith('gemmax.quant') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_cpu_one_row_form_reads_the_stored_weight_in_fused_dots(kind):
    """The measured fast form: XLA:CPU reads int8 / packed int4 weights inside its fused matrix-vector
    dot (unpack, convert and scale fused), never through a materialised dequantised copy."""
    for k in (384, 6144):  # one block; and column blocks as prepare_params stores them
        w = _weight(512, k, dtype=jnp.bfloat16)
        qw = Q.quantize_int8(w, "cpu") if kind == "int8" else Q.quantize_int4(w, "cpu")
        form = qw if k < 4095 else split_columns(qw, column_blocks(k))
        x = jax.ShapeDtypeStruct((1, 1, k), jnp.float32)
        reads = decode_weight_reads(jax.jit(linear).lower(x, form).compile().as_text())
        data = {name: kinds for name, kinds in reads.items() if ".q" in name or ".packed" in name}
        assert len(data) == (1 if form is qw else len(form)), reads
        for kinds in data.values():  # int8: one dot; int4: one dot per nibble plane
            assert set(kinds) == {GEMV} and COPY not in kinds and len(kinds) == (1 if kind == "int8" else 2), reads


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_kernel_in_interpret_mode_equals_the_xla_reference(dtype):
    """The fused W4A16 Pallas kernel (interpret mode: the CPU simulator) against the XLA path that
    dequantises then multiplies, on two packing chunks, M not a multiple of bm, several N blocks."""
    w = _weight(64, 6144, seed=5, dtype=dtype)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((5, 6144), dtype=np.float32)).astype(dtype)
    reference = Q.quantize_int4(w, "xla")
    fused = Q.quantize_int4(w, "pallas_interpret", W4Tiles(bm=8, bn=32, bk=512))
    assert reference.chunks == (3072, 3072) and reference.group == 128
    want = np.asarray(jax.jit(linear)(x, reference), np.float32)
    got = np.asarray(jax.jit(linear)(x, fused), np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # and one chunk straight through the kernel, with a K step of several groups
    w1 = Q.quantize_int4(_weight(32, 512, seed=7))
    x1 = jnp.asarray(np.random.default_rng(8).standard_normal((3, 512), dtype=np.float32))
    # (its K steps in a loop, as on a GPU, and unrolled, as on a TPU)
    for unrolled in (False, True):
        y1 = w4a16_matmul(x1, w1.packed, w1.scales, group=w1.group, tiles=W4Tiles(8, 16, 256), interpret=True,
                          unrolled=unrolled)
        np.testing.assert_allclose(np.asarray(y1), np.asarray(x1) @ np.asarray(w1.dequantize()).T, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------- fit check


def _block_total(bm: int, bn: int, k_step: int, stages: int = 2, group: int = 128) -> int:
    """Per-block bytes spelled out: x tile, packed tile, scales, fp32 accumulator, bf16 output."""
    x, packed, scales = bm * k_step * 2, bn * k_step // 2, bn * (k_step // group) * 2
    return stages * (x + packed + scales) + bm * bn * 4 + bm * bn * 2


def test_tpu_tiles_are_refused_on_sm75_with_the_arithmetic(e2b):
    limit = SMEM_PER_BLOCK["7.5"]
    assert limit == 64 * 1024
    with pytest.raises(W4A16FitError) as refusal:
        check_w4a16_fits(e2b, TPU_TILES, limit)
    message = str(refusal.value)
    # E2B's o projection chunk [N=1536, K=2048]: bn 512, a K step of 2048 -> 1.2 MiB per block
    largest = _block_total(16, 512, 2048)
    assert largest == 1_261_568
    for number in ("65,536", f"{largest:,}", "layers.0.o", "N=1536, K=2048", "16x512x2048x2"):
        assert number in message, (number, message)
    # the same tiles fit a TPU core's scoped VMEM (whole-K blocks there)
    assert check_w4a16_fits(e2b, TPU_TILES, TPU_SCOPED_VMEM, platform="tpu").largest.total < TPU_SCOPED_VMEM


def test_a_tiling_that_fits_sm75_is_accepted_and_auto_tiles_fit_every_device(e2b):
    fit = check_w4a16_fits(e2b, W4Tiles(16, 128, 256), SMEM_PER_BLOCK["7.5"])
    assert fit.largest.total == _block_total(16, 128, 256) == 62_464 <= 65_536
    for cc, limit in SMEM_PER_BLOCK.items():
        chosen = check_w4a16_fits(e2b, None, limit)
        assert chosen.largest.total <= limit, cc
        assert all(b.total <= limit for b in chosen.blocks)
    assert check_w4a16_fits(e2b, None, SMEM_PER_BLOCK["7.5"]).tiles == W4Tiles(16, 128, 256)
    with pytest.raises(W4A16FitError, match="no W4A16 tiling fits"):
        check_w4a16_fits(e2b, None, 4 * 1024)


def test_resolve_picks_pallas_tiles_on_gpu_and_refuses_interpret_mode_on_cpu(e2b):
    w4 = Q.QuantOptions(quant="w4a16")
    turing = Q.resolve(w4, "gpu", "7.5", e2b)
    assert turing.options.w4a16_kernel == "pallas" and turing.options.w4a16_tiles == W4Tiles(16, 128, 256)
    assert "62,464" in turing.note
    with pytest.raises(W4A16FitError, match="65,536"):
        Q.resolve(Q.QuantOptions(quant="w4a16", w4a16_tiles=TPU_TILES), "gpu", "7.5", e2b)
    assert Q.resolve(w4, "cpu", None, e2b).options.w4a16_kernel == "cpu"
    assert Q.resolve(w4, "cpu").kernel == "cpu" and Q.resolve(w4, "tpu", None, e2b).kernel == "xla"
    with pytest.raises(Q.QuantError, match="interpret"):
        Q.resolve(Q.QuantOptions(quant="w4a16", w4a16_kernel="pallas"), "cpu", None, e2b)
    allowed = Q.resolve(Q.QuantOptions(quant="w4a16", w4a16_kernel="pallas", allow_pallas_interpret=True), "cpu", None, e2b)
    assert allowed.options.w4a16_kernel == "pallas_interpret"


def test_options_are_validated():
    for bad in (dict(quant="int4"), dict(ple_bits=6), dict(kv_cache="fp8"), dict(w4a16_kernel="triton")):
        with pytest.raises(Q.QuantError):
            Q.QuantOptions(**bad)
    assert Q.QuantOptions(quant="int8", ple_bits=4, int8_lm_head=True, kv_cache="int8").label == "int8+ple4+int8_lm_head+kv_int8"
    assert W4Tiles.parse("16x128x256") == W4Tiles(16, 128, 256, 2)
    with pytest.raises(ValueError, match="BMxBNxBK"):
        W4Tiles.parse("16x128")


# ------------------------------------------------------------------------------------------- bytes


def test_e2b_weight_bytes_per_option(e2b):
    """Exact bytes from shapes (eval_shape through the real quantisers), against the arithmetic."""
    table = Q.weight_bytes_table(e2b)
    none = table["none"]
    assert none == weight_bytes(e2b, jnp.bfloat16) == 9_257_710_732
    specs = param_specs(e2b)
    matrix = sum(s.shape[0] * s.shape[1] for s in specs if s.kind == "matrix")
    rows = sum(s.shape[0] for s in specs if s.kind == "matrix")
    V, H = e2b.vocab_size, e2b.hidden_size
    ple = e2b.vocab_size_per_layer_input * e2b.num_layers * e2b.hidden_size_per_layer_input
    assert table["int8"] == none - 2 * matrix + matrix + 2 * rows  # int8 values + a bf16 scale per row
    assert table["w4a16"] == none - 2 * matrix + matrix // 2 + 2 * matrix // 128  # 4 bits + bf16 scale per 128
    assert table["ple8"] == none - 2 * ple + ple + 2 * ple // 256  # a bf16 scale per token per layer
    assert table["ple4"] == none - 2 * ple + ple // 2 + 2 * ple // 256
    assert table["int8_lm_head"] == none + V * H + 2 * V  # an extra int8 head; the bf16 table stays
    # The reference T4 deployment (ple4 + int8_lm_head): 6,155,450,950 bytes with norms in bf16;
    # gemmax keeps its 285,952 norm and 35 layer-scalar parameters in float32 (2 more bytes each).
    norms = sum(s.shape[0] for s in specs if s.kind in ("norm", "scalar"))
    assert norms == 285_952 + 35
    assert table["ple4+int8_lm_head"] == 6_155_450_950 + 2 * norms
    assert table["w4a16+ple4+int8_lm_head"] < table["int8+ple4+int8_lm_head"] < table["ple4+int8_lm_head"]


def test_fit_prints_weight_bytes_per_option(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(E2B))
    runner = CliRunner()
    text = runner.invoke(app, ["fit", "--model", str(config), "--device-memory-gib", "15", "--ple-bits", "4",
                               "--int8-lm-head", "--kv-cache-dtype", "int8"])
    assert text.exit_code == 0, text.output
    assert "6,156,022,924 B" in text.output  # the plan's weights: ple4 + int8_lm_head
    assert "KV cache (int8)" in text.output and "quantisation: ple4+int8_lm_head+kv_int8" in text.output
    for label in Q.BYTES_TABLE:
        assert label in text.output
    as_json = runner.invoke(app, ["fit", "--model", str(config), "--device-memory-gib", "15", "--quant", "w4a16", "--json"])
    assert as_json.exit_code == 0, as_json.output
    plan = json.loads(as_json.output)
    assert plan["weights"] == plan["weight_bytes_by_option"]["w4a16"] == 6_471_806_092
    assert plan["quant"] == "w4a16"
    bad = runner.invoke(app, ["fit", "--model", str(config), "--quant", "int4"])
    assert bad.exit_code != 0 and "quant must be one of" in bad.output


def _bf16_rows_times(x: jax.Array, qw) -> np.ndarray:
    """The exact product every int8 form computes: the bf16-rounded rows of x times the dequantised
    weight, transposed, in float64."""
    return np.asarray(x.astype(jnp.bfloat16), np.float64) @ np.asarray(qw.dequantize(), np.float64).T


def test_big_int8_matrices_at_batched_decode_rows_go_through_tiles():
    """An int8 matrix past the cache (2**24 parameters, like an LM head) at 4-8 rows is converted tile by
    tile and multiplied by the GEMM: the exact product of the bf16-rounded rows, and a row's result
    does not depend on the rows beside it. Fewer rows, or a matrix that fits the cache, stay row by row."""
    w = _weight(8192, 2048, seed=5, dtype=jnp.bfloat16)
    qw = Q.quantize_int8(w, "cpu")
    assert Q.tiled(4, (qw,)) and Q.tiled(8, (qw,)) and not Q.tiled(2, (qw,)) and not Q.tiled(9, (qw,))
    assert not Q.tiled(8, (Q.quantize_int8(_weight(1024, 2048), "cpu"),))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((8, 2048), dtype=np.float32))
    y = np.asarray(jax.jit(linear)(x, qw))
    exact = _bf16_rows_times(x, qw)
    np.testing.assert_allclose(y, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
    np.testing.assert_array_equal(np.asarray(jax.jit(linear)(x[4:], qw)), y[4:])
    rows = np.asarray(jax.jit(linear)(x[:2], qw))  # the row-by-row form
    np.testing.assert_allclose(rows, y[:2], rtol=0, atol=1e-5 * np.abs(exact).max())


def _reads(jaxpr, var) -> bool:
    """Whether any equation of a jaxpr (not nested) takes `var` as an input."""
    return any(var is v for e in jaxpr.eqns for v in e.invars)


@pytest.mark.parametrize("k", [640, 4600])  # one block; column blocks (prepare_params splits > GEMV_MAX_IN)
def test_int8_layer_matrices_multiply_their_bf16_copy_from_eight_rows(k, monkeypatch):
    """A layer matrix quantised for the CPU keeps its int8 values a second time in bf16 (exact), and
    from GEMM_MIN_ROWS rows (batched decode at 8 slots, prefill) the GEMM reads that copy, with no
    convert and no tile loop, for the exact product of the bf16-rounded rows; fewer rows read the int8
    values (the row form). The bytes each reads, and the bytes it holds, are counted apart. A CPU whose
    GEMM runs in float32, and float16 weights, keep no copy."""
    from gemmax.quant.int8 import GEMM_MIN_ROWS

    monkeypatch.setattr("gemmax.quant.int8.gemm_dtype", _bf16_gemm)  # whatever this host's CPU has
    qw = Q.quantize_int8(_weight(512, k, seed=11, dtype=jnp.bfloat16), "cpu", gemm_copy=True)
    assert qw.gemm.dtype == jnp.bfloat16 and qw.gemm.shape == qw.q.shape
    np.testing.assert_array_equal(np.asarray(qw.gemm, np.float32), np.asarray(qw.q, np.float32))
    form = qw if k < 4095 else split_columns(qw, column_blocks(k))
    for rows in (1, GEMM_MIN_ROWS - 1, GEMM_MIN_ROWS, 32):
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32))
        closed = jax.make_jaxpr(linear)(x, form)
        leaves = dict(zip([jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path((x, form))[0]],
                          closed.jaxpr.invars, strict=True))
        copies = [v for name, v in leaves.items() if name.endswith(".gemm")]
        ints = [v for name, v in leaves.items() if name.endswith(".q")]
        assert len(copies) == len(ints) == (1 if form is qw else 2), leaves
        gemm = rows >= GEMM_MIN_ROWS
        assert all(_reads(closed.jaxpr, v) == gemm for v in copies), (rows, closed)
        assert all(_reads(closed.jaxpr, v) != gemm for v in ints), (rows, closed)
        assert not gemm or not _scan_tiles(closed.jaxpr)
        y = np.asarray(jax.jit(linear)(x, form))
        exact = _bf16_rows_times(x, qw)
        np.testing.assert_allclose(y, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
    values, scales = 512 * k, 512 * 2
    assert qw.bytes_read(1) == qw.bytes_read(GEMM_MIN_ROWS - 1) == values + scales
    assert qw.bytes_read(GEMM_MIN_ROWS) == 2 * values + scales and qw.nbytes == 3 * values + scales
    assert Q.quantize_int8(_weight(512, k), "xla", gemm_copy=True).gemm is None  # GPU / TPU: the dot converts
    assert Q.quantize_int8(_weight(512, k, dtype=jnp.float16), "cpu", gemm_copy=True).gemm is None
    monkeypatch.setattr("gemmax.quant.int8.gemm_dtype", lambda dtype: "float32")
    assert Q.quantize_int8(_weight(512, k, dtype=jnp.bfloat16), "cpu", gemm_copy=True).gemm is None


def _bf16_gemm(dtype: str) -> str:
    """`gemm_dtype` on a CPU with bf16 dot instructions (the tests below patch it in, so they run the
    same on a host without them)."""
    return dtype


def test_cpu_int8_loads_hold_gemm_copies_of_layer_matrices_not_of_the_lm_head(e2b, monkeypatch):
    """The loader's quantiser gives every CPU int8 layer matrix its bf16 copy and the int8 LM head
    none (its batched rows go through tiles); the weight bytes a CPU load keeps (what `gemmax fit`
    plans on a CPU) are the device-independent int8 bytes plus 2 bytes a layer weight."""
    from gemmax.quant.plan import Quantizer

    monkeypatch.setattr("gemmax.quant.int8.gemm_dtype", _bf16_gemm)
    config = e2b
    options = Q.QuantOptions(quant="int8", int8_lm_head=True)
    quantizer = Quantizer.for_config(options, config, "cpu")
    matrices = [s for s in param_specs(config) if s.kind == "matrix"]
    stored = {s.path: quantizer.transform(s, _weight(*s.shape, dtype=jnp.bfloat16)) for s in matrices[:2]}
    assert all(w.gemm is not None for w in stored.values())
    head = quantizer.finish({"embed": _weight(64, 32, dtype=jnp.bfloat16)})["lm_head"]
    assert head.gemm is None
    cpu = Q.quantized_weight_bytes(config, options, kernel="cpu")
    copies = 2 * sum(math.prod(s.shape) for s in matrices)
    assert cpu - Q.quantized_weight_bytes(config, options) == copies


def test_fit_on_a_cpu_counts_and_names_the_int8_gemm_copies(tmp_path, monkeypatch):
    """`gemmax fit` plans what a load on this device keeps: on CPU the int8 layers' copies, named on the
    weights line with the flag that drops them; `--no-int8-gemm-copy` plans the device-independent bytes."""
    monkeypatch.setattr("gemmax.quant.int8.gemm_dtype", _bf16_gemm)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(E2B))
    e2b = ModelConfig.from_hf_config(E2B)
    options = Q.QuantOptions(quant="int8", int8_lm_head=True)
    lean = dataclasses.replace(options, int8_gemm_copy=False)
    kernel = "cpu" if jax.default_backend() == "cpu" else "xla"
    runner = CliRunner()
    args = ["fit", "--model", str(config), "--device-memory-gib", "64", "--quant", "int8", "--int8-lm-head"]
    plan = json.loads(runner.invoke(app, [*args, "--json"]).output)
    assert plan["weights"] == Q.quantized_weight_bytes(e2b, options, kernel=kernel)
    assert plan["weight_copies"] == plan["weights"] - Q.quantized_weight_bytes(e2b, lean, kernel=kernel)
    assert plan["weight_copies"] > 0 if kernel == "cpu" else plan["weight_copies"] == 0
    assert ("int8 GEMM copies (--no-int8-gemm-copy drops them)" in runner.invoke(app, args).output) == (kernel == "cpu")
    plan = json.loads(runner.invoke(app, [*args, "--json", "--no-int8-gemm-copy"]).output)
    assert plan["weights"] == Q.quantized_weight_bytes(e2b, options) and plan["weight_copies"] == 0


def test_decode_traffic_counts_what_each_row_count_reads_of_int8_matrices(e2b, monkeypatch):
    """The roofline's bytes per step: a CPU int8 load reads its int8 values (and scales) at batch 1 and
    its bf16 copies from 8 rows, whatever it holds; a verify step's rows (batch x (k + 1)) decide it."""
    from gemmax.engine.memory import decode_traffic
    from gemmax.model.params import abstract_params

    monkeypatch.setattr("gemmax.quant.int8.gemm_dtype", _bf16_gemm)

    def load(copies: bool):
        options = Q.QuantOptions(quant="int8", int8_gemm_copy=copies)
        return jax.eval_shape(lambda p: Q.quantize_params(p, e2b, options, "cpu"), abstract_params(e2b, jnp.bfloat16))

    held, lean = load(True), load(False)
    assert Q.gemm_copy_bytes(held) > 0 == Q.gemm_copy_bytes(lean)
    weights = sum(math.prod(s.shape) for s in param_specs(e2b) if s.kind == "matrix")
    one, eight = decode_traffic(e2b, held, 1, 128), decode_traffic(e2b, held, 8, 128)
    assert one.matrices == decode_traffic(e2b, lean, 1, 128).matrices == decode_traffic(e2b, lean, 8, 128).matrices
    assert eight.matrices - one.matrices == weights  # 2 bytes a weight instead of 1
    assert decode_traffic(e2b, held, 1, 128, rows=8).matrices == eight.matrices


def _scan_tiles(jaxpr) -> list[tuple[int, ...]]:
    """The int8 tile shape each scan of a jaxpr steps over ([tile rows, inputs] per step)."""
    return [tuple(e.invars[-1].aval.shape[1:]) for e in jaxpr.eqns if e.primitive.name == "scan"]


@pytest.mark.parametrize("out,k", [(2048, 640), (1536, 12288)])
def test_int8_prefill_converts_tile_by_tile_even_for_wide_matrices(out, k):
    """A prefill (more rows than the row-by-row form takes) converts an int8 matrix a tile of output rows
    at a time inside a loop, each tile at most PREFILL_TILE_PARAMS weights or 64 rows, never the whole
    matrix at once (a 12288-wide matrix not split into column blocks was converted whole), and
    computes the exact product of the bf16-rounded rows."""
    from gemmax.quant.int8 import PREFILL_TILE_PARAMS

    qw = Q.quantize_int8(_weight(out, k, seed=7, dtype=jnp.bfloat16), "cpu")
    x = jnp.asarray(np.random.default_rng(8).standard_normal((32, k), dtype=np.float32))
    tiles = _scan_tiles(jax.make_jaxpr(linear)(x, qw).jaxpr)
    assert len(tiles) == 1, tiles
    rows, inputs = tiles[0]
    assert inputs == k and 64 <= rows < out and rows * k <= max(PREFILL_TILE_PARAMS, 64 * k), tiles
    y = np.asarray(jax.jit(linear)(x, qw))
    exact = _bf16_rows_times(x, qw)
    np.testing.assert_allclose(y, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
