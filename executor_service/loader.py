"""Loading a Hugging Face checkpoint directory: config.json, eos ids and safetensors weights."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"


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


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    cfg = _read_json(model_dir / "config.json")
    architectures = cfg.get("architectures") or []
    architecture = architectures[0] if architectures else cfg.get("model_type", "unknown")
    # transformers 5 writes rope_parameters {rope_theta, rope_type}; older files a top-level rope_theta.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r} in {model_dir}/config.json is not supported yet")
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    num_heads = cfg["num_attention_heads"]
    eos = _as_id_list(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos += _as_id_list(_read_json(gen_path).get("eos_token_id"))
    return ModelConfig(
        architecture=architecture,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", False),
        dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        eos_token_ids=list(dict.fromkeys(eos)),
    )


def checkpoint_tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or shards with an index)."""
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.exists():
        weight_map = _read_json(index)["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    names: dict[str, Path] = {}
    for path in files:
        with safe_open(path, "pt") as f:
            names.update(dict.fromkeys(f.keys(), path))
    return names


class CheckpointSlice:
    """A checkpoint tensor not read yet (safetensors `get_slice`): `narrow` reads only the part
    asked for, so a tensor-parallel rank never reads the whole model; `read()` reads it all."""

    def __init__(self, lazy) -> None:
        self._lazy = lazy
        self.shape = torch.Size(lazy.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._lazy[(slice(None),) * dim + (slice(start, start + length),)]

    def read(self) -> torch.Tensor:
        return self._lazy[:] if self.shape else self.narrow(0, 0, 0).reshape(())


def read_tensor(loaded: torch.Tensor | CheckpointSlice) -> torch.Tensor:
    return loaded.read() if isinstance(loaded, CheckpointSlice) else loaded


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor | CheckpointSlice) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(read_tensor(loaded_weight))


def load_weights(model: nn.Module, model_dir: str | Path, skip: frozenset[str] = frozenset()) -> None:
    """Copy checkpoint tensors into `model`; q/k/v and gate/up go into their packed parameters
    through `model.packed_modules_mapping` and each parameter's `weight_loader`, which reads
    the part of each tensor its rank holds."""
    packed: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    files = checkpoint_tensor_files(model_dir)
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    loaded: set[str] = set()
    with tqdm(total=len(files), desc="Loading weights", unit="tensor", disable=None) as bar:
        for path, names in by_file.items():
            with safe_open(path, "pt") as f:
                for name in names:
                    bar.update(1)
                    # Older checkpoints store the rotary buffer; it is recomputed from rope_theta.
                    if name in skip or name.endswith("rotary_emb.inv_freq"):
                        continue
                    tensor = CheckpointSlice(f.get_slice(name))
                    for shard_name, (packed_name, shard_id) in packed.items():
                        if f".{shard_name}." in name:
                            target = name.replace(f".{shard_name}.", f".{packed_name}.")
                            param = _param(params, target, name)
                            param.weight_loader(param, tensor, shard_id)
                            break
                    else:
                        target = name
                        param = _param(params, target, name)
                        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                    loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(missing[:8])}")


def _param(params: dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
    if target not in params:
        raise ValueError(f"checkpoint tensor {source!r} has no matching model parameter {target!r}")
    return params[target]
