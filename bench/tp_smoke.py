"""The shortest tensor-parallel run on GPUs: the shipped tiny checkpoint at TP=2, eager and then with
CUDA graphs, 4 prompts, 8 tokens each in fp32, the tokens checked against TP=1, then each engine
closed (leaving the process group). Each phase is printed with its time, so a hang shows where it
is (with bench/hangdump/ on PYTHONPATH, also every process's stacks).

    python bench/tp_smoke.py [--tp 2] [--model DIR] [--device cpu] [--dtype float32]
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from client.defaults import DEFAULT_MODEL
    from client.llm import LLM
    from scheduler_service.sampling_params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32", help="float32: TP=2 must give TP=1's tokens exactly")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(8 + 5 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    results = {}
    for tp, eager in ((1, False), (args.tp, True), (args.tp, False)):
        t0 = time.perf_counter()
        print(f"TP={tp} enforce_eager={eager}: starting", flush=True)
        llm = LLM(args.model, device=args.device, tensor_parallel_size=tp, enforce_eager=eager,
                  gpu_memory_utilization=0.2, dtype=args.dtype)  # fmt: skip
        print(f"TP={tp} enforce_eager={eager}: started in {time.perf_counter() - t0:.1f} s", flush=True)
        t1 = time.perf_counter()
        results[tp, eager] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        print(f"TP={tp} enforce_eager={eager}: generated in {time.perf_counter() - t1:.2f} s", flush=True)
        t2 = time.perf_counter()
        llm.executor.close()
        print(f"TP={tp} enforce_eager={eager}: closed in {time.perf_counter() - t2:.2f} s", flush=True)
        del llm
        gc.collect()
    reference = results[1, False]
    for key, tokens in results.items():
        print(
            f"TP={key[0]} enforce_eager={key[1]}: tokens {'equal' if tokens == reference else 'DIFFER'} to TP=1"
        )
    return 0 if all(tokens == reference for tokens in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
