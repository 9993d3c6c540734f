"""Loading a Hugging Face checkpoint's safetensors weights into a model (config.json is read by
model_config.py). The model says where each tensor goes (`checkpoint_target`): its own parameter, a
slice of a packed one (q/k/v, gate/up) or one expert's slice of a packed MoE weight; each
parameter's `weight_loader` reads only the part its tensor-parallel rank holds.

An fp8 block-scaled checkpoint (quantization.py) pairs each quantized `X.weight` with
`X.weight_scale_inv`: unless the model keeps the layer in fp8 (`keeps_fp8(X)`; on CUDA the linear
layers, and the MoE experts on the fused path: layers/fp8_layers.py), the weight reaches its
`weight_loader` as a DequantizedSlice, which reads (and dequantizes) only the blocks a narrow asks for.
With --quantization fp8 (at_load) an unquantized checkpoint's weights are quantized as they are read.

Per-layer scales of an fp8 KV cache (`self_attn.k_scale` / `v_scale`, or on k_proj / v_proj, or one
`kv_scale`) are not parameters: they set the attention layer's k_scale / v_scale."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from executor_service.fp8 import dequantize_weight_blocks, quantize_weight_blocks
from executor_service.quantization import BlockFP8Config, quantized_at_load

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"


def checkpoint_tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or shards with an index)."""
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    names: dict[str, Path] = {}
    for path in files:
        with safe_open(path, "pt") as f:
            names.update(dict.fromkeys(f.keys(), path))
    return names


def head_is_tied(files: dict[str, Path], tie_word_embeddings: bool) -> bool:
    """Whether the LM head is the input embedding. A checkpoint without `lm_head.weight` has none of
    its own. One that stores it under a config.json that ties them is tied only where the stored
    head equals the embeddings: transformers unties a head whose stored values differ (with a
    warning) and serves the stored head, so tying it here would generate other tokens."""
    head, embed = files.get("lm_head.weight"), files.get("model.embed_tokens.weight")
    if head is None:
        return True
    if not tie_word_embeddings or embed is None:
        return False
    with safe_open(head, "pt") as f:
        head_tensor = f.get_tensor("lm_head.weight")
    with safe_open(embed, "pt") as f:
        embed_tensor = f.get_tensor("model.embed_tokens.weight")
    if head_tensor.dtype == embed_tensor.dtype and torch.equal(head_tensor, embed_tensor):
        return True
    logger.warning(
        "config.json sets tie_word_embeddings, but the checkpoint's lm_head.weight differs from "
        "model.embed_tokens.weight: serving the stored head untied (as transformers does)"
    )
    return False


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
        return self._lazy[:] if self.shape else self._lazy[...]


class DequantizedSlice:
    """An e4m3 checkpoint weight and its per-block weight_scale_inv, read as fp32 values: `narrow`
    reads the whole blocks around the part asked for, dequantizes them and cuts the part out."""

    def __init__(self, weight: CheckpointSlice, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
        self._weight, self._scale_inv, self._block = weight, scale_inv, block
        self.shape = weight.shape
        rows, cols = (-(-n // b) for n, b in zip(self.shape, block, strict=True))
        if tuple(scale_inv.shape) != (rows, cols):
            raise ValueError(
                f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a weight {tuple(self.shape)} in "
                f"{block[0]}x{block[1]} blocks: expected ({rows}, {cols})"
            )

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        b = self._block[dim]
        lo, hi = start // b * b, min(-(-(start + length) // b) * b, self.shape[dim])
        weight = self._weight.narrow(dim, lo, hi - lo)
        scale_inv = self._scale_inv.narrow(dim, lo // b, -(-(hi - lo) // b))
        full = dequantize_weight_blocks(weight, scale_inv, torch.float32, self._block)
        return full.narrow(dim, start - lo, length)

    def read(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])


def read_tensor(loaded: torch.Tensor | CheckpointSlice | DequantizedSlice) -> torch.Tensor:
    return loaded.read() if isinstance(loaded, CheckpointSlice | DequantizedSlice) else loaded


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor | CheckpointSlice) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(read_tensor(loaded_weight))


def load_weights(
    model: nn.Module,
    model_dir: str | Path,
    skip: frozenset[str] = frozenset(),
    quantization: BlockFP8Config | None = None,
    keeps_fp8=lambda name: False,
) -> None:
    """Copy checkpoint tensors into `model` (a models.base.CausalLM): each goes where
    `model.checkpoint_target(name)` says, through its parameter's `weight_loader`. With an fp8
    checkpoint, `keeps_fp8(weight name)` says whether that weight's layer holds e4m3 weights (its
    weight_scale_inv is then loaded as a parameter too); other quantized weights are dequantized."""
    params = dict(model.named_parameters())
    files = checkpoint_tensor_files(model_dir)
    scales = _dequantized_scales(files, quantization, keeps_fp8)
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    _check_fp8_weights(by_file, quantization.block if quantization is not None else None)
    # --quantization fp8: each weight an FP8 checkpoint would quantize is quantized whole, before any
    # rank takes its shard, then loaded as that checkpoint's e4m3 weight and scales would be.
    at_load = quantization is not None and quantization.at_load
    loaded: set[str] = set()
    with tqdm(total=len(files), desc="Loading weights", unit="tensor", disable=None) as bar:
        for path, names in by_file.items():
            with safe_open(path, "pt") as f:
                for name in names:
                    bar.update(1)
                    # Older checkpoints store the rotary buffer; it is recomputed from rope_theta.
                    if name in skip or name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name.endswith(".weight_scale_inv") and name[: -len("_scale_inv")] in scales:
                        continue  # read with its weight
                    tensor = CheckpointSlice(f.get_slice(name))
                    if _load_kv_scale(model, name, tensor):
                        continue
                    if name in scales:
                        tensor = DequantizedSlice(tensor, scales[name], quantization.block)
                    elif at_load and quantized_at_load(name):
                        # On the parameter's device: a GPU quantizes an 8B model's weights in seconds.
                        device = _param(params, model.checkpoint_target(name)[0], name).device
                        quantized, scale_inv = quantize_weight_blocks(
                            tensor.read().to(device).float(), quantization.block
                        )
                        if keeps_fp8(name):  # the layer holds e4m3: the weight and its block scales
                            loaded.add(_load_into(model, params, name + "_scale_inv", scale_inv))
                            tensor = quantized
                        else:
                            tensor = dequantize_weight_blocks(
                                quantized, scale_inv, torch.float32, quantization.block
                            )
                    loaded.add(_load_into(model, params, name, tensor))
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(missing[:8])}")


def _load_into(model: nn.Module, params: dict[str, nn.Parameter], name: str, tensor) -> str:
    """One checkpoint tensor through its parameter's weight_loader; returns the parameter's name."""
    target, shard_id = model.checkpoint_target(name)
    param = _param(params, target, name)
    if shard_id is None:
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)
    return target


def _dequantized_scales(
    files: dict[str, Path], quantization: BlockFP8Config | None, keeps_fp8
) -> dict[str, torch.Tensor]:
    """Weight name -> its weight_scale_inv, for the fp8 weights to dequantize at load."""
    names = [n for n in files if n.endswith(".weight_scale_inv")]
    if names and quantization is None:
        raise ValueError(
            f"checkpoint tensor {names[0]!r} is a block scale, but config.json has no quantization_config "
            "with quant_method fp8"
        )
    scales = {}
    for name in names:
        weight = name[: -len("_scale_inv")]
        if not keeps_fp8(weight):
            with safe_open(files[name], "pt") as f:
                scales[weight] = f.get_tensor(name)
    return scales


def _check_fp8_weights(by_file: dict[Path, list[str]], block: tuple[int, int] | None) -> None:
    """Refuse, naming the tensor, what the loaders would otherwise read as wrong numbers: an fp8
    tensor without a weight_scale_inv (it would be copied unscaled; per-tensor `weight_scale` is not
    read), a weight with a weight_scale_inv that is not e4m3 (e4m3 bytes stored as uint8 would be
    read as integers; a 16-bit one may already be dequantized), and a weight_scale_inv that is not
    the weight's block grid (a rank reads its shard's scales by position: on CUDA an extra column of
    blocks would go unnoticed). Only the safetensors headers are read. (`block` is None only for a
    checkpoint without scales: _dequantized_scales refuses scales without a quantization_config.)"""
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path, names in by_file.items():
        with safe_open(path, "pt") as f:
            for name in names:
                lazy = f.get_slice(name)
                meta[name] = (lazy.get_dtype(), tuple(lazy.get_shape()))
    for name, (dtype, shape) in meta.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = meta.get(name + "_scale_inv")
        if scale is None:
            if dtype.startswith("F8"):
                raise ValueError(
                    f"checkpoint tensor {name!r} is {dtype} but has no {name}_scale_inv: tandem reads fp8 "
                    "weights with one scale per 128x128 block (per-tensor weight_scale is not supported)"
                )
            continue
        if dtype != "F8_E4M3":
            raise ValueError(
                f"checkpoint tensor {name!r} has a weight_scale_inv but is stored as {dtype}: the weights "
                "of an fp8 checkpoint must be e4m3 (safetensors F8_E4M3, torch.float8_e4m3fn)"
            )
        grid = tuple(-(-n // b) for n, b in zip(shape, block, strict=False))
        if len(shape) != 2 or scale[1] != grid:
            raise ValueError(
                f"checkpoint tensor {name + '_scale_inv'!r} of shape {scale[1]} for a weight {shape} in "
                f"{block[0]}x{block[1]} blocks: expected {grid}"
            )


def _param(params: dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
    if target not in params:
        raise ValueError(f"checkpoint tensor {source!r} has no matching model parameter {target!r}")
    return params[target]


# checkpoint name suffix -> the attention layer's attributes it sets
KV_SCALE_SUFFIXES = {
    "self_attn.k_scale": ("k_scale",),
    "self_attn.v_scale": ("v_scale",),
    "self_attn.k_proj.k_scale": ("k_scale",),
    "self_attn.v_proj.v_scale": ("v_scale",),
    "self_attn.kv_scale": ("k_scale", "v_scale"),
}


def _load_kv_scale(model: nn.Module, name: str, tensor: CheckpointSlice) -> bool:
    """Set `model.layers.N.self_attn.attn.k_scale` (v_scale) from a KV-cache scale tensor; False
    for any other tensor."""
    for suffix, attrs in KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            layer = name[: -len(suffix)] + "self_attn.attn"
            attention = model.get_submodule(layer)
            value = float(tensor.read().float().reshape(-1)[0])
            if not value > 0:
                raise ValueError(f"checkpoint tensor {name!r} must be a positive scale, is {value}")
            for attr in attrs:
                setattr(attention, attr, value)
            return True
    return False
