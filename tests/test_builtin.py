"""The built-in default model (Gemma 3 270M, Q4_K_M GGUF from PyPI) end to end, and the one-time
GGUF -> HF directory conversion behind it.

Reference ids for "The capital of France is" (prompt ids [2, 818, 5279, 529, 7001, 563]), recorded once:
- HF_FLOAT32: transformers 5.23.0 `AutoModelForCausalLM.from_pretrained(cache_dir, gguf_file=
  "gemma-3-270m-q4_k_m.gguf", dtype=torch.float32)` (it dequantises the GGUF itself), then
  `generate(max_new_tokens=32, do_sample=False)`. Top-2 logit gaps along the way are >= 0.25 except at
  steps 11 (0.0136), 15 (0.0124), 25 (0.0048) and 31 (0.0186).
- LLAMA_CPP: llama-cpp-python 0.3.36 (CPU, 2 threads) on the same file, argmax of the last logits
  each step (" the capital of the country of France. It is the largest city in France."): the same
  first 15 tokens, then "." where transformers has " and" -- the near-tie at step 15 that llama.cpp's
  8-bit activations tip the other way.
benchmarks/real_model.py re-derives both live and reports where the runtimes part ways.
"""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import torch
from typer.testing import CliRunner

from gemmax.cli import app
from gemmax.weights.builtin import MARKER, convert
from gemmax.weights.load import load_checkpoint
from gemmax.weights.tokenizer import load_tokenizer
from test_gguf_loader import param_leaves, write_gguf

PROMPT = "The capital of France is"
HF_FLOAT32 = [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528, 7001, 532,
              506, 1855, 7488, 3207, 528, 3879, 236761, 1030, 563, 5628, 528, 506, 6029, 529, 506, 2891]
LLAMA_CPP = [*HF_FLOAT32[:15], 236761]


def _generate(dtype: str) -> tuple[list[int], str]:
    result = CliRunner().invoke(app, ["generate", "--prompt", PROMPT, "--max-tokens", "32", "--dtype", dtype, "--json"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    return payload["token_ids"], payload["text"]


def test_generate_without_model_runs_the_builtin_gemma3_270m():
    """One process: the float32 run must equal transformers' 32 tokens; the default (on CPU: bf16, and
    int8 layers and LM head by `--quant auto` since the file is stored quantised) must agree with
    transformers and llama.cpp on the first 11, before the near-ties."""
    ids, text = _generate("float32")
    assert ids == HF_FLOAT32
    assert text.startswith(" the capital of the country of France. It is the largest city in France")
    ids, _ = _generate("auto")
    assert ids[:11] == HF_FLOAT32[:11] == LLAMA_CPP[:11]


def test_conversion_writes_an_hf_checkpoint_equal_to_the_gguf(hf_checkpoints, tmp_path):
    from transformers import Gemma3ForCausalLM

    directory, _ = hf_checkpoints["g3_small"]
    gguf_file = write_gguf(directory, tmp_path / "g3.gguf")
    target = tmp_path / "cache" / "hf"
    convert(gguf_file, target)
    assert json.loads((target / MARKER).read_text())["format"] >= 1
    assert not list(tmp_path.glob("cache/hf.tmp-*"))  # written aside, then renamed

    direct, converted = load_checkpoint(gguf_file, jnp.float32), load_checkpoint(target, jnp.float32)
    assert converted.config == direct.config
    want, got = param_leaves(direct.params), param_leaves(converted.params)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    tokenizer = load_tokenizer(target)
    for text in ("ab ab\n  cd", "ba cd", "  \n"):
        assert tokenizer.encode(text) == direct.source.tokenizer.encode(text)
    assert tokenizer.render_chat([{"role": "user", "content": "ab"}]) == \
        direct.source.tokenizer.render_chat([{"role": "user", "content": "ab"}])

    # transformers reads the directory as an ordinary Gemma 3 checkpoint with the original's logits.
    model = Gemma3ForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager").eval()
    original = Gemma3ForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([[2, 17, 33, 5, 61, 8, 40, 9, 11, 12]])
    with torch.no_grad():
        diff = (model(ids).logits - original(ids).logits).abs().max().item()
    assert diff <= 1e-5


def test_builtin_messages_name_what_happens(capfd, tmp_path, hf_checkpoints):
    directory, _ = hf_checkpoints["g3_small"]
    convert(write_gguf(directory, tmp_path / "g3.gguf"), tmp_path / "hf")
    err = capfd.readouterr().err
    assert re.search(r"converting g3\.gguf once into .*hf", err)
    assert "dequantised" in err and "ready in" in err


def test_incomplete_cache_is_not_taken_for_complete(tmp_path, hf_checkpoints):
    from gemmax.weights.builtin import FORMAT_VERSION, _is_complete

    directory, _ = hf_checkpoints["g3_small"]
    target = tmp_path / "hf"
    convert(write_gguf(directory, tmp_path / "g3.gguf"), target)
    assert _is_complete(target)
    (target / MARKER).write_text(json.dumps({"format": FORMAT_VERSION - 1}))  # an older layout: rebuild
    assert not _is_complete(target)
    (target / MARKER).unlink()  # an interrupted conversion never writes the marker
    assert not _is_complete(target)
