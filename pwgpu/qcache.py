"""A disk cache for the quality tools' expensive intermediate results (reference logits, the
per-block statistics of an evaluated plan, calibration estimates), so that a long run that is
stopped resumes where it was, and a rerun with one more budget or seed recomputes only that.

Entries are ``.npz`` files named by a SHA-256 of everything that determines them: the
checkpoint's bytes (``model_key``), the token ids, the plan, the settings. A new checkpoint or
other text therefore never reads a stale entry. Writes are atomic (temporary file + rename).
Location: ``--cache-dir``, else ``$PAGEDWEIGHT_CACHE``, else ``~/.cache/pagedweight``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

_MODEL_KEYS: dict[tuple[str, float, int], str] = {}


def default_cache_dir() -> Path:
    return Path(os.environ.get("PAGEDWEIGHT_CACHE") or Path.home() / ".cache" / "pagedweight")


class DiskCache:
    """``spent_s`` adds up the compute time of every distinct entry saved or loaded (entries
    saved with ``seconds``), once per entry however often it is read, so a rerun served from the
    cache still reports what a fresh run would have spent computing its results."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root else default_cache_dir()
        self.spent_s = 0.0
        self._counted: set[str] = set()

    def _count(self, key: str, seconds: float) -> None:
        if key not in self._counted:
            self._counted.add(key)
            self.spent_s += seconds

    @staticmethod
    def model_key(model_dir: str | Path) -> str:
        """SHA-256 of the checkpoint's config and weight files (memoised per file and mtime)."""
        model_dir = Path(model_dir)
        files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
        stamp = (str(model_dir.resolve()), max(f.stat().st_mtime for f in files), sum(f.stat().st_size for f in files))
        if stamp not in _MODEL_KEYS:
            h = hashlib.sha256()
            for f in files:
                with open(f, "rb") as fh:
                    for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                        h.update(chunk)
            _MODEL_KEYS[stamp] = h.hexdigest()
        return _MODEL_KEYS[stamp]

    @staticmethod
    def key(kind: str, *parts) -> str:
        """``kind/<sha256 of the parts>``; arrays are hashed by dtype, shape and bytes."""
        h = hashlib.sha256()
        for p in parts:
            if isinstance(p, np.ndarray):
                h.update(f"{p.dtype}{p.shape}".encode())
                h.update(np.ascontiguousarray(p).tobytes())
            else:
                h.update(repr(p).encode())
            h.update(b"\0")
        return f"{kind}/{h.hexdigest()[:32]}"

    def path(self, key: str) -> Path:
        return self.root / f"{key}.npz"

    def load(self, key: str) -> dict[str, np.ndarray] | None:
        p = self.path(key)
        if not p.is_file():
            return None
        try:
            with np.load(p, allow_pickle=False) as z:
                out = {k: z[k] for k in z.files}
        except (OSError, ValueError):  # a truncated entry from a killed run: recompute it
            return None
        self._count(key, float(out.pop("_seconds", 0.0)))
        return out

    def save(self, key: str, seconds: float | None = None, **arrays: np.ndarray) -> None:
        """Store ``arrays``; ``seconds``: what computing them took."""
        if seconds is not None:
            self._count(key, seconds)
            arrays["_seconds"] = np.float64(seconds)
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.stem}.tmp{os.getpid()}.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, p)
