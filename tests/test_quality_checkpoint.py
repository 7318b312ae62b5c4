"""The committed default model: it loads in transformers' MixtralForCausalLM, matches its spec
file, and the analysis forward pass agrees with transformers on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedweight.core.spec import load_model  # noqa: E402

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-moe"


def test_checkpoint_loads_in_mixtral_and_matches_analysis_forward():
    from transformers import MixtralForCausalLM

    from pwgpu.evaluate import MoeForward

    hf = MixtralForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    ids = torch.tensor([[0, 17, 300, 1200, 4000, 5, 9, 77]])
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = MoeForward(MODEL_DIR).logits(ids)
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), float((got - want).abs().max())


def test_checkpoint_matches_spec_file():
    """pagedweight/data/models/tiny-moe.yaml describes exactly this checkpoint."""
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    spec = load_model("tiny-moe")
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    assert (spec.num_experts, spec.top_k, spec.expert_ffn_size, spec.vocab_size) == (
        cfg["num_local_experts"],
        cfg["num_experts_per_tok"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
    )
    assert spec.max_context_tokens <= cfg["max_position_embeddings"]
    assert spec.tie_embeddings == cfg["tie_word_embeddings"]


def test_tokenizer_round_trips_both_domains():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    assert tok.get_vocab_size() == json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    for text in ("def f(x):\n    return {'a': x ** 2}\n", "O Romeo, Romeo! wherefore art thou Romeo?\n"):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
        assert len(ids) < len(text.encode())  # merges learned, not one token per byte
