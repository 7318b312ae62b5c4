"""Text <-> token ids for a checkpoint directory: its ``tokenizer.json`` (Hugging Face
``tokenizers``), plus the chat prompt format the server uses.

Chat messages are rendered as ``"<role>: <content>\\n"`` lines followed by ``"assistant:"``:
a plain format every base model can continue (checkpoint chat templates need Jinja and are
not evaluated).
"""

from __future__ import annotations

from pathlib import Path

from pagedweight.errors import PagedWeightError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HfTokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise PagedWeightError(f"{model_dir}: no tokenizer.json; send prompts as token id lists instead")
        self._tok = HfTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def chat_prompt(messages: list[dict]) -> str:
    lines = [f"{m['role']}: {m['content']}\n" for m in messages]
    return "".join(lines) + "assistant:"


class IncrementalDecoder:
    """Text deltas of a growing id list; holds back an incomplete UTF-8 sequence (byte-level
    tokenizers split characters across tokens) until its last byte arrives."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def push(self, new_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
