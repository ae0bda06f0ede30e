"""Rigs by name: how to start each runtime behind the same OpenAI-compatible API, so tools (the
benchmark script, the MCP ops server) can list them and start one on a model and port.

Every rig is started as a subprocess from an argv built here (after the rig's `prepare` step: the vLLM
rig makes sure its own environment exists); `wait_healthy` polls `/health` until the server answers
200 (gemmax answers 503 while it loads and warms up; vLLM's 200 has an empty body).
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from gemmax.rigs.vllm import (
    VllmSettings,
    cpu_kv_cache_bytes,
    ensure_env,
    vllm_available,
    vllm_command,
    vllm_dtype,
    vllm_python,
)


@dataclasses.dataclass(frozen=True)
class RigOptions:
    model: str
    port: int
    host: str = "127.0.0.1"
    dtype: str | None = None  # None: the rig's default (gemmax: device policy; transformers: bfloat16)
    max_model_len: int | None = None
    max_batch: int | None = None


@dataclasses.dataclass(frozen=True)
class Rig:
    name: str
    description: str
    command: Callable[[RigOptions], list[str]]
    available: Callable[[], bool]
    prepare: Callable[[], object] | None = None  # make the runtime runnable (may take minutes once)

    def start(self, options: RigOptions, prepare: bool = False, **popen_kwargs) -> subprocess.Popen:
        """Start the rig; with `prepare`, first make its runtime runnable (the vLLM environment)."""
        if prepare and self.prepare is not None:
            self.prepare()
        if not self.available():
            raise RuntimeError(f"rig {self.name!r} cannot run here; its command is: {' '.join(self.command(options))}")
        return subprocess.Popen(self.command(options), **popen_kwargs)


def _gemmax(o: RigOptions) -> list[str]:
    argv = [sys.executable, "-m", "gemmax.cli", "serve", "--model", o.model, "--host", o.host, "--port", str(o.port)]
    if o.dtype:
        argv += ["--dtype", o.dtype]
    if o.max_model_len:
        argv += ["--max-model-len", str(o.max_model_len)]
    if o.max_batch:
        argv += ["--max-batch", str(o.max_batch)]
    return argv


def _transformers(o: RigOptions) -> list[str]:
    argv = [sys.executable, "-m", "gemmax.cli", "rig", "transformers", "--model", o.model, "--host", o.host,
            "--port", str(o.port), "--dtype", o.dtype or "bfloat16"]
    if o.max_model_len:
        argv += ["--max-model-len", str(o.max_model_len)]
    return argv


def _vllm(o: RigOptions) -> list[str]:
    dtype = o.dtype or vllm_dtype()
    return vllm_command(VllmSettings(model=o.model, port=o.port, host=o.host, dtype=dtype,
                                     max_model_len=o.max_model_len, max_num_seqs=o.max_batch,
                                     kv_cache_memory_bytes=cpu_kv_cache_bytes(o.model, o.max_model_len, o.max_batch,
                                                                              dtype)),
                        python=vllm_python() or "python")


def _has_torch() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


RIGS: dict[str, Rig] = {
    "gemmax": Rig("gemmax", "gemmax serve: the pure-JAX engine", _gemmax, lambda: True),
    "transformers": Rig("transformers", "HF transformers (PyTorch) reference server with token streaming",
                        _transformers, _has_torch),
    "vllm": Rig("vllm", "vLLM's OpenAI server, from its own environment (`gemmax rig vllm --setup` creates it)",
                _vllm, lambda: vllm_available() is not None, ensure_env),
}


def get_rig(name: str) -> Rig:
    try:
        return RIGS[name]
    except KeyError:
        raise ValueError(f"unknown rig {name!r}; known: {', '.join(RIGS)}") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now, for a rig to be started on (the OS picks it; another
    process may take it before the rig binds it, which the rig's start then reports)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_healthy(base_url: str, timeout_s: float = 600.0, process: subprocess.Popen | None = None) -> dict:
    """Poll `{base_url}/health` until 200; fail early when `process` exits. Returns the health JSON, or {}
    when the 200 carries no JSON object (vLLM's empty body)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the rig exited with status {process.returncode} before it was healthy")
        try:
            response = httpx.get(f"{base_url.rstrip('/')}/health", timeout=5.0)
            if response.status_code == 200:
                try:
                    body = response.json()
                except ValueError:
                    body = None
                return body if isinstance(body, dict) else {}
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}"
        time.sleep(0.5)
    raise TimeoutError(f"{base_url}/health not ready after {timeout_s:.0f} s (last: {last})")
