"""The engine's device steps compiled ahead of time, and kept on disk as executables.

A jitted function compiles on its first call with a new shape and runs what it compiled. A warm-up
that goes through calls therefore has to *run* every declared shape: a 2048-token prefill of the
built-in model costs as much at warm-up as for a real prompt, whatever the chunk holds (its shape is
static), and with a warm persistent cache the built-in model still took 121 s to become ready, most of
it running throwaway prefills. Here each step is compiled with `jit.lower(...).compile()` instead,
several at once (XLA compiles without the GIL), and the engine calls the `jax.stages.Compiled`
objects: a call costs what a jitted call costs (measured: 153 us against 154 us per dispatch of a
small step). `compile_all` hands each program, in order, to a `then` as soon as it is ready: the
engine runs it once there, on idle rows, because XLA:CPU sets up a program's GEMMs on its first run.

`ExecutableStore` keeps each compiled step as a serialised executable
(`jax.experimental.serialize_executable`), keyed by everything that decides the program: the step,
its static arguments (the frozen model config, precision, KV bound ...), every argument's shape,
dtype and sharding, jax / jaxlib versions, the backend and its devices, XLA_FLAGS and a hash of
gemmax's numeric code. A later start loads it back without tracing, lowering or compiling; JAX's own
persistent cache would still trace and lower every shape to find its key (and misses when the
directory moves, since its key names the directory). An entry that does not load is removed and
compiled anew; so is one that loads but fails its first run (`LoadedProgramFailed`: that run's
donated arguments may be gone, so the caller rebuilds them). The store lives inside the
compile-cache directory, so `gemmax cache export / import` moves it with JAX's entries.

A program that JAX read back from its own persistent cache (a start after a code change that left its
HLO as it was: the store misses, JAX's cache hits) is stored with the executable bytes JAX's cache
entry held, not serialised again: on XLA:CPU (jaxlib 0.10.2) a read-back executable serialises
without all of its kernels, and such a copy loads but fails when it runs ("NOT_FOUND: Function
select_convert_fusion not found"). JAX gives no handle on those bytes, so `_keep_jax_cache_bytes`
wraps the private jax function with which its cache unpacks an entry; where jax has no such function
the program is not stored, and comes from JAX's cache at every start. Not covered: a program JAX
hands back from its in-memory caches (no persistent-cache read) is serialised again; if it had been
read back from JAX's disk cache earlier in the same process, that copy is the incomplete kind. Only a
process that compiles the same program twice without the store holding it (two engines over two
store directories, as tests do) can reach that; `gemmax serve` runs one engine.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import io
import logging
import os
import pickle
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax import monitoring
from jax.experimental import serialize_executable

try:  # private: where JAX's persistent cache unpacks an entry (`_keep_jax_cache_bytes`)
    from jax._src import compilation_cache as jax_compilation_cache
except ImportError:
    jax_compilation_cache = None

log = logging.getLogger("gemmax.engine")

STORE_DIR = "executables"  # under the compile-cache directory
_CODE_PACKAGES = ("model", "engine", "quant")  # the code a compiled step is made of


def _leaf_signature(leaf: Any) -> tuple:
    if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):  # a struct: compiled from the shapes alone
        return (leaf.shape, str(leaf.dtype), leaf.weak_type, leaf.sharding)
    if isinstance(leaf, np.ndarray | np.generic):
        return (leaf.shape, str(leaf.dtype), False, None)
    return (type(leaf).__name__,)  # a Python scalar: jit treats it as a weakly typed 0-d array


def signature(args: tuple, statics: dict[str, Any]) -> tuple:
    """What decides the compiled program of one call: static values, argument tree and leaf types."""
    leaves, tree = jax.tree.flatten(args)
    return (tuple(sorted(statics.items())), tree, tuple(_leaf_signature(leaf) for leaf in leaves))


_PLAIN = (int, float, bool, str, type(None))


def call_key(args: tuple, statics: dict[str, Any]) -> tuple:
    """The per-call lookup key, cheap enough for every decode dispatch: the shape and dtype of each
    top-level array argument, the type of each pytree argument (params, the device state: their
    shapes are fixed for a step and its static arguments), and the static values (objects by
    identity: the engine passes the same config and precision every time; hashing the frozen config
    on every call cost more than the call). `signature` (the whole tree) keys the store. A call whose
    pytree shapes did differ is refused by the executable itself ("Argument types differ")."""
    return (tuple((k, v if isinstance(v, _PLAIN) else id(v)) for k, v in statics.items()),
            tuple((a.shape, a.dtype) if isinstance(a, jax.Array | np.ndarray) else type(a) for a in args))


def _devices_of(args: tuple) -> list:
    devices = {d for leaf in jax.tree.leaves(args) if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)
               and leaf.sharding is not None for d in leaf.sharding.device_set}
    return sorted(devices, key=lambda d: d.id)


_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # JAX's event, recorded in the compiling thread
_compiling = threading.local()


def _note_cache_hit(event: str, **_: object) -> None:
    if event == _CACHE_HIT:
        _compiling.jax_cache_hit = True


monitoring.register_event_listener(_note_cache_hit)


def _keep_jax_cache_bytes() -> None:
    """Wrap the function with which JAX's persistent cache unpacks an entry (jax 0.10-0.11:
    `compilation_cache.extract_executable_and_time(entry) -> (serialised executable, compile time)`,
    called in the compiling thread right before the executable is deserialised) so that the compiling
    thread keeps the serialised bytes. What it returns passes through untouched, so a jax whose
    function returns something else still reads its cache (and its read-back programs are not
    stored); a jax without the function is left as it is."""
    extract = getattr(jax_compilation_cache, "extract_executable_and_time", None)
    if extract is None:
        return
    if getattr(extract, "gemmax_keeps_bytes", False):  # an earlier import of this module wrapped it
        extract = extract.__wrapped__

    @functools.wraps(extract)
    def extract_and_keep(*args, **kwargs):
        unpacked = extract(*args, **kwargs)
        if isinstance(unpacked, tuple) and unpacked and isinstance(unpacked[0], bytes):
            _compiling.jax_cache_bytes = unpacked[0]
        return unpacked

    extract_and_keep.gemmax_keeps_bytes = True
    jax_compilation_cache.extract_executable_and_time = extract_and_keep


_keep_jax_cache_bytes()


def _compile(jitted: Any, args: tuple, statics: dict[str, Any]) -> tuple[jax.stages.Compiled, bool, bytes | None]:
    """(jitted compiled for the call, whether JAX's persistent cache supplied the program, and then the
    serialised executable its entry held, if `_keep_jax_cache_bytes` saw it). Only the compilation is
    watched: a cache read while lowering would be another program's."""
    lowered = jitted.lower(*args, **statics)
    _compiling.jax_cache_hit, _compiling.jax_cache_bytes = False, None
    compiled = lowered.compile()
    hit = _compiling.jax_cache_hit
    return compiled, hit, _compiling.jax_cache_bytes if hit else None


class _Placeholder:
    """The XLA executable of a serialised program, held while its payload is pickled again."""


def _with_executable(payload: bytes, executable: bytes, devices: list | None) -> bytes:
    """`serialize_executable.serialize`'s payload with its XLA executable's bytes replaced by
    `executable`: read back and written again by jax's own (private) unpickler and pickler, with the
    executable (which they write as ("exec", bytes)) left as a placeholder in between."""
    backend = jax.devices()[0].client

    class Reader(serialize_executable._JaxPjrtUnpickler):
        def persistent_load(self, pid):
            return _Placeholder() if pid[0] == "exec" else super().persistent_load(pid)

    class Writer(serialize_executable._JaxPjrtPickler):
        def persistent_id(self, obj):
            return ("exec", executable) if isinstance(obj, _Placeholder) else super().persistent_id(obj)

    with io.BytesIO() as out:
        Writer(out).dump(Reader(io.BytesIO(payload), backend, devices).load())
        return out.getvalue()


_code_hash: str | None = None


def code_hash() -> str:
    """sha256 over the source of gemmax's numeric packages (a changed step never loads a stale program)."""
    global _code_hash
    if _code_hash is None:
        root = Path(__file__).resolve().parents[1]
        digest = hashlib.sha256()
        for package in _CODE_PACKAGES:
            for path in sorted((root / package).rglob("*.py")):
                digest.update(path.relative_to(root).as_posix().encode())
                digest.update(path.read_bytes())
        _code_hash = digest.hexdigest()
    return _code_hash


class LoadedProgramFailed(RuntimeError):
    """A program loaded from the executable store failed its first run (a damaged entry that still
    loads: on XLA:CPU an incomplete serialisation raises "NOT_FOUND: Function ... not found"). It has
    left the step's table and the store, so the next call of its shape compiles it anew; the failed
    call's donated arguments may have been consumed (the caller rebuilds them)."""


class ExecutableStore:
    """Serialised compiled steps in one directory, one file per key (written atomically)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.loaded = 0
        self.saved = 0
        self.rejected = 0
        self.discarded = 0  # loaded, then failed their first run (`LoadedProgramFailed`)
        self.unstored = 0  # read back from JAX's cache without its bytes, so not stored (module docstring)
        self.from_jax_cache = 0  # stored with the bytes of JAX's cache entry (module docstring)

    def key(self, name: str, sig: tuple, devices: list) -> str:
        backend = jax.devices()[0].client
        material = repr((name, sig, [(d.platform, d.device_kind, d.id) for d in devices], jax.__version__,
                         jaxlib.__version__, backend.platform_version, os.environ.get("XLA_FLAGS", ""), code_hash()))
        return hashlib.sha256(material.encode()).hexdigest()

    def load(self, key: str, devices: list) -> jax.stages.Compiled | None:
        path = self.directory / f"{key}.exe"
        if not path.is_file():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                 execution_devices=devices)
        except Exception as exc:  # truncated, from another build: compile it again
            log.warning("executable %s does not load (%s: %s); compiling it anew", path.name, type(exc).__name__, exc)
            path.unlink(missing_ok=True)
            self.rejected += 1
            return None
        self.loaded += 1
        return compiled

    def discard(self, key: str) -> None:
        """Remove an entry that loaded but failed its first run (the next call compiles it anew)."""
        (self.directory / f"{key}.exe").unlink(missing_ok=True)
        self.discarded += 1

    def save(self, key: str, compiled: jax.stages.Compiled, executable: bytes | None = None,
             devices: list | None = None) -> None:
        """`executable`: the serialised XLA executable to store for `compiled` (the bytes JAX's cache
        entry held, for a program read back from it) instead of serialising it again."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            if executable is not None:
                payload = _with_executable(payload, executable, devices or None)
            blob = pickle.dumps((payload, in_tree, out_tree))
        except Exception as exc:  # a program that cannot be serialised is compiled at every start
            log.info("executable %s not stored: %s", key[:12], exc)
            return
        tmp = self.directory / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(blob)
        os.replace(tmp, self.directory / f"{key}.exe")
        self.saved += 1
        self.from_jax_cache += executable is not None


class CompiledStep:
    """One jitted step behind the same call signature (static arguments as keywords), running the
    executable compiled for the call's shapes; a call with a shape not compiled yet compiles it
    first (and `size` grows, as `jit._cache_size` would)."""

    def __init__(self, name: str, jitted: Any, owner: CompiledSteps, lock: threading.Lock):
        self.name, self.jitted, self.owner, self._lock = name, jitted, owner, lock
        self._table: dict[tuple, tuple[jax.stages.Compiled, dict[str, Any]]] = {}
        self._ran: set[tuple] = set()  # keys of the programs that have run at least once
        self._loaded_unrun: dict[tuple, str] = {}  # call key -> store key of a program loaded, not yet run
        self.compiled = 0  # programs compiled here (the rest of the table was loaded from the store)

    def size(self) -> int:
        return len(self._table)

    def never_run(self) -> int:
        """Programs in the table that have not run yet (each pays XLA:CPU's first-run cost when it does)."""
        return len(self._table.keys() - self._ran)

    def compile(self, *args, **statics) -> bool:
        """Make sure the call's program exists (loaded from the store, else compiled); True if it was new."""
        return self._get(call_key(args, statics), args, statics)[1]

    def _get(self, key: tuple, args: tuple, statics: dict[str, Any]) -> tuple[jax.stages.Compiled, bool]:
        entry = self._table.get(key)
        if entry is not None:
            return entry[0], False
        sig = signature(args, statics)
        store = self.owner.store
        devices = _devices_of(args)
        stored = None if store is None else store.key(self.name, sig, devices)
        compiled = None if stored is None else store.load(stored, devices)
        loaded = compiled is not None
        if compiled is None:
            compiled, from_jax_cache, executable = _compile(self.jitted, args, statics)
            self.compiled += 1
            if stored is not None and from_jax_cache and executable is None:
                store.unstored += 1
            elif stored is not None:
                store.save(stored, compiled, executable, devices)
        with self._lock:  # the statics are kept with it: their ids in the key stay theirs
            if key not in self._table:
                self._table[key] = (compiled, dict(statics))
                if loaded:
                    self._loaded_unrun[key] = stored
        return self._table[key][0], True

    def run(self, *args, **statics) -> tuple[Any, bool]:
        """(the call's outputs, whether this call compiled or loaded its program): what a request's
        timings report as `uncompiled_shape`."""
        key = call_key(args, statics)
        program, new = self._get(key, args, statics)
        first_of_loaded = self._loaded_unrun and key in self._loaded_unrun
        out = self._first_run_of_loaded(key, program, args) if first_of_loaded else program(*args)
        self._ran.add(key)
        return out, new

    def _first_run_of_loaded(self, key: tuple, program: jax.stages.Compiled, args: tuple) -> Any:
        """Run a program loaded from the store for the first time, to its end (a failure can surface
        only when its outputs are waited for), after its inputs are ready (an earlier call's failure
        surfaces as that call's, here). One whose run fails in the runtime, other than for want of
        memory, leaves the table and the store: `LoadedProgramFailed`. Only the branches of its
        conditionals that this run takes are checked: XLA:CPU looks a kernel up when it first runs."""
        jax.block_until_ready(args)
        try:
            out = jax.block_until_ready(program(*args))
        except jax.errors.JaxRuntimeError as exc:
            if "RESOURCE_EXHAUSTED" in str(exc):  # the program is not at fault: checked again next time
                raise
            with self._lock:
                del self._table[key]
                stored = self._loaded_unrun.pop(key)
            self.owner.store.discard(stored)
            log.warning("%s: a program loaded from the executable store failed its first run (%s: %s); removed from "
                        "the store, compiled anew by the next call", self.name, type(exc).__name__, exc)
            raise LoadedProgramFailed(f"{self.name}: the program loaded from the executable store failed its first "
                                      f"run ({type(exc).__name__}: {exc})") from exc
        with self._lock:
            self._loaded_unrun.pop(key, None)
        return out

    def __call__(self, *args, **statics):
        return self.run(*args, **statics)[0]


def compile_threads(programs: int) -> int:
    """Threads `CompiledSteps.compile_all` compiles `programs` programs on by default: one per CPU."""
    return max(1, min(programs, os.cpu_count() or 1))


class CompiledSteps:
    """The engine's steps (a namespace of jitted functions) as `CompiledStep`s; anything else in the
    namespace (the state's initialiser) passes through."""

    def __init__(self, steps: Any, names: Iterable[str]):
        self.store: ExecutableStore | None = None  # set at warm-up (one device, one process)
        self._lock = threading.Lock()
        self._steps = {name: CompiledStep(name, getattr(steps, name), self, self._lock) for name in names
                       if hasattr(steps, name)}
        self._plain = steps

    def __getattr__(self, name: str):
        steps = self.__dict__.get("_steps", {})
        return steps[name] if name in steps else getattr(self.__dict__["_plain"], name)

    def compile_all(self, calls: list[tuple[str, tuple, dict[str, Any]]], threads: int | None = None,
                    then: Callable[[str, tuple, dict[str, Any]], None] | None = None) -> int:
        """Compile (or load) every `(step name, args, statics)` at once on `threads` threads; returns how
        many were new. Lowering holds the GIL, XLA's compilation does not, so compiles overlap.
        `then(name, args, statics)`: called in this thread for each call, in the order of `calls`, as
        soon as its program is ready, while the threads go on with the rest (the engine dispatches
        each program's first run there: it overlaps the next compiles or loads, in the same order in
        every process)."""
        workers = threads or compile_threads(len(calls))
        new = 0
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="gemmax-compile") as pool:
            try:
                jobs = [pool.submit(self._steps[name].compile, *args, **statics) for name, args, statics in calls]
                for call, ready in zip(calls, jobs, strict=True):
                    new += ready.result()
                    if then is not None:
                        then(*call)
            except BaseException:  # fail now, not after every compile still queued
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        return new

    def never_run(self) -> int:
        """Programs of these steps that have not run yet."""
        return sum(step.never_run() for step in self._steps.values())

    def summary(self, *others: CompiledSteps) -> dict[str, Any]:
        """Counts over these steps and `others` (which share this store)."""
        store = self.store
        steps = [step for group in (self, *others) for step in group._steps.values()]
        return {"executables": sum(step.size() for step in steps),
                "executables_compiled": sum(step.compiled for step in steps),
                "executables_loaded": 0 if store is None else store.loaded,
                "executables_rejected": 0 if store is None else store.rejected,
                "executables_discarded": 0 if store is None else store.discarded,
                "executables_from_jax_cache_stored": 0 if store is None else store.from_jax_cache,
                "executables_from_jax_cache_unstored": 0 if store is None else store.unstored}
