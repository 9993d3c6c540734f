"""Online serving latency (BENCH.md W2), like `vllm bench serve`: Poisson arrivals at each given
rate (and an optional max concurrency), every token streamed, a load generator of several client
processes. Reports request throughput, output tok/s, p50 / p90 / p99 of TTFT, TPOT, ITL and E2E,
goodput under an SLO, the prefix cache hit rate (the scheduler's metrics) and the CPU of each client
process (a load generator near 100% of a core skews the latencies it measures).

    python bench/serve.py                                   # CPU: the embedded model, starts both services
    python bench/serve.py --workload w2 --device cuda --request-rate 8 24 48
    python bench/serve.py --server 127.0.0.1:50051 --metrics-url http://127.0.0.1:9101/metrics
    python bench/serve.py --workload w2 --device cuda --request-rate 24 --shared-prefix 512

TTFT: send to first token. TPOT: (E2E - TTFT) / (output tokens - 1) per request. ITL: the gaps
between a request's streamed chunks (one token each at stream interval 1). E2E: send to the final
message. Goodput: requests/s that met every SLO given with --goodput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import throughput  # bench/throughput.py: the workload, the services, scraping

from client.defaults import DEFAULT_MODEL

W2_REQUESTS = 240
PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")
_HIT, _QUERIED = (
    "tandem_scheduler_prefix_cache_hit_tokens_total",
    "tandem_scheduler_prefix_cache_queried_tokens_total",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--workload",
        choices=["random", "w2"],
        default="random",
        help="random: the length flags below; w2: BENCH.md W2 (240 requests per rate, W1's lengths, T=0.6)",
    )
    p.add_argument(
        "--server", default=None, metavar="HOST:PORT", help="a running scheduler (default: start both)"
    )
    p.add_argument(
        "--metrics-url",
        default=None,
        help="with --server: the scheduler's /metrics, for the prefix cache hit rate",
    )
    p.add_argument(
        "--model", default=None, help="checkpoint directory (default: embedded model; w2: W1's, built)"
    )
    p.add_argument("--w1-dir", default=str(Path(tempfile.gettempdir()) / "tandem-w1-qwen3-0.6b"))
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="requests/s, one run each (inf: all at once)",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most (split over processes)"
    )
    p.add_argument("--num-processes", type=int, default=4, help="client processes of the load generator")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=128)
    p.add_argument("--min-output-len", type=int, default=8)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--input-len", type=int, default=None, help="fixed prompt length (overrides min/max)")
    p.add_argument("--output-len", type=int, default=None, help="fixed output length (overrides min/max)")
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="a common N-token system prompt before every prompt",
    )
    p.add_argument("--temperature", type=float, default=None, help="default 0 (greedy); w2: 0.6")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and of the arrivals")
    p.add_argument(
        "--goodput",
        nargs="*",
        default=[],
        metavar="KEY:MS",
        help="SLOs a good request meets, e.g. ttft:200 tpot:20 e2e:10000 (milliseconds)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON (- for stdout)")
    p.add_argument("--warm-up", type=int, default=4, help="short requests before the timed runs")
    throughput.add_service_flags(p, stream_interval=1)  # every token streamed, as a chat client sees it
    args = p.parse_args(argv)
    if args.workload == "w2":
        args.num_requests = W2_REQUESTS
        args.min_prompt_len, args.max_prompt_len = 100, 1024
        args.min_output_len, args.max_output_len = 100, 1024
        if args.temperature is None:
            args.temperature = 0.6
    if args.temperature is None:
        args.temperature = 0.0
    if args.input_len is not None:
        args.min_prompt_len = args.max_prompt_len = args.input_len
    if args.output_len is not None:
        args.min_output_len = args.max_output_len = args.output_len
    if args.num_processes < 1:
        p.error("--num-processes must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < args.num_processes:
        p.error("--max-concurrency must be >= --num-processes (each process takes its share)")
    try:
        args.slo = {k: float(v) / 1e3 for k, v in (item.split(":") for item in args.goodput)}
    except ValueError:
        p.error("--goodput takes KEY:MS items, e.g. ttft:200")
    if set(args.slo) - {"ttft", "tpot", "e2e"}:
        p.error("--goodput keys are ttft, tpot and e2e")
    return args


def make_requests(args: argparse.Namespace, vocab_size: int, draw: int = 0) -> list[throughput.Request]:
    """W1's recipe (throughput.make_workload), each prompt behind the shared prefix, if any. Each
    draw (a rate, the warm-up) has prompts of its own, so that no rate finds another's prompts in the
    prefix cache; the shared prefix is the same in every draw."""
    workload = throughput.make_workload(
        argparse.Namespace(**{**vars(args), "seed": args.seed + 7919 * draw}), vocab_size
    )
    if args.shared_prefix:
        rng = random.Random(args.seed + 1)
        top = min(10000, vocab_size - 1)
        prefix = [rng.randint(0, top) for _ in range(args.shared_prefix)]
        workload = [throughput.Request(prefix + r.prompt_token_ids, r.max_tokens) for r in workload]
    return workload


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson arrivals (exponential gaps)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _drain(client, request: throughput.Request, temperature: float) -> None:
    async for _ in client.generate(
        request.prompt_token_ids, max_tokens=request.max_tokens, temperature=temperature, ignore_eos=True
    ):
        pass


async def _send_all(client, items, start, temperature, concurrency) -> list[dict]:
    from client.messages import Chunk

    gate = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(index: int, offset: float, request: throughput.Request) -> dict:
        delay = start + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is not None:
            await gate.acquire()
        sent = time.monotonic()
        chunks: list[float] = []
        n, error = 0, None
        try:
            stream = client.generate(
                request.prompt_token_ids,
                max_tokens=request.max_tokens,
                temperature=temperature,
                ignore_eos=True,
            )
            async for item in stream:
                if isinstance(item, Chunk) and item.token_ids:
                    chunks.append(time.monotonic())
                    n += len(item.token_ids)
        except Exception as e:  # a failed request is counted, not fatal
            error = f"{type(e).__name__}: {e}"
        finally:
            if gate is not None:
                gate.release()
        done = time.monotonic()
        return {
            "index": index,
            "sent": sent,
            "done": done,
            "chunks": chunks,
            "output_tokens": n,
            "prompt_tokens": len(request.prompt_token_ids),
            "error": error,
        }

    return await asyncio.gather(*(one(i, off, r) for i, off, r in items))


def client_process(address, items, temperature, concurrency, warm, queue, go, start) -> None:
    """One load-generator process on its own channel (its own connection, so the client processes
    spread over the scheduler's API servers as separate clients do): `warm` short requests first
    (outside the timing: the connection's API server warmed), "ready", then, once `go` is set, its
    share of the requests from `start`; then its records and its CPU seconds."""
    from client.aio import AsyncTandemClient

    async def run() -> tuple[list[dict], float]:
        async with AsyncTandemClient(address) as client:
            await asyncio.gather(*(_drain(client, r, temperature) for r in warm))
            queue.put("ready")
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            cpu0 = time.process_time()
            records = await _send_all(client, items, start.value, temperature, concurrency)
            return records, time.process_time() - cpu0

    records, cpu_s = asyncio.run(run())
    queue.put({"records": records, "cpu_s": cpu_s, "wall_s": time.monotonic() - start.value})


def load_from_processes(
    address: str,
    workload: list[throughput.Request],
    offsets: list[float],
    temperature: float,
    num_processes: int,
    concurrency: int | None = None,
    warm: int = 0,
    on_ready=None,
    timeout: float = 300.0,
) -> tuple[list[dict], list[dict], float]:
    """Request i sent `offsets[i]` seconds after the start, dealt round-robin over `num_processes`
    client processes (spawned, so none inherits this process's gRPC state), each at most
    `concurrency` in flight and `warm` short requests first. `on_ready()` runs once every process
    is connected and warmed, just before the start (a caller's counters before the timed part).
    Returns the records in request order, per-process CPU, and the start (time.monotonic())."""
    ctx = multiprocessing.get_context("spawn")
    queue, go, start = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    nproc = min(num_processes, len(workload))
    procs = []
    for k in range(nproc):
        items = [(i, offsets[i], workload[i]) for i in range(k, len(workload), nproc)]
        warm_requests = [throughput.Request(r.prompt_token_ids, 8) for _, _, r in items[:warm]]
        proc = ctx.Process(
            target=client_process,
            args=(address, items, temperature, concurrency, warm_requests, queue, go, start),
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    try:
        for _ in procs:
            if queue.get(timeout=timeout) != "ready":
                raise RuntimeError("a client process answered before it was ready")
        if on_ready is not None:
            on_ready()
        start.value = time.monotonic() + 0.05
        go.set()
        results = [queue.get(timeout=timeout + max(offsets, default=0.0)) for _ in procs]
    except Exception as e:
        for proc in procs:
            proc.kill()
        raise SystemExit(f"the load generator failed: {type(e).__name__}: {e}") from e
    for proc in procs:
        proc.join()
    records = sorted((r for res in results for r in res["records"]), key=lambda r: r["index"])
    cpu = [{"cpu_s": res["cpu_s"], "wall_s": res["wall_s"]} for res in results]
    return records, cpu, start.value


def run_load(args, address: str, workload, rate: float) -> tuple[list[dict], list[dict]]:
    """Every request at its arrival time (Poisson at `rate`) over the client processes. Returns
    the records in request order and per-process CPU."""
    offsets = arrival_offsets(len(workload), rate, args.seed)
    nproc = min(args.num_processes, len(workload))
    share = math.ceil(args.max_concurrency / nproc) if args.max_concurrency else None
    records, cpu, _ = load_from_processes(
        address, workload, offsets, args.temperature, nproc, concurrency=share
    )
    return records, cpu


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(records: list[dict], cpu: list[dict], slo: dict[str, float]) -> dict:
    ok = [r for r in records if r["error"] is None and r["chunks"]]
    lat: dict[str, list[float]] = {k: [] for k in LATENCIES}
    good = 0
    for r in ok:
        ttft = r["chunks"][0] - r["sent"]
        e2e = r["done"] - r["sent"]
        tpot = (e2e - ttft) / (r["output_tokens"] - 1) if r["output_tokens"] > 1 else None
        lat["ttft"].append(ttft)
        lat["e2e"].append(e2e)
        if tpot is not None:
            lat["tpot"].append(tpot)
        lat["itl"].extend(b - a for a, b in zip(r["chunks"], r["chunks"][1:]))
        mine = {"ttft": ttft, "tpot": tpot or 0.0, "e2e": e2e}
        good += all(mine[k] <= limit for k, limit in slo.items())
    t0 = min(r["sent"] for r in records)
    duration = max(r["done"] for r in records) - t0
    output_tokens = sum(r["output_tokens"] for r in ok)
    out = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r["prompt_tokens"] for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "goodput": good / duration if slo else None,
        "slo_ms": {k: v * 1e3 for k, v in slo.items()},
        "client_processes": cpu,
    }
    for k in LATENCIES:
        values = lat[k]
        out[f"mean_{k}_ms"] = sum(values) / len(values) * 1e3 if values else float("nan")
        for q in PERCENTILES:
            out[f"p{q}_{k}_ms"] = percentile(values, q) * 1e3
    return out


def prefix_counts(url: str | None) -> tuple[float, float] | None:
    if url is None:
        return None
    values = throughput.scrape(url)
    return values.get(_HIT, 0.0), values.get(_QUERIED, 0.0)


def warm_up(address: str, workload, n: int) -> None:
    """n short requests (8 tokens each) before the timed runs."""
    from client.aio import AsyncTandemClient

    async def run() -> None:
        async with AsyncTandemClient(address) as client:
            warm = [throughput.Request(r.prompt_token_ids, 8) for r in workload[:n]]
            await asyncio.gather(*(_drain(client, r, 0.0) for r in warm))

    if n:
        asyncio.run(run())


# The draws of make_requests: the warm-up's, then one per rate.
WARM_UP_DRAW = 1000


def run_rates(args, address: str, metrics_url: str | None, vocab_size: int) -> list[dict]:
    runs = []
    for i, rate in enumerate(args.request_rate):
        workload = make_requests(args, vocab_size, draw=i)
        before = prefix_counts(metrics_url)
        records, cpu = run_load(args, address, workload, rate)
        label = "inf" if math.isinf(rate) else rate  # JSON has no infinity
        result = {
            "request_rate": label,
            "max_concurrency": args.max_concurrency,
            **summarize(records, cpu, args.slo),
        }
        after = prefix_counts(metrics_url)
        if before is not None and after is not None:
            hit, queried = after[0] - before[0], after[1] - before[1]
            result["prefix_cache_hit_tokens"] = hit
            result["prefix_cache_queried_tokens"] = queried
            result["prefix_cache_hit_rate"] = hit / queried if queried else 0.0
        else:
            result["prefix_cache_hit_rate"] = None
        report(result, args)
        runs.append(result)
    return runs


def report(r: dict, args) -> None:
    rate = r["request_rate"] if r["request_rate"] == "inf" else f"{r['request_rate']:g}"
    print(
        f"rate {rate} req/s: {r['completed']}/{r['num_requests']} requests in {r['duration_s']:.2f} s, "
        f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} output tok/s"
        + (f", goodput {r['goodput']:.2f} req/s" if r["goodput"] is not None else "")
    )
    for k in LATENCIES:
        print(
            f"  {k.upper():5s} ms: mean {r[f'mean_{k}_ms']:.2f}, "
            + ", ".join(f"p{q} {r[f'p{q}_{k}_ms']:.2f}" for q in PERCENTILES)
        )
    if r["prefix_cache_hit_rate"] is not None:
        print(f"  prefix cache hit rate {r['prefix_cache_hit_rate']:.1%} of queried prompt tokens")
    print(
        "  client processes' CPU: "
        + ", ".join(f"{c['cpu_s']:.2f} s in {c['wall_s']:.1f} s" for c in r["client_processes"])
    )
    if r["failed"]:
        print(f"  {r['failed']} failed: {r['errors']}", file=sys.stderr)
    if args.workload == "w2":  # the lines gpu_run.sh's w2 and w2-prefix stages print
        line = f"W2 {rate} req/s: TTFT p99 {r['p99_ttft_ms']:.0f} ms, ITL p99 {r['p99_itl_ms']:.1f} ms"
        if args.shared_prefix:
            hit = r["prefix_cache_hit_rate"]
            line = f"W2 shared prefix {args.shared_prefix}, {line[3:]}, prefix cache hit rate " + (
                f"{hit:.1%}" if hit is not None else "unknown"
            )
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        args.model = (
            str(throughput.build_w1_checkpoint(Path(args.w1_dir)))
            if args.workload == "w2"
            else str(DEFAULT_MODEL)
        )
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    workload = make_requests(args, vocab_size)
    print(
        f"workload: {args.workload}, {len(workload)} requests per rate (each rate its own prompts; the first's: "
        f"{sum(len(r.prompt_token_ids) for r in workload)} prompt tokens (shared prefix {args.shared_prefix}), "
        f"{sum(r.max_tokens for r in workload)} output tokens, temperature {args.temperature}, "
        f"{args.num_processes} client processes)",
        flush=True,
    )
    if args.server:
        warm_up(args.server, make_requests(args, vocab_size, WARM_UP_DRAW), args.warm_up)
        runs = run_rates(args, args.server, args.metrics_url, vocab_size)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="tandem-serve-"))
        executor, scheduler, ports = throughput.start_services(args, args.model, log_dir)
        try:
            executor.start()
            throughput.wait_serving(executor, ports["executor"])
            scheduler.start()
            throughput.wait_serving(scheduler, ports["scheduler"])
            warm_up(ports["scheduler"], make_requests(args, vocab_size, WARM_UP_DRAW), args.warm_up)
            runs = run_rates(args, ports["scheduler"], ports["scheduler_metrics"], vocab_size)
        finally:
            for service in (scheduler, executor):
                service.stop(10.0)
        if args.keep_logs:
            print(f"service logs: {log_dir}")
    if args.json:
        options = {k: v for k, v in vars(args).items() if k != "slo"}
        options["request_rate"] = ["inf" if math.isinf(x) else x for x in args.request_rate]
        text = json.dumps({"args": options, "runs": runs}, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
