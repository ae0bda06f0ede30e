"""`gemmax profile --speculative ngram`: the verify step against the decode step, and how many tokens
a verify step yields on a workload where prompt lookup pays.

Two measurements, joined by one formula:

- the verify step (`steps.verify_rows`: each row's last token and k proposals, k + 1 positions per
  row) is compiled for the run's [batch] rows, timed untraced and traced exactly like the decode step
  (`run.profile_decode`): the same op categories, bytes and roofline share;
- a short greedy generation through the engine's own speculative path (a `BatchEngine` with prompt
  lookup at k) gives the accepted-length distribution: how many verify steps kept 0, 1, ..., k
  proposals. A verify step emits its accepted proposals plus the target's draw after them, so it
  yields 1 + accepted tokens.

    predicted speed-up = tokens per verify step x decode step time / verify step time

with both step times on the host clock, untraced. It leaves out what the engine adds around a verify
step: the host round trip per step (the proposer needs the previous step's tokens, where plain decode
keeps its next step queued behind the one being delivered) and the back-off pauses of a request whose
proposals keep failing; the engine's own plain and speculative tok/s on the same prompt, measured in
the same run, show the figure with them.

The workload is the model's own text repeated, in token ids (so it needs no tokenizer and runs on
random weights): a fixed seeded prompt P, the model's greedy continuation O of P, then the prompt
P + O + P. A model that copies (a real one, by induction) continues with O again, which prompt lookup
finds in its context; a random model's greedy text usually settles into a loop, which lookup finds
too. Greedy speculative decoding must give the plain tokens, and the report says whether it did.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmax.engine.api import SPEC_KS, GenerationRequest, Speculation
from gemmax.engine.memory import decode_traffic
from gemmax.engine.policy import DevicePolicy
from gemmax.engine.shapes import kv_buckets
from gemmax.engine.steps import init_device_state, verify_rows
from gemmax.model.config import ModelConfig
from gemmax.model.forward import Precision
from gemmax.model.params import Params, count_bytes

PROMPT_TOKENS = 16  # P: bos and 15 seeded ids
WORKLOAD = ("the model's own text repeated: a seeded prompt P of {p} ids, O = the greedy continuation of P "
            "({n} tokens), then P + O + P ({prompt} tokens) generated greedily for {n} tokens, plainly and with "
            "prompt lookup")
VERIFY_BYTES_NOTE = "as the decode step's, with the embedding and PLE rows of k + 1 tokens per row"


def verify_executable(params: Params, config: ModelConfig, batch: int, context: int, k: int, precision: Precision):
    """The compiled verify step of [batch] rows, each at position `context` with k proposals, and the
    function that runs it n times back to back (positions reset to `context` after each step, every
    row active, every proposal offered, so every step does the same work)."""
    max_len = context + k + 1
    device = init_device_state(config, batch, max_len, precision, ring_slack=max(SPEC_KS))
    device = dataclasses.replace(device, tokens=jnp.full(batch, config.bos_token_id, jnp.int32),
                                 positions=jnp.full(batch, context, jnp.int32),
                                 remaining=jnp.full(batch, 1 << 30, jnp.int32))
    rows = jnp.arange(batch, dtype=jnp.int32)
    proposals = jnp.full((batch, k), config.bos_token_id, jnp.int32)
    counts = jnp.full(batch, k, jnp.int32)
    want = jnp.zeros(batch, jnp.bool_)
    compiled = verify_rows.lower(params, device, want, rows, proposals, counts, config=config, precision=precision,
                                 kv_len=kv_buckets(max_len)).compile()  # as the engine compiles it
    state = {"device": device}

    def run(n: int) -> None:
        device = state["device"]
        for _ in range(n):
            device, _ = compiled(params, device, want, rows, proposals, counts)
            device = dataclasses.replace(device, positions=jnp.full(batch, context, jnp.int32))
        state["device"] = device
        jax.block_until_ready(device.tokens)

    return compiled, run


def verify_traffic(config: ModelConfig, params: Params, batch: int, context: int, k: int, kv_dtype) -> dict[str, int]:
    """Bytes one verify step reads (VERIFY_BYTES_NOTE): the decode step's at `context`, with the
    gathered rows of batch x (k + 1) tokens and the matrices as batch x (k + 1) rows read them."""
    t = decode_traffic(config, params, batch, context, kv_dtype, rows=batch * (k + 1))
    t = dataclasses.replace(t, gathered=t.gathered * (k + 1))
    return {"matrices": t.matrices, "lm_head": t.lm_head, "gathered": t.gathered, "norms": t.norms, "kv": t.kv,
            "total": t.total}


def acceptance_run(params: Params, config: ModelConfig, policy: DevicePolicy, name: str, k: int,
                   tokens: int = 64, seed: int = 0) -> dict[str, Any]:
    """The accepted-length distribution of one greedy request through the engine's speculative path
    (prompt lookup at k) on the repeated-text workload (module docstring), and the engine's plain and
    speculative decode tok/s on the same prompt."""
    from gemmax.engine.engine import BatchEngine
    from gemmax.engine.loading import LoadedModel
    from gemmax.weights.checkpoint import Checkpoint

    if tokens < 2:
        raise ValueError(f"--spec-tokens must be >= 2, got {tokens}")
    vocab = config.vocab_size
    rng = np.random.default_rng(seed)
    head = [int(t) for t in rng.integers(max(3, vocab // 8), max(4, vocab // 2), PROMPT_TOKENS - 1)]
    first = [config.bos_token_id, *head]
    prompt_len = 2 * PROMPT_TOKENS - 1 + tokens
    max_model_len = -(-(prompt_len + tokens + 1) // 64) * 64
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"--spec-tokens {tokens} needs {max_model_len} positions; the model has "
                         f"{config.max_position_embeddings}")
    loaded = LoadedModel(checkpoint=Checkpoint(config, params, count_bytes(params), None), policy=policy, name=name)
    engine = BatchEngine(loaded, max_model_len=max_model_len, max_batch=1, buckets=(64,),
                         speculation=Speculation("off", k)).start()
    try:
        if not engine.wait_ready(1800):
            raise RuntimeError("the engine did not finish its warm-up in 30 min")

        def generate(prompt, spec):
            return engine.submit(GenerationRequest(tuple(prompt), tokens, speculative=spec, ignore_eos=True)).wait()

        continuation = generate(first, Speculation("off")).token_ids
        prompt = [*first, *continuation, *head]
        plain = generate(prompt, Speculation("off"))
        spec = generate(prompt, Speculation("ngram", k))
    finally:
        engine.shutdown(drain_timeout=5)
    stats = spec.speculation
    steps, proposed, accepted = (0, 0, 0) if stats is None else (stats.steps, stats.proposed, stats.accepted)
    lengths = [0] * (k + 1)
    for n, count in enumerate(() if stats is None else stats.accepted_lengths):
        lengths[n] += count
    plain_rate, spec_rate = plain.timings.decode_tokens_per_second, spec.timings.decode_tokens_per_second
    return {
        "workload": WORKLOAD.format(p=PROMPT_TOKENS, n=tokens, prompt=len(prompt)),
        "prompt_tokens": len(prompt),
        "generated_tokens": len(spec.token_ids),
        "tokens_match_plain": spec.token_ids == plain.token_ids,
        "verify_steps": steps,
        "proposed": proposed,
        "accepted": accepted,
        "accepted_lengths": lengths,
        "tokens_per_verify_step": 1 + accepted / steps if steps else None,
        "engine_plain_tokens_per_second": plain_rate,
        "engine_speculative_tokens_per_second": spec_rate,
        "engine_measured_speedup": spec_rate / plain_rate if plain_rate else None,
        "engine_compiled_during_run": plain.timings.uncompiled_shape or spec.timings.uncompiled_shape,
    }


def predicted_speedup(tokens_per_verify_step: float | None, decode_step_ms: float, verify_step_ms: float) -> float | None:
    """tokens per verify step x decode step time / verify step time (module docstring)."""
    if tokens_per_verify_step is None or verify_step_ms <= 0:
        return None
    return tokens_per_verify_step * decode_step_ms / verify_step_ms
