"""Which ``config.json`` keys each family implements, which it ignores, and the refusal of the rest.

Every key of a checkpoint's config is one of:

- *implemented*: read by the loader, and every value a rule below accepts computes what
  transformers computes for it; a value outside the rule is refused (``attention_bias: true``
  where no bias is loaded, ``hidden_act: relu``, a RoPE type or a sliding window we do not
  compute, a quantization method we do not load, ...);
- *ignored*: cannot change a forward pass (training losses and dropout, labels, generation
  defaults, parallelism hints, bookkeeping), listed in one line when the checkpoint loads;
- anything else: refused by name, since we cannot know it leaves the numbers alone. A key set
  to ``null`` is treated as unset and ignored.

All refusals of one config come in one line, so a checkpoint is diagnosed in one run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

Rule = Callable[[Any, dict], str | None]  # (value, whole config) -> why it is refused, or None


def any_value(value: Any, cfg: dict) -> str | None:
    return None


def only(*allowed: Any) -> Rule:
    def rule(value: Any, cfg: dict) -> str | None:
        # ``False == 0`` in Python: a bool only matches a bool.
        if any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
            return None
        return "implemented: " + ", ".join(_show(a) for a in allowed)

    return rule


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def _positive_int(value: Any, cfg: dict) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) and value > 0 else "must be an integer > 0"


def _count(value: Any, cfg: dict) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else "must be an integer >= 0"


def _window_unused(value: Any, cfg: dict) -> str | None:
    """A sliding window changes nothing while it spans every position the model accepts."""
    if value is None or (isinstance(value, int) and value >= cfg.get("max_position_embeddings", math.inf)):
        return None
    return "sliding-window attention is not implemented; implemented: null or >= max_position_embeddings"


def _qwen_sliding(value: Any, cfg: dict) -> str | None:
    """Qwen: ``use_sliding_window`` switches the window on for the first ``max_window_layers``."""
    if not value:
        return None
    return _window_unused(cfg.get("sliding_window"), cfg) and "sliding-window attention is not implemented"


def _full_attention_layers(value: Any, cfg: dict) -> str | None:
    if value is None or all(t == "full_attention" for t in value):
        return None
    return "only 'full_attention' layers are implemented"


def _leading_dense(value: Any, cfg: dict) -> str | None:
    layers = sorted(value or [])
    if layers == list(range(len(layers))):
        return None
    return "only leading dense layers are implemented (0, 1, ..., n - 1)"


# RoPE: plain, or YaRN (DeepSeek-V2/V3 ship it, Qwen3 documents it for long contexts).
ROPE_TYPES = ("default", "yarn")
_ROPE_KEYS = {"rope_type", "type", "rope_theta"}
_YARN_KEYS = {
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
}


def _rope(value: Any, cfg: dict) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return "must be an object"
    kind = value.get("rope_type", value.get("type", "default"))
    if kind not in ROPE_TYPES:
        return f"rope_type {kind!r} is not implemented; implemented: {', '.join(ROPE_TYPES)}"
    if value.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial_rotary_factor != 1 is not implemented"
    allowed = _ROPE_KEYS | {"partial_rotary_factor"} | (_YARN_KEYS if kind == "yarn" else set())
    unknown = sorted(k for k in value if k not in allowed)
    if unknown:
        return f"keys {unknown} are not implemented for rope_type {kind!r}"
    if kind == "yarn" and not value.get("original_max_position_embeddings"):
        return "yarn needs original_max_position_embeddings"
    return None


# Quantised checkpoints: FP8 E4M3 weights with one fp32 ``weight_scale_inv`` per 128 x 128 block
# (DeepSeek-V3, Qwen3-FP8). Weights stay FP8; activations are not quantised (bf16 compute).
FP8_BLOCK = [128, 128]
_FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}


def _quantization(value: Any, cfg: dict) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return "must be an object"
    method = value.get("quant_method")
    if method != "fp8":
        return f"quant_method {method!r} is not implemented; implemented: 'fp8' (E4M3, weight_block_size [128, 128])"
    if value.get("fmt", "e4m3") != "e4m3":
        return f"fmt {value['fmt']!r} is not implemented; implemented: 'e4m3'"
    if list(value.get("weight_block_size") or []) != FP8_BLOCK:
        return f"weight_block_size {value.get('weight_block_size')} is not implemented; implemented: {FP8_BLOCK}"
    if value.get("activation_scheme", "dynamic") != "dynamic":
        return f"activation_scheme {value['activation_scheme']!r} is not implemented; implemented: 'dynamic'"
    unknown = sorted(k for k in value if k not in _FP8_KEYS)
    return f"keys {unknown} are not implemented for quant_method 'fp8'" if unknown else None


def _dtype(value: Any, cfg: dict) -> str | None:
    return only("bfloat16", "float16", "float32")(value, cfg)


# ---- the schemas ------------------------------------------------------------------------------

# Keys no forward pass reads: training (losses, dropout, router noise: applied only in training),
# labels and tasks, generation defaults, parallelism hints (pretraining_tp and ep_size compute the
# same numbers), bookkeeping. ``pad_token_id`` only masks the embedding's gradient.
IGNORED: frozenset[str] = frozenset(
    {
        "architectures", "auto_map", "transformers_version", "_name_or_path", "name_or_path", "model_name",
        "initializer_range", "use_cache", "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha",
        "seq_aux", "router_jitter_noise", "router_z_loss_coef", "attention_dropout", "hidden_dropout",
        "output_hidden_states", "output_attentions", "return_dict", "use_return_dict", "torchscript",
        "chunk_size_feed_forward", "id2label", "label2id", "num_labels", "problem_type", "pad_token_id",
        "sep_token_id", "decoder_start_token_id", "tokenizer_class", "prefix", "finetuning_task",
        "task_specific_params", "pretraining_tp", "ep_size", "use_bfloat16", "tf_legacy_loss", "pruned_heads",
        "is_decoder", "tie_encoder_decoder", "cross_attention_hidden_size",
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
        "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
        "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
        "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
        "begin_suppress_tokens",
    }
)  # fmt: skip

COMMON: dict[str, Rule] = {
    "model_type": any_value,
    "vocab_size": _positive_int,
    "hidden_size": _positive_int,
    "num_hidden_layers": _positive_int,
    "num_attention_heads": _positive_int,
    "num_key_value_heads": _positive_int,
    "num_experts_per_tok": _positive_int,
    "max_position_embeddings": _positive_int,
    "rms_norm_eps": any_value,
    "tie_word_embeddings": any_value,
    "bos_token_id": any_value,
    "eos_token_id": any_value,
    "dtype": _dtype,
    "torch_dtype": _dtype,
    "rope_theta": any_value,
    "rope_parameters": _rope,
    "rope_scaling": _rope,
    "hidden_act": only("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new"),
    "quantization_config": _quantization,
    "is_encoder_decoder": only(False),
    "add_cross_attention": only(False),
}

_QWEN: dict[str, Rule] = {
    "intermediate_size": any_value,  # the dense layers' FFN
    "moe_intermediate_size": _positive_int,
    "num_experts": _positive_int,
    "num_local_experts": _positive_int,
    "norm_topk_prob": any_value,
    "head_dim": _positive_int,
    "mlp_only_layers": _leading_dense,
    "decoder_sparse_step": only(1),
    "use_sliding_window": _qwen_sliding,
    "sliding_window": any_value,  # judged with use_sliding_window
    "max_window_layers": any_value,
    "layer_types": _full_attention_layers,
}

_DEEPSEEK: dict[str, Rule] = {
    "intermediate_size": _positive_int,
    "moe_intermediate_size": _positive_int,
    "n_routed_experts": _positive_int,
    "n_shared_experts": _count,
    "first_k_dense_replace": _count,
    "moe_layer_freq": only(1),
    "kv_lora_rank": _positive_int,
    "q_lora_rank": any_value,  # null: queries projected directly (V2-Lite)
    "qk_nope_head_dim": _positive_int,
    "qk_rope_head_dim": _positive_int,
    "v_head_dim": _positive_int,
    "qk_head_dim": lambda v, cfg: (
        None
        if v == cfg.get("qk_nope_head_dim", 0) + cfg.get("qk_rope_head_dim", 0)
        else "must be qk_nope_head_dim + qk_rope_head_dim"
    ),
    "head_dim": lambda v, cfg: None if v == cfg.get("qk_rope_head_dim") else "must equal qk_rope_head_dim",
    "n_group": any_value,
    "topk_group": any_value,
    "routed_scaling_factor": any_value,
    "attention_bias": any_value,
    "mlp_bias": only(False),
}

SCHEMAS: dict[str, dict[str, Rule]] = {
    "mixtral": COMMON
    | {
        "intermediate_size": _positive_int,
        "num_local_experts": _positive_int,
        "num_experts": _positive_int,
        "head_dim": _positive_int,
        "sliding_window": _window_unused,
    },
    "qwen2_moe": COMMON | _QWEN | {"shared_expert_intermediate_size": _count, "qkv_bias": any_value},
    "qwen3_moe": COMMON | _QWEN | {"attention_bias": any_value},
    "olmoe": COMMON
    | {
        "intermediate_size": _positive_int,
        "num_experts": _positive_int,
        "num_local_experts": _positive_int,
        "norm_topk_prob": any_value,
        "attention_bias": any_value,
        "clip_qkv": any_value,
        "head_dim": _positive_int,
        "sliding_window": _window_unused,  # transformers' OLMoE applies one if the config sets it
    },
    "deepseek_v2": COMMON
    | _DEEPSEEK
    | {
        "topk_method": only("greedy", "group_limited_greedy"),
        "scoring_func": only("softmax"),
        # transformers' DeepSeek-V2 never renormalises the top-k weights, DeepSeek's own code
        # does when this is true: two answers, so only false is implemented.
        "norm_topk_prob": only(False),
    },
    "deepseek_v3": COMMON
    | _DEEPSEEK
    | {
        "topk_method": only("noaux_tc"),
        "scoring_func": only("sigmoid"),
        "norm_topk_prob": any_value,
        "rope_interleave": any_value,
        # The multi-token-prediction module (speculative decoding) is not run: its layers'
        # tensors are skipped and listed.
        "num_nextn_predict_layers": _count,
        "num_mtp_layers": _count,
    },
}
FAMILIES: tuple[str, ...] = tuple(SCHEMAS)


def check_keys(cfg: dict, family: str) -> tuple[list[str], list[str]]:
    """(refusals, ignored keys) of ``cfg`` against ``family``'s schema: each refusal names its key."""
    schema = SCHEMAS[family]
    refused, ignored = [], []
    for key, value in cfg.items():
        rule = schema.get(key)
        if rule is not None:
            why = rule(value, cfg) if value is not None else None
            if why:
                refused.append(f"{key}={_json(value)} ({why})")
        elif key in IGNORED or value is None:
            ignored.append(key)
        else:
            refused.append(f"{key}={_json(value)} (unknown to the {family} loader; it may change the numbers)")
    return refused, sorted(ignored)


def _json(value: Any) -> str:
    import json

    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
