"""The mark of a layer with a Triton-fused path. A model declares which fused ops apply to it
(`CausalLM.fused_ops`); the model runner turns on exactly the layers whose op is declared."""

from __future__ import annotations


class Fusable:
    # The fused kernel this layer can use: "rms_norm", "silu_and_mul", "qk_norm_rope", "rope",
    # "fused_moe".
    fused_op: str = ""
    # Set by the model runner (CUDA with triton, the op declared by the model).
    fused: bool = False
    # The weight shape (n, k) of the fp8 linear layer this op's output feeds, when the fused kernel
    # quantizes its output for that layer's GEMM itself (CausalLM.fuse_fp8_quantization); None: a
    # plain tensor out. A shape, not the layer: a module held here would become a submodule.
    quantize_for: tuple[int, int] | None = None

    def quantize_rows_multiple(self, num_tokens: int, dtype, device) -> int:
        """0: no quantization here; else the layout fp8_linear would give the activation of
        num_tokens tokens (fp8_gemm_triton.fp8_input_rows_multiple)."""
        if self.quantize_for is None:
            return 0
        from executor_service.layers.fp8_gemm_triton import fp8_input_rows_multiple

        return fp8_input_rows_multiple(num_tokens, *self.quantize_for, dtype, device)
