"""Text <-> token ids and chat templates, over the `tokenizers` library and jinja2.

A checkpoint directory provides `tokenizer.json` and a chat template (`chat_template.jinja`, or the
`chat_template` field of `tokenizer_config.json`). GGUF files build the same `Tokenizer` from their
metadata (gemmax.weights.gguf). The engine never sees text; the server and `gemmax generate` do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox


class Tokenizer:
    def __init__(self, backend, bos_token_id: int | None, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None):
        self.backend = backend  # tokenizers.Tokenizer
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Raw prompts get `<bos>` prepended (the Gemma tokenizers do not add it themselves)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render the checkpoint's chat template (jinja2 sandbox, as transformers does)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template: use /v1/completions")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message: str):
            raise jinja2.exceptions.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent, ensure_ascii=False)
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **{**self.special_tokens, **kwargs})

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Chat prompt ids: the template emits `<bos>` itself, so none is added here."""
        return self.encode(self.render_chat(messages, **kwargs), add_bos=False)


def with_bos(backend, bos_token: str = "<bos>"):
    """A copy of `backend` whose post-processor adds `bos_token` as Gemma's own tokenizer.json does, so
    transformers and vLLM reading a directory gemmax wrote see the ids gemmax feeds its engine."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    bos_id = backend.token_to_id(bos_token)
    if bos_id is None:
        raise ValueError(f"the tokenizer has no {bos_token!r} token")
    copy = Backend.from_str(backend.to_str())
    copy.post_processor = processors.TemplateProcessing(
        single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token}:1 $B:1", special_tokens=[(bos_token, bos_id)])
    return copy


def load_tokenizer(directory: Path) -> Tokenizer | None:
    """Tokenizer of an HF checkpoint directory, or None when it ships none."""
    from tokenizers import Tokenizer as Backend

    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    backend = Backend.from_file(str(tokenizer_file))
    config_file = directory / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = None
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    elif isinstance(tok_config.get("chat_template"), str):
        template = tok_config["chat_template"]
    specials = {k: v for k, v in tok_config.items() if k.endswith("_token") and isinstance(v, str)}
    bos_token = specials.get("bos_token", "<bos>")
    return Tokenizer(backend, backend.token_to_id(bos_token), template, specials)
