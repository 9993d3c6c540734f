"""What the executor reads from a checkpoint's config.json (and generation_config.json): one typed
ModelConfig for every family, with the rope scaling normalised from either spelling (transformers 5's
`rope_parameters`, older files' `rope_scaling` beside a top-level `rope_theta`) and the sliding
window resolved to the one attention actually uses."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executor_service.layers.rotary import ROPE_TYPES
from executor_service.quantization import BlockFP8Config, parse_quantization


@dataclass
class ModelConfig:
    """The fields of a HF config.json that the executor uses."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    # rope_type ("default", "linear", "dynamic", "llama3", "yarn"), rope_theta and the type's own keys.
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    # The longest context the positions support: max_position_embeddings, or YaRN's extension of it.
    max_context_len: int = 0
    # Keys further back than this are not attended (Mistral); None when every layer attends fully.
    sliding_window: int | None = None
    mlp_bias: bool = False
    # Mixture of experts (Qwen3-MoE); num_experts 0 for a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # fp8 block-scaled weights (quantization.py); None for an unquantized checkpoint.
    quantization: BlockFP8Config | None = None

    def __post_init__(self) -> None:
        self.max_context_len = self.max_context_len or self.max_position_embeddings

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has a sparse MoE block (transformers' Qwen3-MoE rule)."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


# What every family's config.json has, read without a default.
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


class MissingConfigKeys(ValueError):
    """A config.json without a key every family has: maybe another family's (GPT-2's n_embd),
    which the caller can name by its `architecture`."""

    def __init__(self, message: str, architecture: str) -> None:
        super().__init__(message)
        self.architecture = architecture


def _read_json(path: Path) -> dict:
    """A JSON object from `path`; ValueError naming the file for anything else."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def rope_parameters_of(cfg: dict, where: str) -> dict[str, Any]:
    """The rope parameters of a config.json as transformers' `standardize_rope_params` leaves them."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.pop("type", None)
    rope.setdefault("rope_type", rope_type or "default")
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["rope_theta"] = float(rope["rope_theta"])
    if rope["rope_type"] not in ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope['rope_type']!r} in {where} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if rope["rope_type"] in ("llama3", "yarn"):
        # A top-level original_max_position_embeddings wins over the rope block's own: transformers
        # re-standardises the parameters when it builds the rotary table and overwrites the block's
        # value with the top-level one (a file carrying both, different, would rotate differently).
        if cfg.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    needed = {"linear": ["factor"], "dynamic": ["factor"], "yarn": ["factor"]}.get(rope["rope_type"], [])
    if rope["rope_type"] == "llama3":
        needed = ["factor", "low_freq_factor", "high_freq_factor"]
    missing = [key for key in needed if rope.get(key) is None]
    if missing:
        raise ValueError(f"rope_type {rope['rope_type']!r} in {where} needs {', '.join(missing)}")
    return rope


def _sliding_window(cfg: dict) -> int | None:
    """Qwen2/Qwen3 write the window even when `use_sliding_window` is off; Mistral has no switch."""
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", True):
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    where = f"{model_dir}/config.json"
    cfg = _read_json(model_dir / "config.json")
    architectures = cfg.get("architectures") or []
    architecture = architectures[0] if architectures else cfg.get("model_type", "unknown")
    if missing := [key for key in REQUIRED_KEYS if key not in cfg]:
        raise MissingConfigKeys(f"{where} has no {', '.join(missing)}", architecture)
    activation = cfg.get("hidden_act", "silu")
    if activation not in ("silu", "swish"):  # (transformers' "swish" is SiLU by another name)
        raise ValueError(f"hidden_act {activation!r} in {where} is not supported; supported: silu, swish")
    rope = rope_parameters_of(cfg, where)
    max_positions = cfg["max_position_embeddings"]
    max_context_len = max_positions
    if rope["rope_type"] == "yarn":
        # YaRN stretches the pretrained context by `factor` (Qwen3 keeps max_position_embeddings at
        # its pretrained length and adds the rope_scaling block).
        max_context_len = max(max_positions, int(rope["factor"] * rope["original_max_position_embeddings"]))
    num_heads = cfg["num_attention_heads"]
    eos = _as_id_list(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos += _as_id_list(_read_json(gen_path).get("eos_token_id"))
    return ModelConfig(
        architecture=architecture,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size") or 0,
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope["rope_theta"],
        max_position_embeddings=max_positions,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", False),
        dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        eos_token_ids=list(dict.fromkeys(eos)),
        rope_parameters=rope,
        max_context_len=max_context_len,
        sliding_window=_sliding_window(cfg),
        mlp_bias=cfg.get("mlp_bias", False),
        num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
        num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
        moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
        norm_topk_prob=cfg.get("norm_topk_prob", False),
        decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
        mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
        quantization=parse_quantization(cfg.get("quantization_config")),
    )
