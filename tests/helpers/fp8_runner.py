"""Shared by the tests: from test_fp8_checkpoint.py (an FP8 checkpoint's model as the CUDA model
runner loads it, built on the CPU)."""

from __future__ import annotations


def load_as_runner_on_cuda(path, tp_rank: int, tp_size: int, quantize_at_load: bool = False):
    """The model of an fp8 checkpoint as the CUDA model runner loads it with the fused MoE path (fp8
    linear layers and experts), built and loaded on the CPU."""
    from executor_service.layers.fp8_layers import convert_to_fp8
    from executor_service.loader import checkpoint_tensor_files, load_weights
    from executor_service.model_config import load_model_config
    from executor_service.models import get_model_class
    from executor_service.quantization import scale_names

    mc = load_model_config(path)
    if quantize_at_load:  # as ExecutorConfig(quantization="fp8") sets it
        from executor_service.quantization import BlockFP8Config

        mc.quantization = BlockFP8Config(at_load=True)
    model = get_model_class(mc.architecture)(mc, tie_word_embeddings=False, tp_rank=tp_rank, tp_size=tp_size)
    kept = convert_to_fp8(model, scale_names(checkpoint_tensor_files(path), mc.quantization), mc.quantization.block,
                          experts=True)  # fmt: skip
    load_weights(model, path, quantization=mc.quantization, keeps_fp8=kept.__contains__)
    return model
