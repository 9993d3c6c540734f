"""Small Qwen3 checkpoints and a tokenizer built in the test session (nothing is downloaded).

Hugging Face's default initialisation (std 0.02) gives near-flat logits, so greedy decoding
would hinge on ties decided by rounding. These checkpoints scale the initialisation so the
logits have clear margins and greedy generation is well defined.
"""

from __future__ import annotations

from pathlib import Path

EOS_TEXT = "<|endoftext|>"


def train_tokenizer(out_dir: Path, vocab_size: int = 400, metaspace: bool = False) -> Path:
    """A byte-level BPE trained on CPython's bundled documentation; saves tokenizer.json.
    `metaspace`: SentencePiece's way instead (Llama 2's, Mistral's): a word's space is a "▁" that
    begins its token, and decoding drops the one that begins the text."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if metaspace:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = []
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TEXT],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    texts = list(topics.values())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def build_qwen3(
    out_dir: Path,
    *,
    tie_word_embeddings: bool = True,
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    eos_token_id: int | list[int] = 0,
    initializer_range: float = 0.2,
    dtype: str = "float32",
    seed: int = 0,
    with_tokenizer: bool = True,
) -> Path:
    """Build a random Qwen3ForCausalLM with clear logit margins and save it in HF format."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, dtype)).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if with_tokenizer:
        train_tokenizer(out_dir, vocab_size=min(400, vocab_size))
    return out_dir


def trained_prompts() -> list[list[int]]:
    """Prompts for bf16 comparisons, on the shipped checkpoint: it is trained, so its logit margins
    are clear (a random checkpoint has near-ties everywhere, which bf16 rounding flips)."""
    from tokenizers import Tokenizer

    from client.defaults import DEFAULT_MODEL

    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    texts = [
        "The list type",
        "An exception is raised when",
        "The with statement is used to wrap the execution of a block with methods defined by a context manager.",
        "Names refer to objects. Names are introduced by name binding operations. " * 4,
        "class",
    ]
    return [tokenizer.encode(text).ids for text in texts]


# Tiny checkpoints of every supported family, built through transformers' own config classes:
# family -> (config class, model class, the family's own config keys).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 256}
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen3_bias": ("Qwen3Config", "Qwen3ForCausalLM", {"attention_bias": True}),
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_parameters": YARN_ROPE}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}},
    ),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        # Layers 0, 1 and 3 sparse, 2 dense; top 2 of 8 experts, renormalised.
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [2],
        },
    ),
}


def build_checkpoint(
    out_dir: Path, family: str, *, seed: int = 0, with_tokenizer: bool = True, **overrides
) -> Path:
    """A random checkpoint of `family` (FAMILIES) with clear logit margins, saved in HF format: the
    shape of build_qwen3's, biases drawn like the weights (transformers initialises them to zero,
    which would leave a bias path untested)."""
    import torch
    import transformers

    config_name, model_name, own = FAMILIES[family]
    kwargs = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.2,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
    )
    kwargs.update(own)
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, config.initializer_range)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if with_tokenizer:
        train_tokenizer(out_dir, vocab_size=400)
    return out_dir


FAMILY_SEEDS: dict[str, int] = {}


FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def quantize_checkpoint_fp8(src: Path, dst: Path) -> dict:
    """Copy the checkpoint at `src` to `dst` with every linear projection (`*_proj.weight`) quantized
    in 128 x 128 blocks, the Qwen3-*-FP8 format (e4m3 weight + fp32 weight_scale_inv, embeddings, norms
    and the LM head as they were); returns the state dict of the dequantized weights (fp32), the model
    that an FP8 checkpoint stands for."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from executor_service.fp8 import dequantize_weight_blocks, quantize_weight_blocks

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    weights = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in weights.items():
        if name.endswith("_proj.weight"):
            q, scale_inv = quantize_weight_blocks(tensor)
            quantized[name], quantized[name + "_scale_inv"] = q, scale_inv
            dequantized[name] = dequantize_weight_blocks(q, scale_inv, torch.float32)
        else:
            quantized[name] = dequantized[name] = tensor
    save_file(quantized, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = FP8_QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized
