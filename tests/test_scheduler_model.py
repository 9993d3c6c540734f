"""The scheduler against a model of what a real executor would see (hypothesis).

`KVModelExecutor` keeps, for every KV slot, the tokens of the prefix whose KV it holds and the step
that wrote it. Each plan is validated as FakeExecutor validates it, then run as the executor runs
one (every scheduled token's KV is stored before attention reads any), and then every position
each scheduled sequence attends to, from 0 to its last computed one, must hold the KV of exactly
that sequence's prefix: a prefix-cache hit on a block that no plan wrote (or that a refused plan
was to write), a block overwritten while another sequence still reads it, or a wrong block table
fails there. A sampled token is a function of the sequence's tokens and seed alone, and so are its
logprobs and the prompt logprobs, so every request's output is known without running a reference
engine.

The driver does what the async engine does between steps: adds requests (shared prefixes, `n`
samples of one prompt, prompt logprobs, logprobs, stop tokens), aborts them (deadlines and
cancels), fails the requests of a refused plan, and replaces a lost executor by adopting every
unfinished request into a fresh engine. Checked after every step: the block manager's accounting
(reference counts equal the block tables that hold them, the free list holds exactly the free
blocks), and every block in the prefix cache holds what its hash claims once the plans that
register it are run; at the end: every block free, the executor holds nothing, and every request
that finished got exactly its reference output (tokens, finish reason, logprobs, prompt logprobs),
while an aborted or failed one streamed a prefix of it."""

from __future__ import annotations

from helpers.fake_executor import VOCAB, FakeExecutor, _SeqState
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protos.plan import PromptLogprobs, StepPlan, StepResult, StepSamplingParams, TokenLogprobs
from scheduler_service.block_manager import hash_block_tokens
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine import LLMEngine
from scheduler_service.sampling_params import SamplingParams

EOS = (2, 3)
_ROOT = bytes(16)


def _h(prefix: tuple[int, ...]) -> int:
    """The KV of the last position of `prefix` (a function of the whole prefix)."""
    return hash(prefix) & 0xFFFF_FFFF


def sample(tokens: list[int], seed: int, banned=()) -> int:
    """The sampled token; `banned`: stop tokens short of min_tokens (the executor bans them)."""
    tok = (_h(tuple(tokens)) + 7 * seed) % VOCAB
    return 400 + tok % 100 if tok in banned else tok


def token_logprob(tokens: list[int], seed: int) -> float:
    return -((_h(tuple(tokens)) + seed) % 997) / 100


def prompt_logprob(
    prefix: tuple[int, ...], target: int, num_top: int
) -> tuple[float, int, list[int], list[float]]:
    """The score of prompt token `target` after `prefix`: logprob, rank, top ids, top logprobs."""
    v = _h(prefix) ^ (target * 2654435761 & 0xFFFF_FFFF)
    top = [(v + j) % VOCAB for j in range(num_top)]
    return -(v % 1013) / 100, 1 + v % 5, top, [-(v % 89 + j) / 10 for j in range(num_top)]


class KVModelExecutor(FakeExecutor):
    """FakeExecutor's plan checks, a KV cache of prefixes, plans taken ahead (send / receive),
    refused plans (ValueError, the plans behind dropped) and lost executors (ConnectionError)."""

    takes_plans_ahead = True
    max_plans_in_flight = None

    def __init__(self, fail_steps=(), lose_steps=(), **kwargs) -> None:
        super().__init__(**kwargs)
        # slot -> (the prefix whose last position's KV it holds, the step that wrote it)
        self.slots: dict[int, tuple[tuple[int, ...], int]] = {}
        self.fail_steps = set(fail_steps)
        self.lose_steps = set(lose_steps)
        self.pending: list[StepPlan] = []
        self.most_in_flight = 0
        self.params: dict[int, StepSamplingParams] = {}  # of each sequence held

    def send(self, plan: StepPlan) -> None:
        self.pending.append(plan)
        self.most_in_flight = max(self.most_in_flight, len(self.pending))

    def receive(self, plan: StepPlan) -> StepResult:
        oldest = self.pending.pop(0)
        assert oldest is plan, "results are read in plan order"
        if plan.step_id in self.lose_steps:
            self.lose_steps.discard(plan.step_id)
            self.pending.clear()
            raise ConnectionError(f"executor lost at step {plan.step_id}")
        if plan.step_id in self.fail_steps:
            self.pending.clear()  # a refused plan closes the stream: the ones behind never run
            raise ValueError(f"step {plan.step_id} rejected")
        return self.step(plan)

    def discard(self) -> None:
        self.pending.clear()

    def step(self, plan: StepPlan) -> StepResult:
        self._validate(plan)
        self.plans.append(plan)
        self.last_step_id = plan.step_id
        bs = self.info.block_size
        for sid in plan.finished_seq_ids + plan.preempted_seq_ids:
            del self.seqs[sid]
            del self.params[sid]
        for s in plan.new_seqs:
            self.seqs[s.seq_id] = _SeqState(list(s.token_ids), list(s.block_table), s.num_computed_tokens)
            self.params[s.seq_id] = s.sampling_params
        off = 0
        spans = []
        # Every scheduled token's KV is stored before attention reads any (the real executor's order).
        for sid, n, k in zip(plan.seq_ids, plan.num_scheduled_tokens, plan.num_new_blocks, strict=True):
            s = self.seqs[sid]
            s.block_table += plan.new_block_ids[off : off + k]
            off += k
            c = s.num_computed
            for q in range(c, c + n):
                self.slots[s.block_table[q // bs] * bs + q % bs] = (tuple(s.token_ids[: q + 1]), plan.step_id)
            spans.append((sid, c, n))
        result = StepResult(step_id=plan.step_id)
        for sid, c, n in spans:
            s = self.seqs[sid]
            for q in range(c + n):  # attention reads every position up to the last computed one
                slot = s.block_table[q // bs] * bs + q % bs
                held = self.slots.get(slot)
                assert held is not None and held[0] == tuple(s.token_ids[: q + 1]), (
                    f"step {plan.step_id}: seq {sid} reads position {q} from block {s.block_table[q // bs]}, "
                    f"which holds {'nothing' if held is None else f'the KV of another prefix (step {held[1]})'}"
                )
            s.num_computed = c + n
            params = self.params[sid]
            num_prompt, num_top, seed = params.num_prompt_tokens, params.prompt_logprobs, params.seed or 0
            if num_top is not None:
                end = min(c + n, num_prompt - 1)
                if end > c:
                    scores = [
                        prompt_logprob(tuple(s.token_ids[: j + 1]), s.token_ids[j + 1], num_top)
                        for j in range(c, end)
                    ]
                    result.prompt_logprobs.append(
                        PromptLogprobs(
                            sid,
                            c + 1,
                            [x[0] for x in scores],
                            [x[1] for x in scores],
                            [t for x in scores for t in x[2]],
                            [v for x in scores for v in x[3]],
                        )
                    )
            if s.num_computed == len(s.token_ids):
                short = len(s.token_ids) - num_prompt < params.min_tokens
                tok = sample(s.token_ids, seed, params.stop_token_ids if short else ())
                lp = token_logprob(s.token_ids, seed)
                s.token_ids.append(tok)
                result.seq_ids.append(sid)
                result.token_ids.append(tok)
                result.num_tokens.append(1)
                if params.logprobs:
                    top = [(tok + j) % VOCAB for j in range(params.logprobs)]
                    result.logprobs.append(
                        TokenLogprobs(sid, [lp], top, [lp - j for j in range(params.logprobs)])
                    )
        return result


def reference(prompt: list[int], params: SamplingParams, max_model_len: int):
    """(tokens, finish reason, logprobs, prompt logprobs) of an undisturbed run."""
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(EOS))
    limit = (
        max_model_len if params.max_tokens is None else min(max_model_len, len(prompt) + params.max_tokens)
    )
    seed = params.seed or 0
    tokens = list(prompt)
    logprobs = []
    while True:
        short = len(tokens) - len(prompt) < params.min_tokens
        tok = sample(tokens, seed, stop_ids if short else ())
        logprobs.append(token_logprob(tokens, seed))
        tokens.append(tok)
        if tok in stop_ids:
            reason = "stop"
            break
        if len(tokens) >= limit:
            reason = "length"
            break
    prompt_lps = None
    if params.prompt_logprobs is not None:
        prompt_lps = [
            prompt_logprob(tuple(prompt[: j + 1]), prompt[j + 1], params.prompt_logprobs)
            for j in range(len(prompt) - 1)
        ]
    return tokens[len(prompt) :], reason, logprobs, prompt_lps


def check_blocks(engine: LLMEngine, executor: KVModelExecutor) -> None:
    """The block manager's accounting, and the prefix cache's content once its plans are run."""
    sched = engine.scheduler
    bm = sched.block_manager
    refs = [0] * bm.num_blocks
    for seq in sched.running:
        assert len(set(seq.block_table)) == len(seq.block_table), seq
        for b in seq.block_table:
            refs[b] += 1
        assert seq.num_computed_tokens <= len(seq.block_table) * bm.block_size, seq
        assert seq.num_computed_tokens <= len(seq.token_ids) + seq.num_pending_tokens, seq
        assert seq.num_pending_tokens <= len(sched.in_flight), seq
    for seq in sched.waiting:
        assert not seq.block_table, seq
    assert [b.ref_count for b in bm.blocks] == refs, "reference counts differ from the block tables"
    assert set(bm.free_block_ids) == {i for i, r in enumerate(refs) if r == 0}
    # A block registered by a plan in flight may not be written yet; every other cached block holds
    # the KV of the prefix its hash names.
    unwritten = {b for entry in sched.in_flight._plans for b in entry.registered}
    bs = bm.block_size
    for h, b in bm.cached_block_ids.items():
        block = bm.blocks[b]
        assert block.block_hash == h and len(block.token_ids) == bs
        if b in unwritten:
            continue
        held = executor.slots.get(b * bs + bs - 1)
        assert held is not None, f"cached block {b} was never written"
        prefix = held[0]
        assert len(prefix) % bs == 0 and list(prefix[-bs:]) == block.token_ids, f"cached block {b}"
        parent = _ROOT
        for i in range(len(prefix) // bs):
            parent = hash_block_tokens(parent, prefix[i * bs : (i + 1) * bs])
        assert parent == h, f"cached block {b} holds the KV of another prefix"
        for k in range(bs - 1):
            assert executor.slots.get(b * bs + k, ((), 0))[0] == prefix[: len(prefix) - bs + k + 1]


REQUEST = st.tuples(
    st.integers(1, 14),  # prompt length beyond the shared prefix
    st.sampled_from([0, 4, 8, 11]),  # shared prefix length
    st.integers(0, 2),  # seed of the unshared part
    st.integers(1, 10),  # max tokens
    st.integers(0, 5),  # arrival step
    st.one_of(st.none(), st.integers(0, 14)),  # abort step (a cancel or a deadline)
    st.integers(1, 3),  # n samples
    # what it asks for; "continue": its prompt starts with the previous request's prompt and output
    st.sampled_from(["plain", "eos", "prompt_logprobs", "logprobs", "stop", "min_tokens", "continue"]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(REQUEST, min_size=1, max_size=8),
    num_kv_blocks=st.integers(5, 20),
    block_size=st.sampled_from([2, 4]),
    budget=st.integers(1, 32),
    max_num_seqs=st.integers(1, 6),
    caching=st.booleans(),
    depth=st.sampled_from([1, 2, 3]),
    prefill_budget=st.sampled_from([0, 0, 3, 8]),
    fail_steps=st.sets(st.integers(1, 40), max_size=2),
    lose_steps=st.sets(st.integers(1, 40), max_size=1),
)
def test_random_workloads_on_a_model_of_the_kv_cache(**kwargs):
    run_model(**kwargs)


def run_model(
    requests,
    num_kv_blocks,
    block_size,
    budget,
    max_num_seqs,
    caching,
    depth,
    prefill_budget,
    fail_steps,
    lose_steps,
):
    ex_kwargs = dict(num_kv_blocks=num_kv_blocks, block_size=block_size, max_model_len=40, eos_token_ids=EOS)
    executor = KVModelExecutor(fail_steps, lose_steps, **ex_kwargs)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        max_plans_in_flight=depth,
        max_prefill_tokens_while_decoding=prefill_budget,
    )
    engine = LLMEngine(executor, config)
    max_model_len = engine.limits.max_model_len
    shared = [4 + (i * 37) % 400 for i in range(11)]
    expected, streamed, finished, gone, wants_logprobs, prompts = {}, {}, {}, set(), {}, {}
    rids: dict[int, list[int]] = {}
    aborted, lost = set(), []
    step = 0

    def take(outs) -> None:
        for o in outs:
            got = streamed.setdefault(o.request_id, {"tokens": [], "logprobs": [], "prompt": None})
            got["tokens"] += o.new_token_ids
            if o.new_logprobs is not None:
                got["logprobs"] += [lp.logprob for lp in o.new_logprobs]
            if o.prompt_logprobs is not None:
                assert got["prompt"] is None, f"request {o.request_id}: prompt logprobs twice"
                got["prompt"] = [
                    (lp.logprob, lp.rank, [t for t, _ in lp.top_logprobs]) for lp in o.prompt_logprobs
                ]
            if o.finished:
                assert o.request_id not in finished
                finished[o.request_id] = o
                if o.error is not None:
                    gone.add(o.request_id)
                else:
                    assert o.token_ids == got["tokens"]

    while step < 5000 and (
        engine.has_unfinished_requests() or engine.scheduler.has_finished_to_send() or step <= 15
    ):
        for j, (n, shared_len, seed, max_tokens, arrival, abort_at, num_samples, kind) in enumerate(requests):
            if arrival == step:
                prompt = shared[:shared_len]
                if kind == "continue" and j - 1 in rids:
                    first = rids[j - 1][0]
                    prompt = prompts[first] + expected[first][0]
                prompt = (prompt + [4 + (seed * 97 + i * 31 + j) % 500 for i in range(n)])[
                    : max_model_len - 1
                ]
                params = SamplingParams(
                    max_tokens=min(max_tokens, max_model_len - len(prompt)),
                    ignore_eos=kind not in ("eos", "min_tokens"),
                    stop_token_ids=list(range(100, 200 if kind == "stop" else 300))
                    if kind in ("stop", "min_tokens")
                    else [],
                    min_tokens=min(3, max_tokens, max_model_len - len(prompt)) if kind == "min_tokens" else 0,
                    logprobs=2 if kind == "logprobs" else 0,
                    prompt_logprobs=1 if kind == "prompt_logprobs" else None,
                    n=num_samples,
                    seed=j if num_samples > 1 else None,
                )
                rids[j] = []
                for sp in params.for_samples():
                    rid = engine.add_request(prompt, sp, request_id=len(expected))
                    rids[j].append(rid)
                    expected[rid] = reference(prompt, sp, max_model_len)
                    prompts[rid] = prompt
                    wants_logprobs[rid] = sp.logprobs > 0
            if abort_at == step:  # one sample (a cancel), or all of them (the request's deadline)
                for rid in rids.get(j, [])[: 1 if abort_at % 2 else None]:
                    if engine.abort_request(rid):
                        gone.add(rid)
                        aborted.add(rid)
        check_blocks(engine, executor)
        try:
            take(engine.step())
        except ValueError:
            take(engine.fail_requests(engine.last_plan.seq_ids, "rejected"))
        except ConnectionError:
            # ExecutorRecovery.lose, then connect: the unfinished requests are recomputed.
            unfinished = engine.scheduler.unfinished()
            next_step_id = engine.scheduler.next_step_id
            for seq in unfinished:
                seq.reset_for_recompute()
            engine = LLMEngine(executor, config, next_step_id)
            executor.reset()
            lost.append(step)
            executor.params.clear()
            for seq in unfinished:
                engine.adopt(seq)
        check_blocks(engine, executor)
        step += 1

    assert not engine.has_unfinished_requests(), "did not finish"
    stats = engine.scheduler.stats
    event(f"steps {min(step, 100) // 20 * 20}+")
    event(f"depth {depth}, preempted: {stats.num_preemptions > 0}, failed: {bool(gone - aborted)}")
    event(f"caching {caching}, prefix hits: {stats.num_prefix_hit_tokens > 0}, lost: {bool(lost)}")
    assert engine.scheduler.block_manager.num_used_blocks == 0, "blocks leaked"
    assert not executor.seqs, "the executor still holds sequences"
    assert executor.most_in_flight <= depth
    for rid, (tokens, reason, logprobs, prompt_lps) in expected.items():
        got = streamed.get(rid, {"tokens": [], "logprobs": [], "prompt": None})
        assert got["tokens"] == tokens[: len(got["tokens"])], f"request {rid}: wrong tokens"
        if rid in gone:
            assert rid not in finished or finished[rid].finish_reason == "abort"
            continue
        assert rid in finished, f"request {rid} never finished"
        assert (finished[rid].finish_reason, got["tokens"]) == (reason, tokens), f"request {rid}"
        if wants_logprobs[rid]:
            assert got["logprobs"] == logprobs, f"request {rid}: logprobs"
        if prompt_lps is not None:
            want = [(x[0], x[1], x[2]) for x in prompt_lps]
            assert got["prompt"] == want, f"request {rid}: prompt logprobs"
