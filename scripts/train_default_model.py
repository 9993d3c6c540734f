"""Train tandem's embedded default model: a small Qwen3 on CPython's bundled documentation.

The text is `pydoc_data.topics` (the reference topics `help()` shows), available offline on
every CPython. The result is a Hugging Face checkpoint directory (config.json,
model.safetensors in bf16, tokenizer.json, generation_config.json) under 20 MB.

    python scripts/train_default_model.py --out executor_service/default_model --device cuda
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

EOS = "<|endoftext|>"


def corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k].strip() for k in sorted(topics)]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args()

    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    texts = corpus()
    tok = train_tokenizer(texts, args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    stream: list[int] = []
    for text in texts:
        stream += tok.encode(text).ids + [eos_id]
    data = torch.tensor(stream, dtype=torch.long)
    print(f"{len(texts)} documents, {sum(map(len, texts)):,} characters, {len(stream):,} tokens")

    config = Qwen3Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=eos_id,
    )
    model = Qwen3ForCausalLM(config).to(args.device).train()
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (args.steps - warmup)))

    t0 = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,))
        batch = torch.stack([data[s : s + args.seq_len + 1] for s in starts.tolist()]).to(args.device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast(device_type=args.device.split(":")[0], dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:.0f}s", flush=True)

    model = model.eval().to(torch.bfloat16).cpu()
    args.out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = "bfloat16"
    model.save_pretrained(args.out, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(args.out)
    tok.save(str(args.out / "tokenizer.json"))
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"saved {args.out} ({size / 1e6:.1f} MB)")

    prompt = torch.tensor([tok.encode("The list type").ids])
    out = model.float().generate(prompt, max_new_tokens=48, do_sample=False)
    print(repr(tok.decode(out[0].tolist())))


if __name__ == "__main__":
    main()
