"""`--batch-invariant`: a request's greedy tokens and logprobs do not depend on what shares its batch.

Batched decode multiplies every weight by all active rows at once, which sums in another order than
a single stream's matrix-vector product; the logits then differ in the last bits and a greedy text
can flip at a near-tie (docs/server.md: the soak's corrupted texts before this mode existed). With
`batch_invariant` the engine decodes each row exactly as a single stream does, so the logprobs are
compared here for bit equality, not closeness."""

from __future__ import annotations

import numpy as np
import pytest

from gemmax.engine.api import GenerationRequest
from gemmax.engine.engine import BatchEngine
from gemmax.engine.loading import load_model


@pytest.fixture(scope="module")
def engine(hf_checkpoints, tmp_path_factory):
    # The device policy's dtypes (bf16 weights and KV cache on CPU): the serving configuration.
    loaded = load_model(str(hf_checkpoints["g4_shared"][0]))
    eng = BatchEngine(loaded, max_model_len=300, max_batch=3, buckets=(64,), steps_per_dispatch=2,
                      compile_cache_dir=str(tmp_path_factory.mktemp("xla")), batch_invariant=True,
                      warm_up=False).start()
    assert eng.wait_ready(300)
    yield eng
    eng.shutdown(drain_timeout=5)


def _decode(handles):
    out = []
    for handle in handles:
        events = list(handle)
        out.append(([e.token_id for e in events], np.array([e.logprob for e in events], np.float32)))
    return out


def test_greedy_tokens_and_logprobs_are_bit_identical_alone_and_batched(engine):
    """Four prompts alone (decode group 1), then together on three slots (groups of 2 and 3 as they
    start and finish), one of them long enough to read the larger KV-length bucket (row by row, each
    row's step reads the bucket its own context needs, as alone)."""
    assert engine.info["batch_invariant"] and engine.shapes.kv_buckets == (256, 300)
    rng = np.random.default_rng(3)
    lengths, budgets = [5, 12, 240, 3], [40, 24, 40, 32]
    prompts = [tuple(int(t) for t in rng.integers(3, 128, n)) for n in lengths]

    def requests():
        return [GenerationRequest(p, max_tokens=b, logprobs=0, ignore_eos=True)
                for p, b in zip(prompts, budgets, strict=True)]

    alone = [_decode([engine.submit(r)])[0] for r in requests()]
    together = _decode([engine.submit(r) for r in requests()])
    for (ids_a, lp_a), (ids_b, lp_b) in zip(alone, together, strict=True):
        assert ids_a == ids_b
        np.testing.assert_array_equal(lp_a, lp_b)  # bit-identical, not merely close



def test_serve_refuses_the_flag_with_a_mesh_before_loading_anything():
    """(tests/test_server_real.py starts a real `gemmax serve --batch-invariant` and reads /health.)"""
    from typer.testing import CliRunner

    from gemmax.cli import app

    refused = CliRunner().invoke(app, ["serve", "--model", "/no/such/model", "--batch-invariant", "--mesh", "dp=2"],
                                 env={"COLUMNS": "200"})
    assert refused.exit_code == 2 and "cannot be combined with --mesh" in refused.output
