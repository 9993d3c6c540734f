"""What an fp8 (e4m3) KV cache costs in accuracy, against the model-dtype cache: perplexity of the
embedded model on its own training text (CPython's `pydoc_data.topics`), and greedy top-1 agreement
over 256 generated tokens. With --weights, the same for FP8 weights: the model served as its FP8
block-scaled form (--quantization fp8: on CUDA the W8A8 GEMMs, activations quantized per token
group) against its dequantized model (each such weight quantized and dequantized, in the model
dtype; on the CPU the two are the same computation).

Perplexity: windows of --window tokens of the text, each computed in chunks of --chunk tokens, so
that every chunk after the first attends to the cached prefix through the KV cache (as decode
steps do; on CUDA a prefill without a prefix reads this step's K/V before they are stored).
Agreement: --prompts prompts of 32 text tokens each, 256 greedy tokens with each cache; the share
of positions where the fp8 run's token equals the bf16 run's, counted up to each stream's first
difference (after it the two condition on different text) and over all 256 positions.

    python bench/fp8_accuracy.py                                # the embedded model, CPU
    python bench/fp8_accuracy.py --device cuda --attention-backend triton
    python bench/fp8_accuracy.py --calibrate     # also fp8 with per-layer scales amax / 448
    python bench/fp8_accuracy.py --weights --device cuda --attention-backend triton
    python bench/fp8_accuracy.py --device cuda --attention-backend triton --chunk 1 --tokens 4096 \
        --decode-config '{"FP8_MMA": true}'     # the decode kernel in e4m3 MMAs, every token a decode step

--calibrate measures each layer's largest |K| and |V| over the text's first window (a bf16 run) and
runs fp8 once more with k_scale = amax_K / 448, v_scale = amax_V / 448 (instead of 1.0).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.defaults import DEFAULT_MODEL
from client.llm import LLM
from executor_service.config import ExecutorConfig
from executor_service.fp8 import FP8_MAX
from executor_service.layers.attention import Attention
from executor_service.model_runner import ModelRunner
from executor_service.runner_startup import start_model_runner
from executor_service.sequence import SequenceState
from protos.hub import resolve_model
from protos.plan import StepSamplingParams
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.tokenizer import Tokenizer


def corpus_tokens(model: str, limit: int) -> list[int]:
    """The training text, in the training script's order (sorted topics), tokenized."""
    from pydoc_data.topics import topics

    tokenizer = Tokenizer(model)
    ids: list[int] = []
    for key in sorted(topics):
        ids += tokenizer.encode(topics[key].strip())
        if len(ids) >= limit:
            break
    return ids[:limit]


@torch.inference_mode()
def perplexity(runner: ModelRunner, tokens: list[int], window: int, chunk: int) -> float:
    nll, count = 0.0, 0
    blocks = list(range(-(-window // runner.block_size)))
    for w, start in enumerate(range(0, len(tokens) - window + 1, window)):
        text = tokens[start : start + window]
        seq = SequenceState(w, text, blocks, 0, StepSamplingParams(), window)
        runner.add_sequence(seq)
        try:
            for c in range(0, window, chunk):
                n = min(chunk, window - c)
                seq.num_computed_tokens = c
                out = runner.collect(runner.launch([seq], [n], all_logits=True), all_logits=True)
                logprobs = torch.log_softmax(out.logits.float(), -1)
                targets = torch.tensor(text[c + 1 : c + n + 1], device=logprobs.device)
                nll -= logprobs[: len(targets)].gather(1, targets[:, None]).sum().item()
                count += len(targets)
        finally:
            runner.remove_sequence(seq)
    return math.exp(nll / count)


def calibrate(runner: ModelRunner, tokens: list[int], window: int) -> list[tuple[float, float]]:
    """(amax |K| / 448, amax |V| / 448) of every attention layer over one window of text."""
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    amax = [[0.0, 0.0] for _ in layers]

    def recorder(i, forward):
        def record(q, k, v, *args, **kwargs):
            amax[i][0] = max(amax[i][0], k.abs().max().item())
            amax[i][1] = max(amax[i][1], v.abs().max().item())
            return forward(q, k, v, *args, **kwargs)

        return record

    for i, layer in enumerate(layers):
        layer.forward = recorder(i, layer.forward)
    perplexity(runner, tokens[:window], window, window)
    return [(k / FP8_MAX, v / FP8_MAX) for k, v in amax]


def set_kv_scales(runner: ModelRunner, scales: list[tuple[float, float]]) -> None:
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    for layer, (k_scale, v_scale) in zip(layers, scales, strict=True):
        layer.k_scale, layer.v_scale = k_scale, v_scale


def agreement(model: str, prompts: list[list[int]], options: dict) -> list[list[int]]:
    llm = LLM(model, **options)
    params = SamplingParams(max_tokens=256, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def dequantized_checkpoint(model: str, out: Path) -> str:
    """A copy of the checkpoint with every weight that --quantization fp8 quantizes replaced by its
    quantized-then-dequantized value, in the checkpoint's dtype: the model an FP8 form stands for."""
    import shutil

    from safetensors.torch import load_file, save_file

    from executor_service.fp8 import dequantize_weight_blocks, quantize_weight_blocks
    from executor_service.quantization import quantized_at_load

    shutil.copytree(model, out, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    for path in Path(model).glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if quantized_at_load(name):
                tensors[name] = dequantize_weight_blocks(*quantize_weight_blocks(t.float()), t.dtype)
        save_file(tensors, out / path.name)
    return str(out)


def compare(name: str, base: str, runs: dict[str, list[list[int]]]) -> None:
    same_prefix, same_all, total = 0, 0, 0
    for a, b in zip(runs[base], runs[name], strict=True):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same_prefix += first
        same_all += sum(x == y for x, y in zip(a, b))
        total += len(a)
    identical = sum(a == b for a, b in zip(runs[base], runs[name]))
    print(
        f"greedy top-1 agreement over 256 tokens, {name} vs {base}: "
        f"{100 * same_prefix / total:.2f}% before the first difference, {100 * same_all / total:.2f}% of "
        f"positions, {identical}/{len(runs[base])} streams identical"
    )


def weights_accuracy(args, options: dict, tokens: list[int], prompts: list[list[int]]) -> None:
    """--weights: the FP8 form against the dequantized model."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        dequantized = dequantized_checkpoint(args.model, Path(tmp) / "dequantized")
        forms = {"fp8 weights": {"model": args.model, "quantization": "fp8"},
                 "dequantized": {"model": dequantized}}  # fmt: skip
        ppl = {}
        for form, where in forms.items():
            config = ExecutorConfig(
                **where, num_kv_blocks=2 * args.window // 16 + 8, max_model_len=args.window, **options
            )
            ppl[form] = perplexity(start_model_runner(config), tokens, args.window, args.chunk)
            print(f"perplexity ({form}, {config.dtype}): {ppl[form]:.4f} over {len(tokens)} tokens")
        print(
            f"perplexity fp8 weights vs dequantized: {100 * (ppl['fp8 weights'] / ppl['dequantized'] - 1):+.3f}%"
        )
        runs = {
            form: agreement(where.pop("model"), prompts, {**options, **where})
            for form, where in forms.items()
        }
    compare("fp8 weights", "dequantized", runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: the checkpoint's, bf16)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--tokens", type=int, default=16384, help="text tokens for the perplexity")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--calibrate", action="store_true", help="also fp8 with scales amax / 448")
    parser.add_argument(
        "--weights",
        action="store_true",
        help="fp8 weights (--quantization fp8) against the dequantized model",
    )
    parser.add_argument(
        "--decode-config",
        help="JSON over the fp8 decode kernel's launch config, e.g. '{\"FP8_MMA\": true}' (with --chunk 1 "
        "every token is a decode step)",
    )
    args = parser.parse_args()
    if args.decode_config:
        from executor_service.attention import triton_kernels

        triton_kernels.DECODE_CONFIG_FP8.update(json.loads(args.decode_config))
        print(f"fp8 decode config: {triton_kernels.DECODE_CONFIG_FP8}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    options = {"device": args.device, "dtype": args.dtype, "attention_backend": args.attention_backend}
    args.model = resolve_model(args.model, None)  # a hub id: its cached snapshot's directory
    tokens = corpus_tokens(args.model, args.tokens)
    step = len(tokens) // args.prompts
    prompts = [tokens[i * step : i * step + 32] for i in range(args.prompts)]
    if args.weights:
        weights_accuracy(args, options, tokens, prompts)
        return
    ppl = {}
    for kv in ("auto", "fp8"):
        t0 = time.perf_counter()
        config = ExecutorConfig(
            model=args.model,
            kv_cache_dtype=kv,
            num_kv_blocks=2 * args.window // 16 + 8,
            max_model_len=args.window,
            **options,
        )
        ppl[kv] = perplexity(start_model_runner(config), tokens, args.window, args.chunk)
        print(f"perplexity ({config.kv_cache_dtype} KV): {ppl[kv]:.4f} over {len(tokens)} tokens "
              f"in windows of {args.window} ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    print(f"perplexity fp8 KV vs {config.dtype} KV: {100 * (ppl['fp8'] / ppl['auto'] - 1):+.3f}%")
    if args.calibrate:
        # Eager: CUDA graphs would keep the scales they were captured with, not those set below.
        make = lambda kv: start_model_runner(ExecutorConfig(  # noqa: E731
            model=args.model, kv_cache_dtype=kv, num_kv_blocks=2 * args.window // 16 + 8, max_model_len=args.window,
            enforce_eager=True, **options
        ))  # fmt: skip
        scales = calibrate(make("auto"), tokens, args.window)
        runner = make("fp8")
        set_kv_scales(runner, scales)
        calibrated = perplexity(runner, tokens, args.window, args.chunk)
        print(f"perplexity (fp8_e4m3 KV, calibrated scales {[(round(k, 4), round(v, 4)) for k, v in scales]}): "
              f"{calibrated:.4f}, {100 * (calibrated / ppl['auto'] - 1):+.3f}% vs {config.dtype} KV")  # fmt: skip

    runs = {
        name: agreement(args.model, prompts, {**options, "kv_cache_dtype": kv})
        for name, kv in (("fp8 KV", "fp8"), (f"{config.dtype} KV", "auto"))
    }
    compare("fp8 KV", f"{config.dtype} KV", runs)


if __name__ == "__main__":
    main()
