"""A local tokenizer as the token cache uses it (``corpus.py``): a transformers folder
(``AutoTokenizer``, for chat templates) or a bare ``tokenizer.json`` (``tokenizers``),
its EOS token and vocabulary size; nothing is downloaded."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Tokenizer",
    "load_tokenizer",
]


@dataclass(frozen=True)
class Tokenizer:
    """A local tokenizer as the cache uses it: the fast backend (serialized, for the
    workers), the EOS id, the vocabulary size, and the transformers tokenizer when there is
    one (for chat templates)."""

    path: str
    backend_json: str
    eos_id: int
    vocab_size: int
    hf: Any = None

    @property
    def digest(self) -> str:
        template = getattr(self.hf, "chat_template", None) or ""
        text = f"{self.backend_json}\0{template}\0{self.eos_id}"
        return hashlib.sha256(text.encode()).hexdigest()

    def render(self, value: Any, where: str) -> tuple[str, bool]:
        """(text, add_special_tokens) of one record's field: a string as is, a list of
        chat messages through the chat template (which writes its own special tokens)."""
        if isinstance(value, str):
            return value, True
        if isinstance(value, list) and all(isinstance(m, dict) for m in value):
            if self.hf is None or not getattr(self.hf, "chat_template", None):
                raise ValueError(
                    f"{where} holds chat messages, but the tokenizer {self.path} has no chat "
                    f"template: use a tokenizer folder whose tokenizer_config.json has one, or "
                    f"point data.text_field at a text field"
                )
            return self.hf.apply_chat_template(value, tokenize=False), False
        raise ValueError(
            f"{where} must be a string or a list of chat messages, got {type(value).__name__}"
        )


def load_tokenizer(path: str, eos_token: str = "") -> Tokenizer:
    """A tokenizer from a local folder (``AutoTokenizer``, or its ``tokenizer.json``) or a
    ``tokenizer.json`` file; nothing is downloaded."""
    p = Path(path)
    hint = (
        "give a local folder written by tokenizer.save_pretrained (tokenizer.json, "
        "tokenizer_config.json) or a tokenizer.json file"
    )
    if not p.exists():
        raise ValueError(f"data.tokenizer: {p} not found; {hint}")
    hf = None
    if p.is_dir() and (p / "tokenizer_config.json").is_file():
        if importlib.util.find_spec("transformers") is None:
            raise ValueError(f"data.tokenizer {p} is a transformers folder: `pip install .[hf]`")
        import transformers

        try:
            hf = transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception as exc:
            raise ValueError(f"data.tokenizer: {p} could not be loaded ({exc}); {hint}") from None
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"data.tokenizer {p}: {type(hf).__name__} is not a fast tokenizer; save a "
                f"tokenizer.json with it (a fast tokenizer's save_pretrained writes one)"
            )
    else:
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ValueError(f"data.tokenizer: no tokenizer.json in {p}; {hint}")
        import tokenizers

        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:
            raise ValueError(f"data.tokenizer: {file} could not be read ({exc})") from None
    name = eos_token or (getattr(hf, "eos_token", None) if hf is not None else None)
    eos = backend.token_to_id(name) if name else None
    if eos is None:
        special = sorted(t.content for t in backend.get_added_tokens_decoder().values())
        raise ValueError(
            f"data.tokenizer {p}: "
            + (f"no token {name!r}" if name else "no EOS token is configured")
            + f"; set data.eos_token to the token that ends a document (special tokens: "
            f"{special})"
        )
    return Tokenizer(
        path=str(p),
        backend_json=backend.to_str(),
        eos_id=int(eos),
        vocab_size=int(backend.get_vocab_size(with_added_tokens=True)),
        hf=hf,
    )
