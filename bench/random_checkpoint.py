"""Random bf16 checkpoints of large shapes, written fast: the config through transformers' config
class, the tensors drawn on the GPU (when there is one) and written with safetensors in 4 GB shards
straight to the target directory, per-expert tensors in the Hub's layout
(`mlp.experts.E.{gate,up,down}_proj.weight`). No model is initialised on the CPU: W3's 30.5 B
parameters (61 GB) take about a minute instead of an hour.

    python bench/random_checkpoint.py --shape qwen3-30b-a3b --out /dev/shm/tandem-w3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# BENCH.md W3: Qwen3-30B-A3B's shape.
QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=40960,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    eos_token_id=151645,
    bos_token_id=None,
)
# Llama 3.2 1B's shape (tied head, llama3 rope scaling).
LLAMA_3_2_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    eos_token_id=128001,
    bos_token_id=128000,
)  # fmt: skip
# Qwen3-8B's shape (untied head), for W4.
QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=151645, bos_token_id=None,
)  # fmt: skip
# Qwen3-32B's shape (untied head, about 65.5 GB in bf16), for issue 19's TP=4 figure.
QWEN3_32B = dict(
    vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
    num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=151645, bos_token_id=None,
)  # fmt: skip
SHAPES = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_30B_A3B),
    "qwen3-32b": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_32B),
    "llama-3.2-1b": ("LlamaConfig", "LlamaForCausalLM", LLAMA_3_2_1B),
    "qwen3-8b": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_8B),
}
# The Qwen3-*-FP8 format (executor_service/quantization.py).
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
}  # fmt: skip
SHARD_BYTES = 4 << 30


def tensor_shapes(config_name: str, model_name: str, config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes, from the model built on the meta device (no memory)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, model_name)(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H] in transformers 5, per expert on the Hub
            prefix = name.removesuffix("gate_up_proj")
            for e in range(param.shape[0]):
                shapes[f"{prefix}{e}.gate_proj.weight"] = (param.shape[1] // 2, param.shape[2])
                shapes[f"{prefix}{e}.up_proj.weight"] = (param.shape[1] // 2, param.shape[2])
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(param.shape[0]):
                shapes[f"{prefix}{e}.down_proj.weight"] = tuple(param.shape[1:])
        else:
            shapes[name] = tuple(param.shape)
    return shapes


def build_random_checkpoint(out_dir: Path, shape: str, fp8: bool = False) -> Path:
    """Random weights of `shape`, in bf16, or with fp8=True every linear projection as random e4m3
    values with one weight_scale_inv per 128 x 128 block (the Qwen3-*-FP8 format; about std 0.02 like
    the bf16 weights). Written straight to safetensors shards (no model init)."""
    if (out_dir / "model.safetensors.index.json").is_file():
        return out_dir
    import torch
    import transformers
    from safetensors.torch import save_file
    from tqdm import tqdm

    config_name, model_name, values = SHAPES[shape]
    config = getattr(transformers, config_name)(**values, dtype="bfloat16")
    shapes = tensor_shapes(config_name, model_name, config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(0)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, shard, shard_bytes, index = {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, index
        if shard:
            file = f"model-{index:05d}.safetensors"
            save_file(shard, str(out_dir / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, shard_bytes, index = {}, 0, index + 1

    total = sum(torch.Size(s).numel() for s in shapes.values()) * 2
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {shape} to {out_dir}") as bar:
        for name, size in shapes.items():
            if "norm" in name:
                tensor = torch.ones(size, dtype=torch.bfloat16)
            elif fp8 and name.endswith("_proj.weight") and "mlp.gate." not in name:
                # e4m3 values of std 32, scales of 0.02 / 32: weights of std 0.02.
                tensor = (torch.randn(size, generator=gen, device=device) * 32).to(torch.float8_e4m3fn).cpu()
                blocks = (-(-size[0] // 128), -(-size[1] // 128))
                shard[name + "_scale_inv"] = torch.full(blocks, 0.02 / 32, dtype=torch.float32)
            else:
                tensor = (torch.randn(size, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
            shard[name] = tensor
            shard_bytes += tensor.numel() * tensor.element_size()
            bar.update(tensor.numel() * 2)
            if shard_bytes >= SHARD_BYTES:
                flush()
        flush()
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_file))
    config.architectures = [model_name]
    config.save_pretrained(out_dir)
    if fp8:
        path = out_dir / "config.json"
        path.write_text(
            json.dumps({**json.loads(path.read_text()), "quantization_config": FP8_QUANTIZATION_CONFIG})
        )
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", required=True, help="checkpoint directory (e.g. under /dev/shm)")
    args = p.parse_args()
    print(build_random_checkpoint(Path(args.out), args.shape))


if __name__ == "__main__":
    main()
