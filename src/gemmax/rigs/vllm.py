"""The vLLM rig: the `vllm serve` command line for the same model and settings as a gemmax deployment.

vLLM is not installable on the CPU machine this project develops on, so the rig's contract is the
command it builds (tested here) and running it where `vllm` exists. Prefix caching is switched off:
the harness already opens every prompt with a nonce, and the flag makes the intent explicit.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    model: str
    port: int = 8000
    host: str = "127.0.0.1"
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # = gemmax --max-batch
    served_model_name: str | None = None
    seed: int = 0
    api_key: str | None = None
    gpu_memory_utilization: float | None = None
    extra_args: tuple[str, ...] = ()

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"vLLM --dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")


def vllm_command(s: VllmSettings, executable: str = "vllm") -> list[str]:
    """argv of `vllm serve` for these settings."""
    argv = [executable, "serve", s.model, "--host", s.host, "--port", str(s.port), "--dtype", s.dtype,
            "--seed", str(s.seed), "--no-enable-prefix-caching"]
    if s.max_model_len is not None:
        argv += ["--max-model-len", str(s.max_model_len)]
    if s.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(s.max_num_seqs)]
    if s.served_model_name is not None:
        argv += ["--served-model-name", s.served_model_name]
    if s.api_key is not None:
        argv += ["--api-key", s.api_key]
    if s.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    return argv + list(s.extra_args)


def vllm_available() -> str | None:
    """Path of the `vllm` executable, or None."""
    return shutil.which("vllm")


def exec_vllm(argv: list[str]) -> None:
    """Replace this process with `vllm serve` (signals and exit status then belong to vLLM)."""
    executable = vllm_available()
    if executable is None:
        raise FileNotFoundError("vllm is not installed here; the command would be:\n  " + " ".join(argv))
    os.execv(executable, [executable, *argv[1:]])
