"""Text <-> token ids for a checkpoint directory: its ``tokenizer.json`` (Hugging Face
``tokenizers``), plus the chat prompt format the server uses.

Chat messages are rendered as ``"<role>: <content>\\n"`` lines followed by ``"assistant:"``:
a plain format every base model can continue (checkpoint chat templates need Jinja and are
not evaluated).

The server calls ``encode`` and ``decode`` on worker threads: both go through the library's
batch entry points, which release the GIL while they work (the single-text ones hold it, so a
long prompt would stall every other client's event loop).
"""

from __future__ import annotations

import functools
from pathlib import Path

from pagedweight.errors import PagedWeightError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HfTokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise PagedWeightError(f"{model_dir}: no tokenizer.json; send prompts as token id lists instead")
        self._tok = HfTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        decoder = self._tok.decoder
        self._byte_level = decoder is not None and type(decoder).__name__ == "ByteLevel"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode_batch([ids], skip_special_tokens=True)[0]

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 (one tokenizer per server, kept for its life)
    def token_text(self, token_id: int) -> str:
        """One token on its own, as log-probability listings show it."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level token may hold part of a character,
        which its text shows only as U+FFFD."""
        piece = self._tok.id_to_token(token_id)
        if self._byte_level and piece is not None and all(ch in _BYTE_OF_CHAR for ch in piece):
            return bytes(_BYTE_OF_CHAR[ch] for ch in piece)
        return self.token_text(token_id).encode("utf-8")

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes any one token stands for, counted on its vocabulary string (which
        is at least as long as the text it decodes to for byte-level and SentencePiece tokens):
        a text of more bytes than ``n x max_token_bytes`` cannot be fewer than ``n`` tokens."""
        return max((len(t.encode("utf-8", "replace")) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: the character standing for each byte (printable bytes stand
    for themselves; the others are shifted past U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    out, shift = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + shift)] = b
            shift += 1
    return out


_BYTE_OF_CHAR = _byte_level_alphabet()


def message_text(content: str | list[dict] | None) -> str:
    """A chat message's text: a string, or a list of text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


def chat_prompt(messages: list[dict]) -> str:
    lines = [f"{m['role']}: {message_text(m['content'])}\n" for m in messages]
    return "".join(lines) + "assistant:"


class IncrementalDecoder:
    """Text deltas of a growing id list, decoding only a short window each time: the tokens
    since the last delta plus a few before them (a token's text can depend on its neighbour,
    e.g. a leading space). Holds back an incomplete UTF-8 sequence (byte-level tokenizers split
    characters across tokens) until its last byte arrives."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer, self.ids = tokenizer, []
        self.prefix_offset = 0  # the window starts here
        self.read_offset = 0  # text up to here has been handed out

    def push(self, new_ids: list[int]) -> str:
        if self.tokenizer is None or not new_ids:
            return ""
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """At the end: whatever is held back (an incomplete character shows as U+FFFD)."""
        if self.tokenizer is None or self.read_offset == len(self.ids):
            return ""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]
