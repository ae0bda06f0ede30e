"""Continuous batching over a fixed set of decode slots.

Device state: one KV cache with `max_batch` rows of `max_model_len` positions (sliding layers keep a
ring), one SamplingState row per slot, and per-slot last token / position / remaining budget. The
compiled shapes are a small declared set, all compiled ahead of time by `warm_up` before the engine
reports ready (each then run on idle rows: XLA:CPU's first run of a program is slower), and kept
on disk as executables that the next start loads (gemmax.engine.executables). With `warm_up=False`
(`gemmax serve --no-warm-up`) the engine is ready once its state is allocated and each shape is
compiled, or loaded from the store, by the first request that needs it (which reports
`uncompiled_shape`), as llama.cpp's `--no-warmup` does:

    prefill[bucket]   tokens [1, bucket] into one slot; a prompt is split into chunks of the buckets
                      (`plan_chunks`: full chunks, then the rest in the bucket that wastes least)
    prefill_rows[g]   tokens [g, bucket] into g slots: g whole prompts of one bucket, each from
                      position 0, in one forward (rows x bucket within the largest bucket; g a
                      decode group size >= 2, >= 4 of the 32 bucket only with the CPU policy's
                      buckets; `ShapePlan.prefill_groups`): requests that arrive together are
                      prefilled together, reading the weights once, not g times
    prefix copies     with prefix caching on (`prefix_cache_bytes`), a cached prefix is copied into
                      the slot before the rest of the prompt is prefilled (gemmax.engine.prefix_cache:
                      per block-count bucket, compiled at warm-up, not run there)
    decode_forward    tokens [max_batch, 1], the forward of one step for every slot (idle slots
                      write nothing) -> logits [max_batch, V]; or of a group of k < max_batch slots
                      (k = 1, 2, 4, ...), used when few requests are running: a decode step's cost
                      grows with its batch. One program per group for every context length: each
                      layer reads the smallest KV-length bucket (256, 1024, 4096 ... max_model_len)
                      that holds the rows' context, a branch chosen on the device (`forward`)
    draw[k]           the sampler, one program per row count (the decode groups and the batched
                      prefills' row counts; every slot's reads its state where it lies, with no
                      gather): a prompt's first token from its last chunk's logits,
                      or a decode step's next tokens from decode_forward's. Every decode step is
                      these two dispatches (the sampler was about half of each fused step's compile
                      time; splitting cost nothing measurable per step), and one sampler serves
                      every prefill bucket, KV bound and decode group
    verify[k]         (speculative decoding only) tokens [g, k + 1] for each decode group g and each
                      proposal length k in SPEC_KS: one step scores k proposed tokens per row,
                      written into the rows' cache in place as a prefill chunk is
    x kv_len          a draft model's or MTP assistant's proposal step per KV-length bucket (a
                      batched prefill reads the smallest only): a step reads only the cache slots
                      its context can use (full layers; rings not yet wrapped). A
                      one-slot prefill chunk, a decode forward and a verify step choose their bucket
                      on the device instead, layer by layer (`forward`'s tuple of bounds): one
                      program for every context length

While a constrained request runs, the host fills each step's token masks while the forward runs
(`_decode_constrained`): `draw` with a mask (per group, and for a prompt's first token) compiles on
first use, not in warm-up (`_constrained_report`, docs/structured.md).

`max_tokens` is never part of a shape: a per-slot `remaining` counter stops a row on device. The
loop thread admits queued requests into free slots between decode dispatches (a prompt of several
chunks, prefilled alone while others decode, runs one chunk per loop iteration: `_prefilling`), then runs
up to `steps_per_dispatch` decode steps, LOOKAHEAD_STEPS of them in flight (the next one queued behind
the step whose tokens the host is delivering; JAX dispatch is asynchronous: the device never waits for
the host between them), streams each step's tokens as soon as that step is done, and frees the slots of
finished or cancelled requests at once. A dispatch ends early when no row owes more tokens or
(mask-free and constrained steps) a queued request could take a free slot; a request reaching an idle
engine waits a few ms for the rest of a burst (`_gather_burst`).

Across processes (`jax.distributed`, docs/mesh.md) the engine of process 0 schedules, and its device
calls (the `_replayed` methods) are sent to the other processes first, which run the same calls
(gemmax.engine.schedule).

Speculative decoding (`speculation`, docs/speculative.md): when a running request speculates and its
proposer has tokens to offer, the dispatch is one verify step of the decode group instead
(`_speculative_dispatch`); rows without proposals take one token from it as from a decode step.
With a draft model (`draft`, gemmax.engine.draft) the draft proposes on the device first
(`propose[g, k]` per decode shape, warmed like the verify step, and the draft's prefill per prefill
shape), and its cache follows each slot's accepted tokens. With Gemma 4's MTP assistant
(`assistant`, gemmax.engine.mtp) the device state also keeps each slot's last hidden state, and the
assistant proposes from it and the target's own KV cache (`mtp_propose[g, k]` per decode shape).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import threading
import time
import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gemmax.engine import compile_cache
from gemmax.engine.api import (
    SPEC_KS,
    Admission,
    EngineNotReady,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    InvalidRequest,
    RequestHandle,
    RequestTimings,
    Speculation,
    TokenEvent,
    validate_request,
)
from gemmax.engine.degeneracy import check_degeneracy
from gemmax.engine.draft import Drafter, check_draft
from gemmax.engine.executables import (
    STORE_DIR,
    CompiledSteps,
    ExecutableStore,
    LoadedProgramFailed,
    compile_threads,
)
from gemmax.engine.memory import MapBudget, check_fit, plan_memory
from gemmax.engine.mesh import check_mesh, make_mesh, mesh_steps, mesh_summary, shard_params
from gemmax.engine.mtp import MtpProposer, check_mtp
from gemmax.engine.prefix_cache import PrefixCache
from gemmax.engine.sampling import row_values
from gemmax.engine.schedule import IDLE, IDLE_SECONDS, STOP
from gemmax.engine.shapes import ShapePlan, plan_chunks
from gemmax.engine.speculative import RequestSpeculation
from gemmax.engine.steps import (
    DeviceState,
    decode_forward,
    draw,
    init_committed_state,
    prefill_rows,
    prefill_step,
    set_sampling_row,
    verify_rows,
)
from gemmax.model.config import ModelConfig
from gemmax.model.forward import Precision
from gemmax.quant.int8 import gemm_copy_bytes

log = logging.getLogger("gemmax.engine")

# Warm-up runs every declared program (`BatchEngine._first_runs`) except prefill chunks of more
# tokens than this: on the built-in model (bf16) a 512-token chunk ran in 0.6 s against 0.8 s of first-run
# set-up, and a chunk's compute grows with its tokens and the model while the set-up does not.
RUN_ONCE_TOKENS = 512
# A burst at an idle engine (`BatchEngine._gather_burst`): arrivals at most BURST_QUIET_SECONDS apart are
# admitted together, within BURST_WINDOW_SECONDS of the first.
BURST_QUIET_SECONDS = 0.003
BURST_WINDOW_SECONDS = 0.02
# Decode steps in flight: the one whose tokens the host is delivering and those queued behind it
# (`BatchEngine._decode_free`).
LOOKAHEAD_STEPS = 2
# Distinct host values `BatchEngine._on_device` keeps on the device (row sets and flags: a handful in
# steady state); past this many it starts again.
MAX_DEVICE_CONSTANTS = 256

# The jitted steps the engine runs as ahead-of-time executables (a mesh has no verify step)
COMPILED_STEPS = ("prefill_step", "prefill_rows", "draw", "decode_forward", "verify_rows")


def _replayed(method):
    """A device call of the engine. Across processes (a `schedule.Leader` attached) it is first sent
    to the other processes, which run the same call (`gemmax.engine.schedule.follow`); in one
    process this costs one attribute test."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.schedule is not None:
            self.schedule.send(method.__name__, args, kwargs)
        return method(self, *args, **kwargs)

    return call


@dataclasses.dataclass
class _Slot:
    """Host-side bookkeeping of one running request."""

    handle: RequestHandle
    request: GenerationRequest
    stop_ids: frozenset[int]
    budget: int  # tokens it may still produce (max_tokens capped by max_model_len)
    submitted: float
    admitted: float
    prefill_seconds: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    bucket_total: int = 0
    pad_tokens: int = 0
    prefill_batch: int = 1  # prompts prefilled in the forward of its last chunk (`_prefill_group`)
    uncompiled: bool = False
    cached_tokens: int = 0  # prompt tokens copied from the prefix cache, not prefilled
    tokens: list[int] = dataclasses.field(default_factory=list)
    matcher: Any = None  # llguidance matcher of a constrained request (gemmax.engine.constraints)
    speculation: RequestSpeculation | None = None  # made by its first decode dispatch, if it speculates


@dataclasses.dataclass
class _Prefilling:
    """A prompt being prefilled alone, chunk by chunk, into its slot (`BatchEngine._prefill_chunks`)."""

    slot: _Slot
    chunks: list[tuple[int, int]]  # (real tokens, bucket) of every chunk
    keys: list[bytes]  # its prefix-cache block keys ([] with caching off)
    mask: Any  # the first token's packed mask (a constrained request), or None
    start: int  # the position the next chunk starts at
    next: int = 0  # index of the next chunk
    out: Any = None  # the last chunk's outputs (the first token)


class BatchEngine:
    """The engine behind `gemmax serve`: implements gemmax.engine.api.Engine."""

    def __init__(self, loaded, max_model_len: int = 4096, max_batch: int = 8,
                 buckets: tuple[int, ...] | None = None, steps_per_dispatch: int = 4,
                 compile_cache_dir: str | None = None, max_queue: int | None = None, mesh=None,
                 batch_invariant: bool = False, schedule=None, prefix_cache_bytes: int | None = 0,
                 speculation: Speculation | None = None, draft=None, assistant=None, warm_up: bool = True):
        if batch_invariant and mesh is not None:
            raise ValueError("--batch-invariant runs on one device: it cannot be combined with --mesh")
        if speculation is not None and (mesh is not None or batch_invariant):
            raise ValueError("--speculative runs on one device without --batch-invariant: it cannot be combined "
                             "with --mesh or --batch-invariant")
        if mesh is not None:  # prefix caching runs on one device (its copies are not compiled for a mesh)
            if prefix_cache_bytes:
                raise ValueError("prefix caching runs on one device: give --prefix-cache-bytes 0 with --mesh")
            prefix_cache_bytes = 0
        # Speculative decoding: None (off: no verify shapes, plain rings), or the default of requests
        # that do not choose (method "off": only requests that ask speculate). Rings get k_max slots
        # of slack (gemmax.model.kv_cache), shown in the memory plan.
        if draft is not None and speculation is None:
            raise ValueError("a draft model drafts for speculative decoding: give --speculative draft (or "
                             "on-request) with --draft-model")
        if assistant is not None and speculation is None:
            raise ValueError("an MTP assistant drafts for speculative decoding: give --speculative mtp (or "
                             "on-request) with --draft-model")
        if assistant is not None and draft is not None:
            raise ValueError("one drafter per engine: a draft model or an MTP assistant, not both")
        if not warm_up and schedule is not None:
            raise ValueError("--no-warm-up runs in one process: every process of a schedule compiles the declared "
                             "shapes before process 0 serves")
        self.warm_up_before_ready = warm_up  # False: no declared shape compiled before ready, each on its first use
        self.speculation = speculation
        self.spec_ks: tuple[int, ...] = () if speculation is None else SPEC_KS
        # An MTP assistant's sliding layers see W + 1 positions back: one more slot (gemmax.engine.mtp).
        self.ring_slack = max(self.spec_ks, default=0) + (assistant is not None)
        self.loaded = loaded
        self.config: ModelConfig = loaded.checkpoint.config
        if max_model_len > self.config.max_position_embeddings:  # refused before anything is allocated
            raise ValueError(f"max_model_len {max_model_len:,} exceeds the {self.config.max_position_embeddings:,} "
                             "positions the model was made for (max_position_embeddings in its config)")
        policy = loaded.policy
        self.precision: Precision = policy.precision()
        self._max_model_len = max_model_len
        self.max_batch = max_batch
        # Batched prefill (several whole prompts in one forward) runs on one device, rows not invariant.
        self.shapes = ShapePlan.create(max_model_len, max_batch, buckets or policy.prefill_buckets,
                                       batched_prefill=mesh is None and not batch_invariant,
                                       batched_buckets=None if buckets else policy.prefill_batched_buckets,
                                       batched_min_rows=None if buckets else policy.prefill_batched_min_rows)
        # The draft model (None: none): its own cache, one row per slot, in the same shapes.
        self.drafter: Drafter | None = None
        if draft is not None:
            check_draft(loaded, draft)
            self.drafter = Drafter(draft, max_model_len, max_batch, policy.precision(), self.ring_slack, self.shapes)
        # The MTP assistant (None: none): no cache of its own, it reads the target's state.
        self.mtp: MtpProposer | None = None
        if assistant is not None:
            check_mtp(loaded, assistant)
            self.mtp = MtpProposer(assistant, self.config, policy.precision())
        # Refuse at start-up, with the arithmetic, a deployment that cannot fit the device.
        self.memory_plan = check_fit(plan_memory(
            self.config, max_model_len, max_batch, policy.device_memory_bytes, weight_dtype=policy.weight_dtype,
            kv_dtype=self.precision.kv_cache, activation_dtype=self.precision.activation,
            prefill_tokens=self.shapes.buckets[-1], weights=loaded.checkpoint.weight_bytes, model=loaded.name,
            mesh=mesh, prefix_cache_bytes=prefix_cache_bytes,
            ring_slack=self.ring_slack, draft_config=None if draft is None else draft.checkpoint.config,
            draft_weights=(0 if draft is None else draft.checkpoint.weight_bytes)
            + (0 if assistant is None else assistant.weight_bytes),
            weight_copies=gemm_copy_bytes(loaded.checkpoint.params)))
        self.params = loaded.checkpoint.params
        # The device steps: today's single-device ones, or the same steps compiled for a mesh
        # (`mesh`: a gemmax.engine.mesh.MeshSpec; its slots split over dp, weights as the rules say).
        self.steps = types.SimpleNamespace(prefill_step=prefill_step, prefill_rows=prefill_rows, draw=draw,
                                           decode_forward=decode_forward, verify_rows=verify_rows,
                                           init_device_state=init_committed_state)
        self.mesh = None
        if mesh is not None:
            check_mesh(mesh, self.config, max_batch)
            # Every decode step runs all slots: a smaller group would not split over dp.
            self.shapes = dataclasses.replace(self.shapes, decode_groups=(max_batch,))
            self.mesh = make_mesh(mesh)
            self.steps = mesh_steps(self.mesh, self.config, max_batch, max_model_len, self.precision)
            self.params = shard_params(self.params, self.config, self.mesh)
            log.info("%s", mesh_summary(mesh, self.config, self.mesh))
        # Compiled ahead of time (gemmax.engine.executables), not traced through a request.
        self.steps = CompiledSteps(self.steps, COMPILED_STEPS)
        self.steps_per_dispatch = steps_per_dispatch
        # Process 0 of several (`gemmax.engine.schedule.Leader`): every device call is sent to the
        # others before it runs; None in one process.
        self.schedule = schedule
        self.batch_invariant = batch_invariant  # decode row by row: a row's logits ignore its batch (steps.py)
        self.device: DeviceState | None = None  # allocated by warm-up
        self.prefix_cache_bytes = self.memory_plan.prefix_cache  # None (default) resolved by the plan
        self.prefix_cache: PrefixCache | None = None  # allocated at warm-up (0 bytes: off)
        self.want_logprobs = np.zeros(max_batch, np.bool_)  # per slot, host-side
        # host values already on the device, keyed by (dtype, shape, bytes): `_on_device`
        self._device_constants: dict[tuple, jax.Array] = {}
        self.compile_cache_dir = compile_cache_dir
        self.warmup_report: dict[str, Any] = {}
        self._ready = threading.Event()  # also set when warm-up failed (`wait_ready` raises then)
        self._closing = False
        self._lock = threading.Condition()
        self._queue: collections.deque[tuple[RequestHandle, float]] = collections.deque()
        self.admission = Admission(max_queue, max_batch)  # bounded wait queue (None: unbounded)
        self._slots: list[_Slot | None] = [None] * max_batch
        self._prefilling: dict[int, _Prefilling] = {}  # slot -> a prompt still prefilling into it (reserved)
        # (slot, handle, submitted) of the requests the running admission took from the queue: `_unplaced`
        self._admitting: list[tuple[int, RequestHandle, float]] = []
        # Bucket tokens of lone prefill chunks per loop iteration while others decode (at least one
        # chunk): a 521-token prompt (512 + 32 on CPU) still prefills at once, a 2,057-token one in 3 turns.
        self.prefill_token_budget = 2 * self.shapes.buckets[-1]
        self._budget_left = 0
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._drained = False  # the loop has ended its queue for good: `submit` refuses, under the lock
        self._rebuilding = False  # `_fail_all` is building a new state, or raised before it was whole
        self._info: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._constraints = None  # ConstraintCompiler, built by the first constrained request
        self._constrained_sizes: set[int] = set()  # group sizes of the masked sampler run so far (compiled lazily)

    # ------------------------------------------------------------------------------ Engine protocol
    @property
    def ready(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return self._ready.is_set() and not self._closing and self.error is None and alive

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    @property
    def info(self) -> dict[str, Any]:
        """Static facts (computed once warm-up is done; before that, from what is loaded so far; its
        `warmup` is the report at ready), which constrained-decoding shapes have compiled so far,
        and the compiled programs' counts now (`executables_now`: `CompiledSteps.summary`)."""
        if self._info is None:
            info = self._describe()
            if self._ready.is_set():
                self._info = info
        else:
            info = self._info
        return {**info, "constrained_decode": self._constrained_report(), "executables_now": self._executables_summary()}

    def _constrained_report(self) -> dict[str, Any]:
        """Constrained decoding's own shapes (`draw` with a mask, per group) are not warmed
        up: warm-up compiles only what every request can need (start-up time matters to everyone,
        constraints to some), so a constrained request whose draw has no program yet compiles it
        (seconds on CPU) and says so in its timings (`uncompiled_shape`, set where the draw's
        program table grew: a group of one row draws with the program a constrained prompt's first
        token compiled). `shapes_compiled`: the decode group sizes that have decoded constrained,
        whose masked draws exist by then (a request that ends at its first token compiles a masked
        draw without decoding: not counted)."""
        declared = len(self.shapes.decode_groups)
        return {"warmed_up": False, "shapes_declared": declared, "shapes_compiled": len(self._constrained_sizes)}

    def _describe(self) -> dict[str, Any]:
        device = self.device  # read once: warm-up and `_fail_all` replace it while /health asks
        policy = self.loaded.policy.observed(self.params, None if device is None else device.cache)
        return {
            "model": self.loaded.name,
            "family": self.config.family,
            "vocab_size": self.config.vocab_size,
            "policy": policy.as_dict(),
            "precision": {
                "weights": policy.weights, "activations": policy.activations, "kv_cache": policy.kv_cache,
                "compute_dtype": policy.compute_dtype, "pre_ampere": policy.pre_ampere,
            },
            "weight_bytes": self.loaded.checkpoint.weight_bytes,
            "memory_plan": self.memory_plan.as_dict(),
            "max_model_len": self.max_model_len,
            "max_batch": self.max_batch,
            "prefill_buckets": list(self.shapes.buckets),
            "prefill_groups": [list(group) for group in self.shapes.prefill_groups],
            "steps_per_dispatch": self.steps_per_dispatch,
            "batch_invariant": self.batch_invariant,
            "decode_groups": list(self.shapes.decode_groups),
            "kv_buckets": list(self.shapes.kv_buckets),
            "prefix_cache": None if self.prefix_cache is None else self.prefix_cache.describe(),
            "speculative": None if self.speculation is None else {
                "default": dataclasses.asdict(self.speculation), "k": list(self.spec_ks), "ring_slack": self.ring_slack,
                "draft": None if self.drafter is None else self.drafter.describe(),
                "mtp": None if self.mtp is None else self.mtp.describe()},
            "warmup": self.warmup_report,
        }

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        return self.submit_all([request], loop)[0]

    def submit_all(self, requests: Sequence[GenerationRequest],
                   loop: asyncio.AbstractEventLoop | None = None) -> list[RequestHandle]:
        if not self.ready:
            raise EngineNotReady("engine is not ready (loading, warming up or shutting down)")
        checked = []
        for request in requests:
            validate_request(request, max_model_len=self.max_model_len, vocab_size=self.config.vocab_size,
                             spec_ks=self.spec_ks, draft=self.drafter is not None, mtp=self.mtp is not None)
            if request.speculative is None and self.speculation is not None:  # the engine's default
                request = dataclasses.replace(request, speculative=self.speculation)
            if self.schedule is not None and request.constraint is not None:  # its split step is not replayed
                raise InvalidRequest(request.constraint.param, "constrained output is not served across processes "
                                     "yet (docs/mesh.md): serve it from one process", "unsupported")
            checked.append(request)
        handles = [RequestHandle(f"req-{next(self._ids)}", request, loop) for request in checked]
        with self._lock:
            if self._drained:  # the loop stopped after `ready` was read above: nothing would take it
                raise EngineNotReady("engine is not ready (shutting down, or its loop failed)")
            # QueueFull (503 + Retry-After) at the bound. The slots in use counted from one snapshot
            # of the placed requests, as `stats` counts them (the loop places requests without the
            # lock), the prompts an admission took and has not placed yet among them.
            placed = self._placed()
            in_use = len(placed) + len(self._unplaced(self._admitting, placed))
            self.admission.check(len(self._queue), self.max_batch - in_use)
            arrival = time.perf_counter()
            self._queue.extend((handle, arrival) for handle in handles)
            self._lock.notify()
        return handles

    def stats(self) -> EngineStats:
        """What is running and waiting now; the prefix cache's figures only once warm-up is done
        (/metrics exports its counters as Prometheus counters, which must never go down: warm-up's
        throwaway requests count, then its `clear` zeroes them; a warm-up that failed never clears).
        Running counts the prompts being prefilled too: alone (`_prefilling`), and those an admission
        took and has not placed yet (a batched group during its whole forward), which `shutdown`'s
        drain must wait for."""
        with self._lock:
            placed = self._placed()
            running = len(placed) + len(self._unplaced(self._admitting, placed))
            # the report is written by a warm-up that succeeded, after its `clear`; a failed one writes none
            shown = self.prefix_cache is not None and bool(self.warmup_report)
            return EngineStats(running=running, waiting=len(self._queue), slots_in_use=running,
                               slots_total=self.max_batch, prefix_cache=self.prefix_cache.stats() if shown else None)

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        self._closing = True
        deadline = time.monotonic() + drain_timeout
        while time.monotonic() < deadline:
            stats = self.stats()
            if stats.running == 0 and stats.waiting == 0:
                break
            time.sleep(0.01)
        with self._lock:
            for handle, _ in self._queue:
                handle.cancel()
            for slot in [*self._slots, *(entry.slot for entry in list(self._prefilling.values()))]:
                if slot is not None:
                    slot.handle.cancel()
            # what the running admission took (a batched group in its forward, the prompts after it);
            # cancel is idempotent, so those it already placed or put back may be cancelled twice
            for _, handle, _ in self._admitting:
                handle.cancel()
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, background: bool = True) -> BatchEngine:
        """Warm up (compile every declared shape; with `warm_up=False` only allocate the state), then run
        the scheduling loop."""
        if background:
            self._thread = threading.Thread(target=self._run, name="gemmax-engine", daemon=True)
            self._thread.start()
        else:
            if self.schedule is not None:  # only the background thread tells the followers to stop
                raise ValueError("an engine followed by other processes starts in the background")
            self._warm_up()
            self._thread = threading.Thread(target=self._loop, name="gemmax-engine", daemon=True)
            self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        if self.error is not None:
            raise RuntimeError(f"engine failed to start: {self.error}") from self.error
        return self._ready.is_set()

    def _run(self) -> None:
        try:
            try:
                self._warm_up()
            except BaseException as exc:  # surfaced through wait_ready / health
                self.error = exc
                log.exception("engine warm-up failed")
                self._ready.set()
                return
            self._loop()
        finally:
            if self.schedule is not None:  # the other processes stop following
                self.schedule.send(STOP)

    @_replayed
    def _init_device_state(self) -> None:
        slack = (self.ring_slack,) if self.ring_slack else ()  # the mesh's init takes none (no speculation there)
        hidden = {"hidden": True} if self.mtp is not None else {}  # the assistant reads it; else none is kept
        self.device = self.steps.init_device_state(self.config, self.max_batch, self.max_model_len, self.precision,
                                                   *slack, **hidden)
        self.want_logprobs[:] = False
        if self.drafter is not None:
            self.drafter.reset()

    def _init_prefix_cache(self) -> None:
        """An empty prefix cache whose copy steps share the engine's executable store (its shapes are
        declared with the engine's; warm-up clears what the throwaway requests left in it)."""
        if not self.prefix_cache_bytes:
            return
        self.prefix_cache = PrefixCache(self.config, self.max_model_len, self.shapes.buckets[0],
                                        self.prefix_cache_bytes, self.precision.kv_cache)
        if not self.prefix_cache.capacity:
            log.warning("prefix cache off: %d bytes hold no block of %d tokens (%d bytes)", self.prefix_cache_bytes,
                        self.prefix_cache.block, self.prefix_cache.block_bytes)
            self.prefix_cache = None
            return
        self.prefix_cache.steps.store = self.steps.store

    def _warm_up(self) -> None:
        """Compile every declared shape ahead of time, several at once, each run on idle rows as
        soon as it is ready (`_first_runs`: XLA:CPU's first run of a program is slower; the runs overlap
        the next compiles); on one device each compiled step is kept in the compile cache's
        executable store, so the next start loads it instead. Then one throwaway request of the
        smallest bucket, twice, runs through the real admission and decode path, compiling the small
        helper kernels a request uses (slot updates, sampling rows). A program loaded from the store
        that fails its first run is compiled anew (`_first_runs`; the throwaway requests start over
        after `_fail_all`: each failure takes one program out of the store). Without `warm_up` only
        the state (and the prefix cache) is allocated: `_skip_warm_up`."""
        with compile_cache.track(self.compile_cache_dir) as tracker:
            started = time.perf_counter()
            if self.mesh is None and jax.process_count() == 1:
                self.steps.store = ExecutableStore(tracker.directory / STORE_DIR)
            self._init_device_state()
            self._init_prefix_cache()
            if not self.warm_up_before_ready:
                jax.block_until_ready(self.device)  # the state's allocation fails, if it does, before ready
                self._skip_warm_up(tracker, time.perf_counter() - started)
                return
            declared, maps = self._compile_declared()
            jax.block_until_ready(self.device)
            compiled = time.perf_counter()
            while True:  # each failure takes one program out of the store: the retries are bounded
                try:
                    self._warm_up_requests(maps)
                    break
                except LoadedProgramFailed as exc:  # logged by the step, which compiles it anew next time
                    self._fail_all(exc)  # the throwaway requests end, on a new state
            seconds = time.perf_counter() - started
        self._init_device_state()
        if self.prefix_cache is not None:  # the throwaway requests' blocks are not a real prompt's
            self.prefix_cache.clear()
        shapes = declared + self._drafter_programs()
        executables = self._executables_summary()
        tracker.hits += executables["executables_loaded"]  # a loaded executable is a cache hit too
        self.warmup_report = {"warm_up": True, "compile_seconds": seconds, "shapes": shapes,
                              "ahead_of_time_seconds": round(compiled - started, 3), **tracker.summary(),
                              **executables, "executables_never_run": self.steps.never_run()}
        log.info("warm-up: %d compiled shapes in %.2f s (%s)", shapes, seconds,
                 {**tracker.summary(), **executables})
        self._ready.set()

    def _warm_up_requests(self, maps: MapBudget) -> None:
        """After the declared programs' first runs: throwaway requests through the real admission and
        decode path, compiling the request path's small helper kernels (slot updates, sampling rows)
        on their first call and running the programs `_first_runs` leaves to them (the prefix cache's
        copies, a first batched group over RUN_ONCE_TOKENS), then the drafter's shapes."""
        self._throwaway_requests(self.shapes.buckets[:1])
        self._throwaway_requests(self.shapes.buckets[:1], max_tokens=1)
        self._throwaway_group()
        if self.drafter is not None or self.mtp is not None:
            self._warm_up_drafter(maps)
        jax.block_until_ready(self.device)

    def _executables_summary(self) -> dict[str, int]:
        """The executables of the engine's steps and of the prefix cache's copies (`CompiledSteps.summary`)."""
        return self.steps.summary(*(() if self.prefix_cache is None else (self.prefix_cache.steps,)))

    def _skip_warm_up(self, tracker: compile_cache.Tracker, seconds: float) -> None:
        """Ready with no declared shape compiled (`warm_up=False`; `seconds`: allocating the state):
        the persistent cache and the executable store are on, so each declared shape is compiled, or
        loaded, by the first call that needs it, in the engine's loop (every running request waits for
        it), and the requests of the step that compiled report `uncompiled_shape` (not those that wait
        beside another request's prefill, nor a draft model's or MTP assistant's own steps: plain
        jitted functions). No memory-map budget is checked ahead (`MapBudget`), and XLA:CPU's
        first-run set-up of each program falls on a request too."""
        copies = () if self.prefix_cache is None else self.prefix_cache.declared_calls(self.device.cache)
        declared = len(self._declared_calls()) + len(copies) + self._drafter_programs()
        executables = self._executables_summary()
        self.warmup_report = {"warm_up": False, "compile_seconds": 0.0, "setup_seconds": round(seconds, 3), "shapes": 0,
                              "shapes_declared": declared, "ahead_of_time_seconds": 0.0, **tracker.summary(),
                              **executables, "executables_never_run": 0}
        log.info("warm-up skipped (--no-warm-up): ready in %.2f s; each of the %d declared shapes is compiled, or "
                 "loaded from the store, by the first request that needs it (uncompiled_shape)", seconds, declared)
        self._ready.set()

    def _declared_calls(self) -> list[tuple[str, tuple, dict[str, Any]]]:
        """(step, args, statics) of every declared shape, built as the device calls build them: the
        one-slot prefill of every bucket and the batched ones, the sampler of every row count, the
        decode forward of every decode group, and the verify steps of speculative decoding (per
        group and k; with a drafter, `_warm_up_drafter`'s)."""
        calls = [("prefill_step", *self._prefill_args(np.zeros((1, bucket), np.int32), 0, 0, 1, True))
                 for bucket in self.shapes.buckets]
        calls += [("prefill_rows", *self._prefill_rows_args(np.zeros((rows, bucket), np.int32), np.arange(rows), 0,
                                                            np.zeros(rows, np.int32), True))
                  for rows, bucket in self.shapes.prefill_groups]
        # the draw of every row count a group or a batched prefill has, and of every slot (`rows` None)
        counts = {1, *self.shapes.decode_groups[:-1], *(rows for rows, _ in self.shapes.prefill_groups)}
        for rows in [*sorted(counts), None]:
            size = self.max_batch if rows is None else rows
            calls.append(("draw", *self._draw_args(self._logits_like(size), None if rows is None else np.arange(rows),
                                                   np.zeros(size, np.bool_), np.ones(size, np.bool_), advance=False)))
        calls += [("decode_forward", *self._forward_args(self._group_rows(None if size == self.max_batch else
                                                                          np.arange(size, dtype=np.int32))))
                  for size in self.shapes.decode_groups]
        if self.drafter is None and self.mtp is None:  # with a drafter every verify step takes q
            calls += [("verify_rows", *self._verify_args(np.arange(size, dtype=np.int32), np.zeros((size, k), np.int32),
                                                         np.zeros(size, np.int32)))
                      for size in self.shapes.decode_groups for k in self.spec_ks]
        return calls

    def _drafter_programs(self) -> int:
        """The programs `_warm_up_drafter` compiles: a draft model's prefill per bucket, its or the MTP
        assistant's proposal step per (group, KV bound, k), the verify step with q per (group, k)."""
        if self.drafter is None and self.mtp is None:
            return 0
        per_group_and_k = len(self.shapes.kv_buckets) + 1  # a proposal step per KV bound, then the verify step
        proposing = len(self.shapes.decode_groups) * len(self.spec_ks) * per_group_and_k
        return proposing + (0 if self.drafter is None else len(self.shapes.buckets))

    def _warm_up_drafter(self, maps: MapBudget) -> None:
        """The drafter's shapes, run once each (its steps are jitted, not ahead of time; a draft
        model's prefill at start 0 only, so its later chunks' past branches set up on first use): a
        draft model's prefill per bucket with a 1-token dummy chunk, then per decode group and k the
        proposal step at each KV bound (`_drafted`) and the target's verify step with q (all rows
        idle: nothing is kept); `maps` checked after each (`MapBudget`)."""
        if self.drafter is not None:
            for bucket in self.shapes.buckets:
                self.drafter.run_prefill(np.zeros((1, bucket), np.int32), 0, 0, 1)
                maps.check()
        for size in self.shapes.decode_groups:
            rows, counts = np.arange(size, dtype=np.int32), np.zeros(size, np.int32)
            for k in self.spec_ks:
                for kv_len in self.shapes.kv_buckets:
                    proposals, q = self._drafted(rows, {}, np.zeros((size, k), np.int32), k, kv_len)
                    maps.check()
                self._dispatch_verify(rows, proposals, counts, q, np.zeros(size, np.bool_))
                maps.check()

    def _drafted(self, rows: np.ndarray, drafting: dict[int, np.ndarray], table: np.ndarray, k: int, kv_len: int):
        """(proposals [g, k], q [g, k, V]) on the device from the engine's drafter, the draft model or
        the MTP assistant, for the rows j in `drafting` ({j: context}) of the group `rows`; the other
        rows' proposals are `table`'s."""
        if self.mtp is not None:
            return self.mtp.propose(self.params, self.device, rows, drafting, table, k, kv_len)
        return self.drafter.propose(rows, drafting, self.device.sampling, table, k, kv_len)

    @_replayed
    def _compile_declared(self) -> tuple[int, MapBudget]:
        """Compile (or load) every declared shape; each process of a mesh compiles its own. Returns
        how many shapes are declared, and the memory-map budget of the warm-up's programs (these
        and the drafter's), checked as each became ready."""
        # The compile threads lower from the state's shapes, never from the arrays the runs donate.
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding, weak_type=a.weak_type),
                             self.device)
        calls = [(name, _with_state(args, state), statics) for name, args, statics in self._declared_calls()]
        # refuse before the host's limit on memory maps aborts the process (`MapBudget`)
        maps = MapBudget(len(calls) + self._drafter_programs(), parallel=compile_threads(len(calls)))
        before = self.steps.summary()["executables"]

        def ready(name: str, args: tuple, statics: dict[str, Any]) -> None:
            maps.check(self.steps.summary()["executables"] - before)
            self._first_runs(name, args, statics)

        self.steps.compile_all(calls, then=ready)
        if self.prefix_cache is None:
            return len(calls), maps
        copies = self.prefix_cache.declared_calls(self.device.cache)
        self.prefix_cache.steps.compile_all(copies)
        return len(calls) + len(copies), maps

    def _first_runs(self, name: str, args: tuple, statics: dict[str, Any]) -> None:
        """Dispatch the first run of a declared step on the engine's idle rows (its dummy arguments from
        `_declared_calls`, the state swapped for the current one; warm-up allocates the state afresh
        afterwards). XLA:CPU builds the YNNPACK runtime of each GEMM fusion on a program's first run
        (`YnnFusionThunk`), not when it compiles or loads it: on the built-in model (bf16) that first run
        cost 0.4-0.8 s more than the next one for every prefill and batched decode program (a
        512-token chunk 1.37 s, then 0.59 s; a batch-4 decode step at KV bound 1024 0.78 s, then
        0.12 s), which the first request of each shape paid. That set-up is per branch of a program's
        conditionals, so a one-slot chunk's program runs at each start of `ShapePlan.warm_starts`,
        one per past its chunks can read (with start 0 only, the first 41-token request took 169 ms
        against 93 for the next: its second chunk was the first run of the 256-bound branch). A
        prefill chunk of more than RUN_ONCE_TOKENS tokens is not run: its compute would cost every
        start more than the set-up it saves the first such prompt. A program loaded from the store
        that fails its first run (`LoadedProgramFailed`) is compiled anew and run on a fresh state."""
        if name in ("prefill_step", "prefill_rows") and args[2].size > RUN_ONCE_TOKENS:  # tokens [rows, bucket]
            return
        runs = [args]
        if name == "prefill_step":
            tokens = np.zeros(args[2].shape, np.int32)
            runs = [self._prefill_args(tokens, 0, start, 1, True)[0]
                    for start in self.shapes.warm_starts(tokens.shape[1])]
        step = getattr(self.steps, name)
        for run in runs:
            try:
                self.device = step(*_with_state(run, self.device), **statics)[0]
                continue
            except LoadedProgramFailed:  # logged by the step
                pass
            # the failed run may have consumed the state: a new one (allocated outside the handler,
            # whose traceback holds the old), and the program compiled anew
            self.device = None
            self._init_device_state()
            self.device = step(*_with_state(run, self.device), **statics)[0]

    def _throwaway_requests(self, buckets: tuple[int, ...], max_tokens: int | None = None) -> None:
        """One request per bucket of `buckets`, prefilled into slot 0 and decoded to its end (by default
        through two decode dispatches and a bit)."""
        for bucket in buckets:
            prompt = (self.config.bos_token_id,) * min(bucket, self.max_model_len - 1)
            request = GenerationRequest(prompt, max_tokens=max_tokens or 2 * self.steps_per_dispatch + 1, ignore_eos=True,
                                        logprobs=1 if bucket == self.shapes.buckets[0] else None)
            self._prefill_into(0, RequestHandle("warm-up", request), time.perf_counter(),
                               *self._prefix_lookup(request))
            while self._slots[0] is not None:
                self._decode_dispatch()

    def _throwaway_group(self) -> None:
        """The smallest batched prefill shape, run once through `_prefill_group`, its rows decoded to
        their end: the batched admission path's own small kernels, as `_throwaway_requests` does for
        one prompt (the programs' first runs are `_first_runs`'s)."""
        if not self.shapes.prefill_groups:
            return
        rows, bucket = self.shapes.prefill_groups[0]
        request = GenerationRequest((self.config.bos_token_id,) * bucket, max_tokens=2, ignore_eos=True)
        self._prefill_group([(i, RequestHandle("warm-up", request), time.perf_counter(), [], None)
                             for i in range(rows)], (bucket,))
        while any(slot is not None for slot in self._slots):
            self._decode_dispatch()

    # ------------------------------------------------------------------------------ device calls
    @_replayed
    def _set_sampling_row(self, slot: int, sampling, prompt: list[int]) -> None:
        """Slot `slot`'s sampling settings (`sampling`: SamplingParams with its seed set) for `prompt`."""
        self.device = set_sampling_row(self.device, jnp.int32(slot), row_values(sampling, prompt, self.config.vocab_size))

    @_replayed
    def _set_slot(self, slot: int, **values: int) -> None:
        """Slot `slot`'s token, position or remaining budget (DeviceState.with_slot)."""
        self.device = self.device.with_slot(slot, **values)

    def _prefill_args(self, tokens: np.ndarray, slot: int, start: int, num_new: int,
                      last_chunk: bool) -> tuple[tuple, dict[str, Any]]:
        return ((self.params, self.device, jnp.asarray(tokens), jnp.int32(slot), jnp.int32(start), jnp.int32(num_new),
                 jnp.bool_(last_chunk)),
                {"config": self.config, "precision": self.precision, "kv_len": self.shapes.kv_buckets})

    @_replayed
    def _run_prefill(self, tokens: np.ndarray, slot: int, start: int, num_new: int, last_chunk: bool,
                     want_logprobs: bool, mask: np.ndarray | None = None):
        """One chunk of a one-slot prefill (steps.prefill_step), and on the prompt's last chunk its
        first token (`_first_tokens`); returns that token's outputs ([1]-shaped, still being computed;
        None before the last chunk) and whether a shape compiled now."""
        args, statics = self._prefill_args(tokens, slot, start, num_new, last_chunk)
        (self.device, logits), compiled = self.steps.prefill_step.run(*args, **statics)
        if not last_chunk:
            return None, compiled
        out, new = self._first_tokens(logits, np.asarray([slot]), np.asarray([want_logprobs]), mask)
        return out, compiled or new

    def _prefill_rows_args(self, tokens: np.ndarray, rows: np.ndarray, start: int, num_new: np.ndarray,
                           last_chunk: bool) -> tuple[tuple, dict[str, Any]]:
        return ((self.params, self.device, jnp.asarray(tokens), jnp.asarray(rows, jnp.int32), jnp.int32(start),
                 jnp.asarray(num_new), jnp.bool_(last_chunk)),
                {"config": self.config, "precision": self.precision, "kv_len": self.shapes.group_kv})

    @_replayed
    def _run_prefill_rows(self, tokens: np.ndarray, rows: np.ndarray, start: int, num_new: np.ndarray,
                          last_chunk: bool, want_logprobs: np.ndarray):
        """One chunk of a batched prefill (steps.prefill_rows), and on the prompts' last chunk their
        first tokens; returns those outputs per row (still being computed; None before the last
        chunk) and whether a shape compiled now."""
        args, statics = self._prefill_rows_args(tokens, rows, start, num_new, last_chunk)
        (self.device, logits), compiled = self.steps.prefill_rows.run(*args, **statics)
        if not last_chunk:
            return None, compiled
        out, new = self._first_tokens(logits, rows, want_logprobs, take=num_new > 0)
        return out, compiled or new

    def _on_device(self, value, dtype=None) -> jax.Array:
        """`value` (host) as a device array, transferred once per distinct value: a decode step's
        rows, flags and `advance` repeat step after step, and each fresh host-to-device copy is a
        round trip on the step's critical path (on a TPU v5e the engine's host work per step, these
        copies and the fetch of every output, exceeded the device's: docs/gpu.md, "Many users on a
        TPU v5e"). A device array passes through."""
        if isinstance(value, jax.Array):
            return value
        value = np.asarray(value, dtype)
        key = (value.dtype.str, value.shape, value.tobytes())
        if key not in self._device_constants:
            if len(self._device_constants) >= MAX_DEVICE_CONSTANTS:
                self._device_constants.clear()
            self._device_constants[key] = jnp.asarray(value)
        return self._device_constants[key]

    def _draw_args(self, logits: jax.Array, rows: np.ndarray | jax.Array | None, want_logprobs: np.ndarray,
                   take: np.ndarray | jax.Array, advance: bool, mask=None) -> tuple[tuple, dict[str, Any]]:
        return ((self.device, logits, self._on_device(want_logprobs),
                 None if rows is None else self._on_device(rows, np.int32), self._on_device(take),
                 self._on_device(advance, np.bool_), None if mask is None else jnp.asarray(mask)), {})

    def _first_tokens(self, logits: jax.Array, rows: np.ndarray, want_logprobs: np.ndarray,
                      mask: np.ndarray | None = None, take: np.ndarray | None = None):
        """Draw the first token of the prompts prefilled into `rows` from their last chunk's logits
        (steps.draw; rows with `take` false are padding, None: none is); (outputs per row, compiled
        now)."""
        take = np.ones(len(rows), np.bool_) if take is None else take
        args, _ = self._draw_args(logits, rows, want_logprobs, take, False, mask)
        (self.device, out), compiled = self.steps.draw.run(*args)
        return out[:4], compiled

    def _sample(self, logits: jax.Array, rows: jax.Array | None, want: jax.Array, take: jax.Array, mask=None):
        """Enqueue the draw of a decode step of the group `rows` (None: every slot) from its forward's
        `logits` (`_drawn_rows` gives rows, want and take); (its outputs per row, still being computed;
        whether its draw program compiled now)."""
        args, _ = self._draw_args(logits, rows, want, take, True, mask)
        (self.device, out), compiled = self.steps.draw.run(*args)
        return out, compiled

    def _logits_like(self, rows: int) -> jax.Array:
        """Zero logits [rows, V] f32 placed as a forward returns them (replicated on a mesh): the
        sampler programs are compiled ahead of the forwards that feed them."""
        zeros = jnp.zeros((rows, self.config.vocab_size), jnp.float32)
        return zeros if self.mesh is None else jax.device_put(zeros, NamedSharding(self.mesh, PartitionSpec()))

    def _group_rows(self, rows: np.ndarray | None) -> jax.Array | None:
        """A decode group's slots as the steps take them (None: every slot)."""
        return None if rows is None else self._on_device(rows, np.int32)

    def _forward_args(self, rows: jax.Array | None) -> tuple[tuple, dict[str, Any]]:
        """decode_forward's arguments for every slot (`rows` None) or the group `rows`: one program per
        group, which reads the smallest KV bucket that holds its rows' context (`forward`)."""
        return ((self.params, self.device, rows),
                {"config": self.config, "precision": self.precision, "kv_len": self.shapes.kv_buckets,
                 "row_invariant": self.batch_invariant})

    def _verify_args(self, rows: np.ndarray, proposals, num_proposed: np.ndarray, q=None,
                     drafted: np.ndarray | None = None) -> tuple[tuple, dict[str, Any]]:
        extra = () if q is None else (q, jnp.asarray(drafted))
        # the rows and log-prob flags repeat from step to step (`_on_device`); the proposals do not
        return ((self.params, self.device, self._on_device(self.want_logprobs), self._on_device(rows, np.int32),
                 jnp.asarray(proposals, jnp.int32), jnp.asarray(num_proposed, jnp.int32), *extra),
                {"config": self.config, "precision": self.precision, "kv_len": self.shapes.kv_buckets})

    @_replayed
    def _dispatch_decode(self, steps: int, want_logprobs: np.ndarray, rows: np.ndarray | None = None):
        """Enqueue `steps` decode steps back to back (nothing waits for the host in between) for all
        slots, or for the group `rows`, with log-probs for the slots `want_logprobs` [slots] marks;
        returns (each step's outputs, per slot or per row of `rows`, as device arrays still being
        computed; whether a program of these steps compiled or loaded now). Each step is two
        dispatches: the forward (logits), then the sampling."""
        outputs, compiled = [], False
        group, drawn = self._group_rows(rows), self._drawn_rows(rows, want_logprobs)
        for _ in range(steps):
            logits, forward_compiled = self._forward(group)
            out, draw_compiled = self._sample(logits, *drawn)
            outputs.append(out)
            compiled |= forward_compiled or draw_compiled
        return outputs, compiled

    def _drawn_rows(self, rows: np.ndarray | None, want_logprobs: np.ndarray) -> tuple[jax.Array | None, ...]:
        """`draw`'s rows, log-prob flags and rows taking part, for a decode step of every slot (`rows`
        None) or of the group `rows`: each distinct value sent to the device once (`_on_device`)."""
        if rows is None:
            return None, self._on_device(want_logprobs), self._on_device(np.ones(self.max_batch, np.bool_))
        return (self._on_device(rows, np.int32), self._on_device(want_logprobs[rows]),
                self._on_device(np.ones(len(rows), np.bool_)))

    def _forward(self, rows: jax.Array | None) -> tuple[jax.Array, bool]:
        """Enqueue the forward half of a decode step; (its logits, whether its program compiled or
        loaded now)."""
        args, statics = self._forward_args(rows)
        (self.device, logits), compiled = self.steps.decode_forward.run(*args, **statics)
        return logits, compiled

    def _mark_uncompiled(self, slot_of) -> None:
        """The running requests of the slots `slot_of` waited for a program compiled or loaded now:
        their timings say so (`uncompiled_shape`)."""
        for i in slot_of:
            if self._slots[i] is not None:
                self._slots[i].uncompiled = True

    def _decode_constrained(self, steps: int, rows: np.ndarray | None, slot_of) -> None:
        """`steps` decode steps while some row is constrained, pipelined as vLLM does: step n's
        forward is on the device while the host fills step n's masks (which need step n - 1's
        tokens, consumed by the matchers), then step n's sampling is enqueued with them and at once
        step n + 1's forward (its input is step n's token, already on the device), and only then
        are step n's ids fetched and delivered. The device waits for the host only where the
        host's work (fetch, deliver, masks) outlasts a forward.

        A row finished while the next forward is in flight was computed once more for nothing:
        `_finish` zeroes its budget before that step's sampling, which then leaves the row as it is
        (as the free path does with the steps already enqueued after a stop). As in `_decode_free`,
        no further forward is enqueued once a queued request could take a free slot: an arrival's
        prefill waits for the step being sampled, not the rest of the dispatch."""
        group, drawn = self._group_rows(rows), self._drawn_rows(rows, self.want_logprobs)
        self._constrained_sizes.add(len(slot_of))
        logits, compiled = self._forward(group)
        for n in range(steps):
            if n and all(self._slots[i] is None for i in slot_of):
                break  # every row has ended: the forward in flight was for nothing, and no more follow
            masks = jnp.asarray(self._constraint_masks(slot_of))
            out, draw_compiled = self._sample(logits, *drawn, masks)
            if compiled or draw_compiled:  # e.g. this group's masked draw compiled now
                self._mark_uncompiled(slot_of)
            last = n + 1 == steps or self._admission_waiting()
            if not last:
                logits, compiled = self._forward(group)
            self._deliver(out, slot_of)
            if last:
                break

    def _dispatch_verify(self, rows: np.ndarray, proposals, num_proposed: np.ndarray, q=None,
                         drafted: np.ndarray | None = None):
        """Enqueue one verify step of the group `rows` (steps.verify_rows, reading the KV bucket its
        rows' context needs); (its outputs per row of `rows`, as device arrays; whether its program
        compiled or loaded now). With a draft model: q [g, k, V] and `drafted` [g] (the rows whose
        proposals the draft drew from q)."""
        args, statics = self._verify_args(rows, proposals, num_proposed, q, drafted)
        (self.device, out), compiled = self.steps.verify_rows.run(*args, **statics)
        return out, compiled

    def _decode_group(self) -> np.ndarray | None:
        """The slots to step: None (all) when the smallest compiled group that holds every active slot
        is the full batch; else the active slots padded with idle ones up to that group size."""
        active = [i for i, slot in enumerate(self._slots) if slot is not None]
        size = self.shapes.group_size(len(active))
        if size == self.max_batch:
            return None
        idle = [i for i, slot in enumerate(self._slots) if slot is None]
        return np.asarray(active + idle[: size - len(active)], np.int32)

    # ------------------------------------------------------------------------------ scheduling
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stop and not self._queue and not self._busy():
                        if not self._lock.wait(None if self.schedule is None else IDLE_SECONDS):
                            break  # several processes, idle: tell the followers (below)
                    if self._stop:
                        break
                    if self._queue and not self._busy():  # arrivals at an idle engine
                        self._gather_burst()
                    idle = self.schedule is not None and not self._queue and not self._busy()
                if idle:
                    self.schedule.send(IDLE)
                    continue
                try:
                    self._continue_prefills()
                    self._admit()
                    self._reap_cancelled()
                    if self._decoding():
                        self._decode_dispatch()
                except Exception as exc:  # a real fault: fail the running requests, keep serving
                    log.exception("engine step failed")
                    self._fail_all(exc)
        except BaseException as exc:  # the loop itself died: never report ready again
            self.error = exc
            log.exception("engine loop died")
            raise
        finally:  # every request ends with a result, also at shutdown
            if self.error is not None:  # the loop died: nothing writes to its state again (`_finish`)
                self.device = None
            with self._lock:
                self._drained = True
                queued = list(self._queue)
                self._queue.clear()
            for handle, submitted in queued:
                self._finish_unstarted(handle, submitted)
            for entry in self._prefilling.values():
                self._finish_unstarted(entry.slot.handle, entry.slot.submitted,
                                       "cancelled" if self.error is None else "error")
            self._prefilling.clear()
            for i, slot in enumerate(self._slots):
                if slot is not None:
                    self._finish(i, "cancelled" if self.error is None else "error")

    def _gather_burst(self) -> None:
        """Called with the lock held when a request reaches an idle engine: wait while more arrive
        (each within BURST_QUIET_SECONDS of the last, for at most BURST_WINDOW_SECONDS, until the queue
        could fill every slot), so that a burst (clients that all sent their next request when their
        previous ones ended together) prefills as one batched group, not as the first request alone
        and the rest after it. A lone request waits BURST_QUIET_SECONDS."""
        deadline = time.perf_counter() + BURST_WINDOW_SECONDS
        seen = len(self._queue)
        while not self._stop and seen < self.max_batch:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._lock.wait(min(BURST_QUIET_SECONDS, left))
            if len(self._queue) == seen:
                return  # quiet: the burst is over
            seen = len(self._queue)

    def _admit(self) -> None:
        """Prefill queued requests into free slots: at most as many as there were free slots when
        this call began, so requests that finish at their first token (max_tokens=1) free slots for
        the next iteration, not this one, and the running requests' decode always gets its turn.
        Whole prompts that fit a batched prefill shape are prefilled several at once, one forward
        per group (`_prefill_group`); the others one at a time (`_prefill_into`), in arrival order.
        Every prompt is looked up in the prefix cache first, and its hit held until the end (`hold`):
        an earlier prompt's store never evicts it. A failure that rebuilds the state ends the admission:
        the prompts after it, and those of a batched group that were prefilled but not started when the
        state went (their KV went with it), go back to the head of the queue in arrival order
        (`_requeue`), so the next admission looks them up again (a new, empty pool) and none of them
        overtakes an earlier one. A fault that escapes the handler (the rebuild itself failed) first
        ends, with that fault, the requests taken here and not started: nothing else would (they are
        in no queue, slot or prefill), and their clients would wait forever."""
        with self._lock:  # cancelled requests leave the queue at once, free slot or not
            cancelled = [entry for entry in self._queue if entry[0].cancelled]
            for entry in cancelled:
                self._queue.remove(entry)
            free = self._free_slots()
            taken = [(slot, *self._queue.popleft()) for slot in free[: len(self._queue)]]
            self._admitting = taken
        for handle, submitted in cancelled:
            self._finish_unstarted(handle, submitted)
        try:
            units = self._admission_units(taken)
            for index, (buckets, entries) in enumerate(units):
                unstarted = None  # a group's prompts after a start that took the state (`_prefill_group`)
                try:
                    if buckets is None:
                        self._prefill_into(*entries[0])
                    else:
                        unstarted = self._prefill_group(entries, buckets)
                    rebuilt = unstarted is not None
                except Exception as exc:  # these requests end with the error, and only these (unless the state went)
                    log.exception("prefill of %s failed", ", ".join(entry[1].request_id for entry in entries))
                    rebuilt = self._recover_device_state(exc)
                    for slot, handle, submitted, *_ in entries:
                        self._fail_admission(slot, handle, submitted, exc)
                if rebuilt:  # a new state (and pool): what this admission has not started goes back
                    back = (unstarted or []) + [entry for _, later in units[index + 1:] for entry in later]
                    self._requeue(sorted(back, key=lambda entry: entry[2]))  # in arrival order
                    return
        except BaseException as exc:  # a fault the handler above could not contain (a rebuild that failed)
            self._end_unstarted(taken, exc)
            raise
        finally:
            with self._lock:
                self._admitting = []
            if self.prefix_cache is not None:
                self.prefix_cache.release()

    def _admission_units(self, taken: list) -> list[tuple[tuple[int, ...] | None, list]]:
        """The prefills of one admission's requests ((slot, handle, submitted)), in order of first
        arrival: (chunk buckets, entries) for a batched group, (None, [entry]) for a prompt alone,
        each entry (slot, handle, submitted, block keys, prefix hit). Every prompt is looked up in
        the prefix cache here and its hit held (`hold`) until `_admit` releases them."""
        groups: dict[tuple[int, ...], list] = {}  # prompts by the buckets of their chunks
        units: list[tuple[tuple[int, ...] | None, list]] = []
        for slot, handle, submitted in taken:
            keys, hit = self._prefix_lookup(handle.request)
            if hit is not None:  # held until this admission ends: no earlier prompt's store evicts it
                self.prefix_cache.hold(keys[:hit.blocks])
            entry = (slot, handle, submitted, keys, hit)
            buckets = None if hit is not None and hit.blocks else self._group_buckets(handle.request)
            if buckets is None:
                units.append((None, [entry]))
            else:
                groups.setdefault(buckets, []).append(entry)
        for buckets, entries in groups.items():
            while (size := self.shapes.prefill_group(len(entries), buckets)) is not None:
                units.append((buckets, entries[:size]))
                entries = entries[size:]
            units += [(None, [entry]) for entry in entries]
        units.sort(key=lambda unit: unit[1][0][2])  # by first arrival
        return units

    def _placed(self) -> set[int]:
        """ids of the handles prefilling alone or decoding. The loop thread changes both without the
        lock, so each is copied once, the prefills first: `_begin` puts a prompt in its slot before it
        takes it out of `_prefilling`, so one that moves between the copies is in one."""
        prefilling = [entry.slot.handle for entry in list(self._prefilling.values())]
        decoding = [slot.handle for slot in list(self._slots) if slot is not None]
        return {id(handle) for handle in (*prefilling, *decoding)}

    def _unplaced(self, taken: list, placed: set[int] | None = None) -> list:
        """The entries of `taken` ((slot, handle, submitted)) whose requests an admission took from the
        queue and that are nowhere yet: not ended, not back in the queue, and not in `placed` (default
        `_placed()`): a batched group's prompts until they start. Called with the lock held."""
        if not taken:
            return []
        placed = (self._placed() if placed is None else placed) | {id(handle) for handle, _ in self._queue}
        return [entry for entry in taken if entry[1].result is None and id(entry[1]) not in placed]

    def _end_unstarted(self, taken: list, exc: BaseException) -> None:
        """End with `exc` every request of `taken` that an admission took from the queue and left
        nowhere (`_unplaced`): those are the requests the loop's own handler and its final clean-up
        cannot see."""
        with self._lock:
            unplaced = self._unplaced(taken)
        error = f"{type(exc).__name__}: {exc}"
        for _, handle, submitted in unplaced:
            self._finish_unstarted(handle, submitted, "error", error)

    def _requeue(self, entries: list) -> None:
        """Put admitted but unstarted requests back at the head of the queue, in their order: the next
        admission looks their prompts up again (on a new state after `_fail_all`)."""
        with self._lock:
            for _, handle, submitted, *_ in reversed(entries):
                self._queue.appendleft((handle, submitted))

    def _fail_admission(self, slot_index: int, handle: RequestHandle, submitted: float, exc: Exception) -> None:
        """End the request `handle`, whose prefill into `slot_index` failed, with the error."""
        error = f"{type(exc).__name__}: {exc}"
        pending = self._prefilling.get(slot_index)
        if pending is not None and pending.slot.handle is handle:  # no more chunks for it
            del self._prefilling[slot_index]
        slot = self._slots[slot_index]
        if slot is not None and slot.handle is handle:
            self._finish(slot_index, "error", error=error)
        elif handle.result is None:
            self._finish_unstarted(handle, submitted, "error", error)

    def _chunks(self, prompt_len: int, cached: int = 0) -> list[tuple[int, int]]:
        """The chunks that prefill a prompt after `cached` tokens copied from the prefix cache: with
        prefix caching they start on block boundaries (gemmax.engine.prefix_cache), else `plan_chunks`."""
        if self.prefix_cache is None:
            return plan_chunks(prompt_len, self.shapes.buckets)
        return self.prefix_cache.plan(cached, prompt_len, self.shapes.buckets)

    def _group_buckets(self, request: GenerationRequest) -> tuple[int, ...] | None:
        """The buckets of a request's chunks when it can prefill in a batched group (with prompts
        of the same chunk buckets), or None when it prefills alone: its chunks have no batched
        shape, or its first token needs a constraint's mask."""
        if request.constraint is not None:
            return None
        return self.shapes.group_buckets(self._chunks(len(request.prompt_ids)))

    def _prefix_lookup(self, request: GenerationRequest):
        """(block keys, hit) of the request's prompt in the prefix cache; ([], None) with caching off."""
        if self.prefix_cache is None:
            return [], None
        keys = self.prefix_cache.keys(request.prompt_ids, request.cache_salt)
        return keys, self.prefix_cache.lookup(keys, len(request.prompt_ids))

    def _open_slot(self, slot_index: int, handle: RequestHandle, submitted: float, admitted: float) -> _Slot:
        """The host bookkeeping of a request about to be prefilled into `slot_index`, and its sampling
        settings in the slot (the prefill draws its first token with them)."""
        request = handle.request
        prompt = list(request.prompt_ids)
        stop_ids = frozenset(request.stop_token_ids) | (frozenset() if request.ignore_eos else frozenset(self.eos_token_ids))
        slot = _Slot(handle=handle, request=request, stop_ids=stop_ids,
                     budget=min(request.max_tokens, self.max_model_len - len(prompt)),
                     submitted=submitted, admitted=admitted)
        sampling = request.sampling
        if self.schedule is not None and sampling.seed is None:  # every process draws the same row key
            sampling = dataclasses.replace(sampling, seed=int(np.random.SeedSequence().entropy % (2**31)))
        self._set_sampling_row(slot_index, sampling, prompt)
        return slot

    def _begin(self, slot_index: int, slot: _Slot, token: int, lp: float, top_ids, top_lp) -> None:
        """A prefilled request starts decoding in its slot with its first token."""
        request = slot.request
        if self.drafter is not None and _drafts(request):  # the whole prompt (the prefix cache holds the target's KV)
            self.drafter.prefill(slot_index, list(request.prompt_ids))
        now = time.perf_counter()
        slot.prefill_seconds = now - slot.admitted
        self._slots[slot_index] = slot
        self._prefilling.pop(slot_index, None)  # a lone prompt leaves its prefill once its slot holds it (`_placed`)
        self.want_logprobs[slot_index] = request.logprobs is not None
        self._set_slot(slot_index, token=int(token), position=len(request.prompt_ids), remaining=0)
        if self._accept(slot_index, int(token), float(lp), top_ids, top_lp, now):
            # budget counts the token just produced; the device runs while tokens are still owed
            self._set_slot(slot_index, remaining=slot.budget - len(slot.tokens))

    def _prefill_group(self, entries: list, buckets: tuple[int, ...]) -> list | None:
        """Prefill the prompts of `entries` ((slot, handle, submitted, block keys, prefix hit), no
        hit), whose chunks all have `buckets`, chunk by chunk, each chunk of every prompt in one
        forward of the smallest batched shape that holds them (steps.prefill_rows; idle rows of the
        shape are other slots, which it leaves as they are), then start each one decoding. Every
        chunk but the last is full, so a chunk starts at the same position in every prompt. Returns
        None, or, when starting one failed and took the state with it (`_recover_device_state`), the
        entries after it, whose KV went with the old cache: `_admit` puts them back in the queue."""
        size = self.shapes.prefill_group(len(entries), buckets)
        admitted = time.perf_counter()
        slots = [self._open_slot(i, handle, submitted, admitted) for i, handle, submitted, *_ in entries]
        used = [entry[0] for entry in entries]
        rows = np.asarray(used + [i for i in range(self.max_batch) if i not in used][: size - len(entries)], np.int32)
        want = np.zeros(size, np.bool_)
        want[: len(slots)] = [slot.request.logprobs is not None for slot in slots]
        start, compiled = 0, False
        for index, bucket in enumerate(buckets):
            tokens, num_new = np.zeros((size, bucket), np.int32), np.zeros(size, np.int32)
            for j, slot in enumerate(slots):  # a full chunk, or the prompt's rest in its last one
                real = min(bucket, len(slot.request.prompt_ids) - start)
                tokens[j, :real], num_new[j] = slot.request.prompt_ids[start : start + real], real
            out, new = self._run_prefill_rows(tokens, rows, start, num_new, index == len(buckets) - 1, want)
            compiled |= new
            if self.prefix_cache is not None:  # the blocks this chunk completed, while the rings hold them
                for (i, _, _, keys, _), slot, real in zip(entries, slots, num_new, strict=False):
                    slot.uncompiled |= self.prefix_cache.store(self.device.cache, i, keys, start + int(real))
            start += bucket
        ids, lps, top_ids, top_lps = jax.device_get(out)
        for j, ((i, handle, submitted, _, hit), slot) in enumerate(zip(entries, slots, strict=True)):
            slot.uncompiled |= compiled
            slot.bucket_total, slot.prefill_batch = sum(buckets), len(entries)
            slot.pad_tokens = slot.bucket_total - len(slot.request.prompt_ids)
            if hit is not None:  # its lookup (a miss) counts now; a prompt put back below counts when it starts
                self.prefix_cache.record(hit, len(slot.request.prompt_ids))
            try:
                if handle.cancelled:  # the client went away during the prefill: the slot stays free
                    self._finish_unstarted(handle, submitted)
                    continue
                self._begin(i, slot, ids[j], lps[j], top_ids[j], top_lps[j])
            except Exception as exc:  # this request ends with the error, and only this one (unless the state went)
                log.exception("starting %s failed", handle.request_id)
                rebuilt = self._recover_device_state(exc)
                self._fail_admission(i, handle, submitted, exc)
                if rebuilt:
                    return entries[j + 1:]
        return None

    def _prefill_into(self, slot_index: int, handle: RequestHandle, submitted: float, keys: list[bytes],
                      hit) -> None:
        """Start prefilling one request's prompt alone into `slot_index`, after the prefix `hit`
        (from `_prefix_lookup`) copied from the prefix cache, chunk by chunk (`_chunks`). While
        other requests decode, one chunk runs now and each later one in a later loop iteration,
        between decode dispatches (`_continue_prefills`): a long prompt then never stalls the
        running requests for more than one chunk. With nothing decoding, every chunk runs now."""
        request = handle.request
        slot = self._open_slot(slot_index, handle, submitted, time.perf_counter())
        mask = None
        if request.constraint is not None:
            compiler = self._constraint_compiler()
            slot.matcher = compiler.matcher(request.constraint)
            mask = compiler.masks(1)
            compiler.fill_rows([(slot.matcher, 0)], mask)
        chunks = self._plan_prefill(slot_index, slot, list(request.prompt_ids), hit)
        self._prefilling[slot_index] = _Prefilling(slot, chunks, keys, mask, slot.cached_tokens)
        self._prefill_chunks(slot_index)

    def _decoding(self) -> bool:
        return any(slot is not None for slot in self._slots)

    def _busy(self) -> bool:
        """Some request is prefilling or decoding."""
        return bool(self._prefilling) or self._decoding()

    def _continue_prefills(self) -> None:
        """This loop iteration's chunks of the prompts still prefilling, in arrival order, within
        `prefill_token_budget` (shared with the prompts `_admit` starts next); a failure ends that
        request alone."""
        self._budget_left = self.prefill_token_budget
        for slot_index in list(self._prefilling):
            entry = self._prefilling.get(slot_index)
            if entry is None:  # ended by an earlier prompt's failure that took the state (`_fail_all`)
                continue
            try:
                self._prefill_chunks(slot_index)
            except Exception as exc:
                log.exception("prefill of %s failed", entry.slot.handle.request_id)
                self._recover_device_state(exc)
                self._fail_admission(slot_index, entry.slot.handle, entry.slot.submitted, exc)

    def _prefill_chunks(self, slot_index: int) -> None:
        """Run the next chunks of the prompt prefilling into `slot_index`: all of them when nothing
        decodes, else those this iteration's token budget holds (at least one); after its last
        chunk the request starts decoding (`_begin`)."""
        entry = self._prefilling[slot_index]
        slot, handle = entry.slot, entry.slot.handle
        prompt = slot.request.prompt_ids
        while entry.next < len(entry.chunks):
            if handle.cancelled:  # the client went away: no more prefill for it (the slot stays free)
                del self._prefilling[slot_index]
                self._finish_unstarted(handle, slot.submitted)
                return
            real, bucket = entry.chunks[entry.next]
            chunk = np.zeros((1, bucket), np.int32)
            chunk[0, :real] = prompt[entry.start : entry.start + real]
            last = entry.next == len(entry.chunks) - 1
            entry.out, compiled = self._run_prefill(chunk, slot_index, entry.start, real, last,
                                                    slot.request.logprobs is not None, entry.mask)
            slot.uncompiled |= compiled
            slot.bucket_total += bucket
            slot.pad_tokens += bucket - real
            entry.start += real
            entry.next += 1
            if self.prefix_cache is not None:  # the blocks this chunk completed, while the rings hold them
                slot.uncompiled |= self.prefix_cache.store(self.device.cache, slot_index, entry.keys, entry.start)
            self._budget_left -= bucket
            if not last and self._decoding() and self._budget_left < entry.chunks[entry.next][1]:
                return
        ids, lps, top_ids, top_lps = jax.device_get(entry.out)  # waits for the chunks: still prefilling
        self._begin(slot_index, slot, ids[0], lps[0], top_ids[0], top_lps[0])

    def _plan_prefill(self, slot_index: int, slot: _Slot, prompt: list[int], hit) -> list[tuple[int, int]]:
        """The chunks that prefill `prompt` into slot `slot_index`. With prefix caching the longest
        cached prefix (`hit`) is first copied into the slot (`slot.cached_tokens`) and the chunks
        start after it, each on a block boundary (gemmax.engine.prefix_cache)."""
        if hit is not None and hit.blocks:
            cache, compiled = self.prefix_cache.load(self.device.cache, slot_index, hit)
            self.device = dataclasses.replace(self.device, cache=cache)
            slot.uncompiled |= compiled
            slot.cached_tokens = hit.tokens
        if hit is not None:  # the lookup counts now that its blocks are copied and its prefill starts
            self.prefix_cache.record(hit, len(prompt))
        return self._chunks(len(prompt), slot.cached_tokens)

    def _constraint_compiler(self):
        """The llguidance compiler over this checkpoint's tokenizer (built once, on first use)."""
        if self._constraints is None:
            from gemmax.engine.constraints import ConstraintCompiler

            tokenizer = self.loaded.tokenizer
            if tokenizer is None:
                raise ValueError("constrained output needs the checkpoint's tokenizer, and this one has none")
            self._constraints = ConstraintCompiler(tokenizer.backend.to_str(), self.config.vocab_size,
                                                   self.eos_token_ids)
        return self._constraints

    def _constraint_masks(self, slot_of) -> np.ndarray:
        """The next step's packed masks per row of `slot_of`: each constrained row's matcher's
        allowed tokens; free and idle rows (and rows whose request ended) all ones."""
        compiler = self._constraint_compiler()
        masks = compiler.masks(len(slot_of))
        compiler.fill_rows([(self._slots[i].matcher, j) for j, i in enumerate(slot_of)
                            if self._slots[i] is not None and self._slots[i].matcher is not None], masks)
        return masks

    def _decode_dispatch(self) -> None:
        rows = self._decode_group()
        slot_of = range(self.max_batch) if rows is None else rows
        constrained = any(self._slots[i] is not None and self._slots[i].matcher is not None for i in slot_of)
        if not constrained and self.spec_ks and self._speculative_dispatch(slot_of):
            return
        # No step past the last token any row still owes: a finished request's tail steps would
        # delay the next request's prefill (a 64-token request used to compute 1 of its last 4 steps for nothing).
        steps = min(self.steps_per_dispatch, max(s.budget - len(s.tokens) for s in self._slots if s is not None))
        if constrained:
            self._decode_constrained(steps, rows, slot_of)
        else:  # the mask-free step: no row waits for the host's masks
            self._decode_free(steps, rows, slot_of)
        self._reap_cancelled()

    def _decode_free(self, steps: int, rows: np.ndarray | None, slot_of) -> None:
        """Up to `steps` mask-free decode steps, LOOKAHEAD_STEPS of them in flight (the device never
        waits for the host's delivery). No further step is enqueued once a queued request could take a
        free slot, or every row has ended: an arrival waits for the steps in flight, not the rest of
        the dispatch, before its prefill runs. Across processes every step of the dispatch is one
        replayed call, as before (each call costs the followers two broadcasts: docs/mesh.md)."""
        ahead = steps if self.schedule is not None else min(steps, LOOKAHEAD_STEPS)
        pending, compiled = self._dispatch_decode(ahead, self.want_logprobs, rows)
        if compiled:
            self._mark_uncompiled(slot_of)
        for _ in range(steps - ahead):
            self._deliver(pending.pop(0), slot_of)  # this step's tokens go out while the device runs the next
            self._reap_cancelled()
            if self._admission_waiting() or all(self._slots[i] is None for i in slot_of):
                break
            more, compiled = self._dispatch_decode(1, self.want_logprobs, rows)
            if compiled:
                self._mark_uncompiled(slot_of)
            pending += more
        for out in pending:
            self._deliver(out, slot_of)

    def _admission_waiting(self) -> bool:
        """A queued request could be admitted now: one waits and a slot is free."""
        with self._lock:
            return bool(self._queue) and bool(self._free_slots())

    def _free_slots(self) -> list[int]:
        """Slots neither running a request nor reserved by a prompt still prefilling."""
        return [i for i, s in enumerate(self._slots) if s is None and i not in self._prefilling]

    def _kv_bound_after(self, tokens: int) -> int:
        """The KV-length bucket that holds every running row's cache after `tokens` more positions
        are written (each row's cached length now is its prompt and output less the last token)."""
        furthest = max(len(s.request.prompt_ids) + len(s.tokens) - 1 for s in self._slots if s is not None)
        return self.shapes.kv_bound(furthest + tokens)

    def _deliver(self, out, slot_of) -> None:
        """Fetch one step's outputs (waiting for the step) and hand each active row its token. The
        log-probs are fetched only when a row being delivered asked for them: each output is its own
        device-to-host copy."""
        wants_logprobs = any(self._slots[i] is not None and self._slots[i].request.logprobs is not None
                             for i in slot_of)
        if wants_logprobs:
            ids, lps, top_ids, top_lps, active = jax.device_get(out)
        else:
            ids, active = jax.device_get((out[0], out[4]))
            lps = top_ids = top_lps = None
        now = time.perf_counter()
        for j, i in enumerate(slot_of):
            if self._slots[i] is not None and active[j]:
                self._hand(i, int(ids[j]), 0.0 if lps is None else float(lps[j]),
                           None if top_ids is None else top_ids[j], None if top_lps is None else top_lps[j], now)

    def _hand(self, i: int, token: int, lp: float, top_ids, top_lps, now: float) -> bool:
        """`_accept` one token for slot i; a failure delivering it ends that request alone. Returns
        True if the request goes on."""
        try:
            return self._accept(i, token, lp, top_ids, top_lps, now)
        except Exception as exc:
            log.exception("request %s failed", self._slots[i].handle.request_id)
            self._finish(i, "error", error=f"{type(exc).__name__}: {exc}")
            return False

    def _speculative_dispatch(self, slot_of) -> bool:
        """One verify step of the group `slot_of` when some row in it speculates and has proposals;
        returns False (nothing done) when none has. Its tokens are taken one by one through
        `_accept`, so stop ids, min_tokens, max_tokens and streaming behave as in plain decoding (a
        stop id among the accepted tokens ends the request there)."""
        proposals: dict[int, np.ndarray] = {}
        drafting: dict[int, np.ndarray] = {}  # rows the draft model proposes for: their contexts
        for j, i in enumerate(slot_of):
            slot = self._slots[i]
            if slot is None or not _speculates(slot.request):
                continue
            if slot.speculation is None:
                slot.speculation = RequestSpeculation(slot.request.speculative.method, slot.request.speculative.k)
            context = np.asarray((*slot.request.prompt_ids, *slot.tokens), np.int32)
            owed = slot.budget - len(slot.tokens)
            if slot.speculation.method in ("draft", "mtp"):
                count = min(slot.speculation.k, owed - 1) if slot.speculation.active(len(slot.tokens)) else 0
                if count > 0:
                    drafting[j], proposals[j] = context, np.zeros(count, np.int32)  # drawn on the device
                continue
            proposed = slot.speculation.propose(context, len(slot.tokens))[: owed - 1]
            if len(proposed):
                proposals[j] = proposed
        if not proposals:
            return False
        k = next(k for k in self.spec_ks if k >= max(len(p) for p in proposals.values()))
        table, counts = np.zeros((len(slot_of), k), np.int32), np.zeros(len(slot_of), np.int32)
        for j, proposed in proposals.items():
            table[j, : len(proposed)], counts[j] = proposed, len(proposed)
        rows = np.asarray(slot_of, np.int32)
        if self.drafter is None and self.mtp is None:
            out, compiled = self._dispatch_verify(rows, table, counts)
        else:  # one verify shape per (group, k) with or without draft rows: q unused when none drafts
            drafted = np.isin(np.arange(len(slot_of)), list(drafting))
            if drafting:
                table, q = self._drafted(rows, drafting, table, k, self._kv_bound_after(k + 1))
            else:
                q = jnp.zeros((len(slot_of), k, self.config.vocab_size), jnp.float32)
            out, compiled = self._dispatch_verify(rows, table, counts, q, drafted)
        if compiled:
            self._mark_uncompiled(slot_of)
        drawn, accepted, lps, top_ids, top_lps, active = jax.device_get(out)
        if self.drafter is not None:  # the draft's cache now holds the accepted tokens (but one)
            for j, context in drafting.items():
                self.drafter.observe(int(slot_of[j]), len(context) - 1, int(accepted[j]), k)
        now = time.perf_counter()
        for j, i in enumerate(slot_of):
            slot = self._slots[i]
            if slot is None or not active[j]:
                continue
            if j in proposals:
                slot.speculation.observe(int(counts[j]), int(accepted[j]), len(slot.tokens) + int(accepted[j]) + 1)
            for t in range(int(accepted[j]) + 1):  # only a row's first token can carry logprobs (no proposals)
                if not self._hand(i, int(drawn[j, t]), float(lps[j]), top_ids[j], top_lps[j], now):
                    break
        self._reap_cancelled()
        return True

    def _accept(self, i: int, token: int, lp: float, top_ids, top_lps, now: float) -> bool:
        """Take one generated token for slot i; returns True if the request goes on."""
        slot = self._slots[i]
        request = slot.request
        if slot.first_token_at is None:
            slot.first_token_at = now
        slot.last_token_at = now
        if token in slot.stop_ids and len(slot.tokens) >= request.min_tokens:
            self._finish(i, "stop", stop_token=token)
            return False
        if slot.matcher is not None and not slot.matcher.consume_token(token):
            self._finish(i, "error", error=f"constraint: token {token} refused ({slot.matcher.get_error()})")
            return False
        slot.tokens.append(token)
        top = None
        if request.logprobs:
            top = tuple((int(t), float(v)) for t, v in zip(top_ids[: request.logprobs], top_lps[: request.logprobs], strict=True))
        slot.handle.put(TokenEvent(token, lp if request.logprobs is not None else None, top))
        if len(slot.tokens) >= slot.budget:
            self._finish(i, "length")
            return False
        return True

    def _reap_cancelled(self) -> None:
        for i, slot in enumerate(self._slots):
            if slot is not None and slot.handle.cancelled:
                self._finish(i, "cancelled")

    def _finish(self, i: int, reason: str, stop_token: int | None = None, error: str | None = None) -> None:
        slot = self._slots[i]
        if self.device is not None:  # None: a rebuild failed, or the loop died (nothing decodes again)
            self._set_slot(i, remaining=0)
        self.want_logprobs[i] = False
        with self._lock:
            self._slots[i] = None
        self.admission.observe(time.perf_counter() - slot.admitted)
        first = slot.first_token_at or time.perf_counter()
        last = slot.last_token_at or first
        decode_seconds = last - first
        n = len(slot.tokens)
        timings = RequestTimings(
            queue_seconds=slot.admitted - slot.submitted,
            prefill_seconds=slot.prefill_seconds,
            time_to_first_token_seconds=first - slot.submitted,
            decode_seconds=decode_seconds,
            decode_tokens_per_second=(n - 1) / decode_seconds if n > 1 and decode_seconds > 0 else 0.0,
            prefill_bucket=slot.bucket_total,
            pad_tokens=slot.pad_tokens,
            uncompiled_shape=slot.uncompiled,
            prefill_batch=slot.prefill_batch,
        )
        verdict = check_degeneracy(slot.tokens)
        if verdict.degenerate:  # the server logs it at warning level with the API request id
            log.debug("degenerate output for %s: %s", slot.handle.request_id, verdict.reason)
        slot.handle.finish(GenerationResult(
            token_ids=tuple(slot.tokens), finish_reason=reason, prompt_tokens=len(slot.request.prompt_ids),
            timings=timings, degeneracy=verdict, stop_token_id=stop_token, error=error,
            cached_tokens=slot.cached_tokens,
            speculation=None if slot.speculation is None else slot.speculation.stats()))

    def _finish_unstarted(self, handle: RequestHandle, submitted: float, reason: str = "cancelled",
                          error: str | None = None) -> None:
        now = time.perf_counter()
        handle.finish(GenerationResult(
            token_ids=(), finish_reason=reason, prompt_tokens=len(handle.request.prompt_ids),
            timings=RequestTimings(queue_seconds=now - submitted, prefill_seconds=0.0, time_to_first_token_seconds=0.0,
                                   decode_seconds=0.0, decode_tokens_per_second=0.0, prefill_bucket=0, pad_tokens=0,
                                   uncompiled_shape=False),
            degeneracy=check_degeneracy(()), error=error))

    def _recover_device_state(self, exc: Exception) -> bool:
        """After a failed device call: if it consumed donated buffers (the cache or the sampling
        state is gone), or a rebuild did not finish (`_fail_all` raised, in a call whose caller caught
        it: a group's `_begin`; the state, the pool or the running requests are left as it stopped),
        the running requests cannot go on: fail them and rebuild (True); else nothing was lost and
        they carry on untouched (False)."""
        leaves = jax.tree.leaves(self.device) + jax.tree.leaves(self.prefix_cache and self.prefix_cache.pool)
        leaves += jax.tree.leaves(self.drafter and self.drafter.cache)
        if self._rebuilding or any(getattr(leaf, "is_deleted", lambda: False)() for leaf in leaves):
            log.error("device state lost in a failed call: failing the running requests")
            self._fail_all(exc)
            return True
        return False

    def _fail_all(self, exc: Exception) -> None:
        """End every running and prefilling request with `exc`, on a new state (the failed call may
        have consumed the old one, which finishing a slot would write to)."""
        error = f"{type(exc).__name__}: {exc}"
        self._rebuilding = True  # until the state and the pool are whole (`_recover_device_state`)
        self.device = None  # if the rebuild fails, finishing the requests writes to no state (`_finish`)
        self._init_device_state()
        if self.prefix_cache is not None:  # its pool may have gone with a failed copy
            self.prefix_cache.reset()
        self._rebuilding = False
        for i, slot in enumerate(self._slots):
            if slot is not None:
                self._finish(i, "error", error=error)
        for entry in self._prefilling.values():  # their cache rows go with the state
            self._finish_unstarted(entry.slot.handle, entry.slot.submitted, "error", error)
        self._prefilling.clear()


def _with_state(args: tuple, state) -> tuple:
    """A declared call's arguments with its DeviceState replaced by `state`."""
    return tuple(state if isinstance(arg, DeviceState) else arg for arg in args)


def _speculates(request: GenerationRequest) -> bool:
    """Whether a request decodes speculatively: it asks (or the engine's default does, resolved at
    submit) and nothing in it needs a token-by-token step: logprobs, a constraint or penalties (the
    verify step draws proposed positions without penalties) make it decode plainly."""
    spec, s = request.speculative, request.sampling
    return (spec is not None and spec.method != "off" and request.logprobs is None and request.constraint is None
            and s.presence_penalty == 0 and s.frequency_penalty == 0 and s.repetition_penalty == 1)


def _drafts(request: GenerationRequest) -> bool:
    """Whether a request's proposals come from the draft model (its draft slot is prefilled)."""
    return _speculates(request) and request.speculative.method == "draft"
