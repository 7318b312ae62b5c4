"""Fixtures for the engine tests: tiny random checkpoints saved by ``transformers`` itself.

Like tests/kernels, Triton kernels run in the interpreter on a CPU: the switch must be set
before any module defines a ``@triton.jit`` kernel.
"""

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Small but not degenerate: GQA (4 query heads over 2 KV heads), K multiples of 8 for the packed
# formats, more experts than top-k. Shared by every family.
COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _family_config(family: str):
    import transformers as tf

    if family == "mixtral":
        return tf.MixtralConfig(**COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6,
            num_experts_per_tok=2, intermediate_size=80, norm_topk_prob=False,
        )  # fmt: skip
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **COMMON, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, head_dim=16, norm_topk_prob=True
        )
    if family == "olmoe":
        return tf.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2, pad_token_id=0,
                              eos_token_id=1)  # fmt: skip
    raise ValueError(family)


def make_checkpoint(family: str, path, seed: int = 0, dtype=torch.float32):
    """A random ``family`` model saved by transformers to ``path``; returns the HF model (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _family_config(family)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # Random init of the norms is all ones and the routers small: perturb them so that the
    # test sees q/k norms, final norm and routing actually matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.mul_(20.0)
            # bf16-representable values: the engine stores experts at bf16, so an fp32 run of
            # the engine and of transformers start from the same numbers.
            p.copy_(p.to(torch.bfloat16).float())
    model.to(dtype).save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> (directory, HF model) built once per session."""
    out = {}
    for fam in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        d = tmp_path_factory.mktemp(fam)
        out[fam] = (d, make_checkpoint(fam, d))
    return out
