"""Which layers of a model keep an fp8 checkpoint's weights in e4m3 (on CUDA): every linear layer
(linear.py, the W8A8 GEMM) and, when the fused MoE kernels run, the experts (moe.py); the loader
dequantizes every other quantized weight to the compute dtype."""

from __future__ import annotations

from torch import nn

from executor_service.layers.linear import LinearBase
from executor_service.layers.moe import FusedMoE


def convert_to_fp8(
    model: nn.Module, scale_names, block: tuple[int, int], experts: bool = False
) -> frozenset[str]:
    """to_fp8() every linear layer whose checkpoint weights carry a weight_scale_inv (scale_names:
    quantization.scale_names), and with `experts` every FusedMoE; returns those checkpoint weight
    names (the loader's keeps_fp8)."""
    layers = (LinearBase, FusedMoE) if experts else (LinearBase,)
    kept = set()
    for name in scale_names:
        weight = name.removesuffix("_scale_inv")
        target, _ = model.checkpoint_target(weight)
        layer = model.get_submodule(target.rpartition(".")[0])
        if isinstance(layer, layers):
            if layer.block == (1, 1):
                layer.to_fp8(block)
            kept.add(weight)
    return frozenset(kept)
