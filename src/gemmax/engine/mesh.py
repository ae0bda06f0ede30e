"""Serving on a `jax.sharding.Mesh`: `--mesh dp=D,tp=T[,ep=E]`.

The mesh has axes (dp, tp, ep). Parameters lie as `gemmax.model.sharding` rules say (heads, FFN
hidden units and vocabulary on tp; experts on ep; replicated on dp); the KV cache and every per-slot
array of the engine's `DeviceState` are split by rows over dp (and the cache by KV heads on tp), so
one engine schedules all slots and each dp group decodes its own rows. The engine's steps
(`gemmax.engine.steps`) are the same functions, jitted once more here with the state's shardings as
their output shardings, so a donated state comes back laid out as it went in and each shape compiles
once. One device (no `--mesh`) never comes here: the engine keeps today's steps and CPU fast path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gemmax.engine import steps
from gemmax.model.config import ModelConfig
from gemmax.model.params import Params
from gemmax.model.sharding import MESH_AXES, cache_shardings, param_shardings, rows_sharding


class MeshError(ValueError):
    """A --mesh that cannot be built here, with the reason."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    dp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.ep

    def __str__(self) -> str:
        return f"dp={self.dp},tp={self.tp}" + (f",ep={self.ep}" if self.ep > 1 else "")

    @classmethod
    def parse(cls, text: str | None) -> MeshSpec | None:
        """"dp=2,tp=4" / "tp=8" / "dp=1,tp=2,ep=4" -> MeshSpec; None or "" -> None (one device)."""
        if not text:
            return None
        sizes: dict[str, int] = {}
        for part in text.split(","):
            name, _, value = part.strip().partition("=")
            if name not in MESH_AXES or not value.isdigit() or int(value) < 1:
                raise MeshError(f"--mesh {text!r}: expected comma-separated dp=N, tp=N, ep=N (N >= 1)")
            sizes[name] = int(value)
        return cls(**sizes)


def make_mesh(spec: MeshSpec, devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if spec.size > len(devices):
        raise MeshError(f"--mesh {spec} needs {spec.size} devices; {len(devices)} are visible")
    grid = np.asarray(devices[: spec.size], dtype=object).reshape(spec.dp, spec.tp, spec.ep)
    return Mesh(grid, MESH_AXES)


def check_mesh(spec: MeshSpec, config: ModelConfig, max_batch: int) -> None:
    """Refuse a mesh the engine cannot split: slots must divide over dp, experts over ep."""
    if max_batch % spec.dp:
        raise MeshError(f"--mesh {spec}: {max_batch} decode slots do not split over dp={spec.dp}")
    if spec.ep > 1 and (not config.has_moe or config.num_experts % spec.ep):
        raise MeshError(f"--mesh {spec}: ep={spec.ep} needs a MoE model whose experts divide by it "
                        f"(this one has {config.num_experts})")


def shard_params(params: Params, config: ModelConfig, mesh: Mesh) -> Params:
    """The params placed on the mesh (plain arrays: the mesh path skips the CPU column split). Each
    device's shard is cut from the host copy every process holds, so it works across processes."""

    def place(value, sharding):
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    shardings = param_shardings(config, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    return {**jax.tree.map(place, {k: params[k] for k in shardings}, shardings),
            **{k: jax.tree.map(lambda v: place(v, replicated), v) for k, v in params.items() if k not in shardings}}


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> None:
    """`jax.distributed.initialize` from flags, or with None from the environment JAX reads itself
    (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, SLURM, TPU pod metadata). Must
    run before anything touches a device. CPU processes exchange collectives through gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def state_shardings(device: steps.DeviceState, mesh: Mesh) -> steps.DeviceState:
    rows = device.tokens.shape[0]
    per_row = functools.partial(rows_sharding, rows=rows, mesh=mesh)
    return dataclasses.replace(
        jax.tree.map(per_row, device), cache=cache_shardings(device.cache, mesh))


@dataclasses.dataclass(frozen=True)
class MeshSteps:
    """The engine's device steps, compiled for one mesh (same signatures as gemmax.engine.steps)."""

    mesh: Mesh
    prefill_step: Any
    draw: Any
    decode_step: Any
    decode_forward: Any
    init_device_state: Any


class _OnMesh:
    """A jitted step called with its mesh set (`jax.set_mesh`), so the model can name mesh axes in
    sharding constraints (`forward.gather_vocab`)."""

    def __init__(self, mesh: Mesh, jitted: Any):
        self.mesh, self.jitted = mesh, jitted

    def __call__(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*args, **kwargs)


def mesh_steps(mesh: Mesh, config: ModelConfig, slots: int, max_len: int, precision) -> MeshSteps:
    abstract = jax.eval_shape(lambda: steps.init_device_state(config, slots, max_len, precision))
    state = state_shardings(abstract, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())

    def jit(fn, static):
        return _OnMesh(mesh, jax.jit(fn.__wrapped__, static_argnames=static,
                                     donate_argnames=("device",), out_shardings=(state, replicated)))

    init = jax.jit(steps.init_device_state, static_argnums=(0, 1, 2, 3), out_shardings=state)
    return MeshSteps(mesh=mesh, prefill_step=jit(steps.prefill_step, steps.PREFILL_STATIC),
                     draw=jit(steps.draw, ()), decode_step=jit(steps.decode_step, steps.DECODE_STATIC),
                     decode_forward=jit(steps.decode_forward, steps.DECODE_STATIC), init_device_state=init)


def mesh_summary(spec: MeshSpec, config: ModelConfig, mesh: Mesh) -> str:
    """One log line: the mesh and which logical axes it actually splits for this model."""
    split = sorted({a for s in jax.tree.leaves(param_shardings(config, mesh), is_leaf=lambda x: isinstance(x, NamedSharding))
                    for a in s.spec if a})
    return f"mesh {spec} over {math.prod(mesh.devices.shape)} devices; parameters split on {split or 'nothing'}"
