"""The mark of a layer with a Triton-fused path. A model declares which fused ops apply to it
(`CausalLM.fused_ops`); the model runner turns on exactly the layers whose op is declared."""

from __future__ import annotations


class Fusable:
    # The fused kernel this layer can use: "rms_norm", "silu_and_mul", "qk_norm_rope", "rope",
    # "fused_moe".
    fused_op: str = ""
    # Set by the model runner (CUDA with triton, the op declared by the model).
    fused: bool = False
