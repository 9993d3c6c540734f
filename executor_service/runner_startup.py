"""Bring up one rank's model runner, in order: load the model (ModelRunner), size the KV cache
over every rank (kv_cache_sizing.py), allocate it with the decode CUDA graphs, and on CUDA compile
the kernel variants serving can reach (kernel_warmup.py)."""

from __future__ import annotations

from executor_service.config import ExecutorConfig
from executor_service.kernel_warmup import warm_up_kernels
from executor_service.kv_cache_sizing import determine_num_kv_blocks
from executor_service.model_runner import ModelRunner


def start_model_runner(config: ExecutorConfig, tp_rank: int = 0) -> ModelRunner:
    runner = ModelRunner(config, tp_rank=tp_rank)
    num_blocks = determine_num_kv_blocks(runner, runner.bytes_per_block)
    runner.bind_kv_cache(num_blocks)
    if runner.device.type == "cuda":
        warm_up_kernels(runner, num_blocks)
    return runner
