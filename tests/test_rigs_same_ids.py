"""Same ids everywhere: the HF directory gemmax writes for its built-in model tokenizes, through
transformers' own `AutoTokenizer` (what the transformers rig and vLLM load), exactly as gemmax does,
`<bos>` included. Without it transformers and vLLM answer a raw prompt without `<bos>` and a
comparison across runtimes compares different inputs."""

from __future__ import annotations

import json

import pytest

from gemmax.weights import builtin
from gemmax.weights.tokenizer import load_tokenizer
from test_gguf_tokenizer import TEXTS
from tiny_checkpoint import BOS_ID, CORPUS, write_tokenizer

CASES = list(dict.fromkeys([*TEXTS, *CORPUS]))


@pytest.fixture(scope="module")
def both():
    from transformers import AutoTokenizer

    directory = builtin.default_model_path()
    return load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("text", CASES)
def test_autotokenizer_gives_gemmax_ids(both, text):
    ours, reference = both
    ids = ours.encode(text)
    assert ids[0] == ours.bos_token_id == 2
    assert reference(text).input_ids == ids


def test_an_older_conversion_is_upgraded_in_place(tmp_path):
    """A directory converted before the tokenizer carried the post-processor (no `<bos>` from
    tokenizer.json, no marker entry) gets it without converting the weights again (a small tokenizer
    stands in for Gemma's 262k-token one)."""
    from tokenizers import Tokenizer as Backend
    from transformers import AutoTokenizer

    old = write_tokenizer(tmp_path / "hf")
    (old / builtin.MARKER).write_text(json.dumps({"format": builtin.FORMAT_VERSION}))
    ours = load_tokenizer(old)
    text = "Hello world, this is a tiny model"
    assert Backend.from_file(str(old / "tokenizer.json")).encode(text).ids == ours.encode(text, add_bos=False)
    assert not builtin._adds_bos(old)
    builtin._write_tokenizer(old, old)
    assert builtin._adds_bos(old) and builtin._is_complete(old)
    assert json.loads((old / "tokenizer_config.json").read_text())["add_bos_token"] is True
    assert AutoTokenizer.from_pretrained(old)(text).input_ids == ours.encode(text) == [BOS_ID, *ours.encode(text)[1:]]
