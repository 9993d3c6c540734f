"""Many greedy streams through the services, and the executor killed under them (the reliability,
owner and tensor-parallel tests): every stream must finish with the undisturbed run's tokens."""

from __future__ import annotations

import asyncio
import random
import time

from client import AsyncTandemClient, Final
from helpers.services import Services

# The services of these tests (Services' options): room for many streams at once.
MANY_STREAMS = dict(num_kv_blocks=1024, max_num_seqs=256)


def token_prompts(n: int, seed: int, lo: int = 1, hi: int = 40, vocab: int = 400) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def tracked_stream(client, prompt, progress: list[int], i: int, **sampling):
    ids, final = [], None
    async for item in client.generate(prompt, **sampling):
        if isinstance(item, Final):
            final = item
        else:
            ids += item.token_ids
            progress[i] = len(ids)
    return ids, final


def start_streams(client, prompts, progress: list[int], max_tokens: int) -> list[asyncio.Future]:
    """One greedy stream per prompt (ignore_eos), running on the loop; progress[i] counts the tokens
    stream i has received; each task ends with (token ids, Final)."""
    return [
        asyncio.ensure_future(tracked_stream(client, p, progress, i, max_tokens=max_tokens, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]


def kill_and_recover(
    services: Services, prompts, max_tokens: int, ready, restart_args=(), kill=None
) -> tuple[list, list[int]]:
    """Start one greedy stream per prompt; once ready(progress) holds, SIGKILL the executor (or
    `kill()` it another way, returning once it is gone) and start a new one on the same port.
    Returns the results and each stream's progress at the kill."""
    progress = [0] * len(prompts)

    async def run():
        async with AsyncTandemClient(services.address, timeout=180) as client:
            tasks = start_streams(client, prompts, progress, max_tokens)
            deadline = time.monotonic() + 60
            # In a thread: `ready` may scrape metrics over HTTP, which would hold up the event loop
            # and with it the streams' requests, so that some would reach the scheduler late.
            while not await asyncio.to_thread(ready, progress):
                assert time.monotonic() < deadline, f"never ready to kill: {progress}"
                await asyncio.sleep(0.002)
            at_kill = list(progress)
            (kill or services.kill_executor)()
            services.start_executor(*restart_args)
            return await asyncio.gather(*tasks), at_kill

    return asyncio.run(run())


def check_identical(results, expected) -> int:
    completed = 0
    for i, ((ids, final), want) in enumerate(zip(results, expected, strict=True)):
        assert ids == want.token_ids, f"stream {i} differs from the undisturbed run"
        assert final is not None and final.finish_reason == want.finish_reason
        assert final.completion_tokens == len(ids)  # nothing sent twice
        completed += 1
    return completed
