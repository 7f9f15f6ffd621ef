"""The shared token-budget loop (``baselines.common``) against the rule its docstring states, written out here in
plain Python: candidates are drawn lazily from long queues in pieces, which must not change the batch."""

from __future__ import annotations

import numpy as np
import pytest

from slogym.baselines import make_policy
from slogym.baselines.common import decode_batch, decodes_and_chunks, fill_prefill_chunks, split_running
from slogym.core.request import Workload
from slogym.core.simulator import Simulator
from slogym.core.state import I_KV, I_NC, I_NT

from conftest import ToyEngine

_EMPTY = np.zeros(0, np.int64)


def _instance(n: int, rng: np.random.Generator):
    """An instance whose ``n`` requests have random prompt lengths, progress and held KV."""
    arrival = np.arange(n, dtype=float)
    w = Workload.two_stage(arrival, rng.integers(1, 300, n), np.full(n, 4), 1.0, 0.1)
    eng = ToyEngine(kv_capacity_tokens=1 << 20)
    sim = Simulator(w, eng, make_policy("sarathi", eng))
    I = sim.rs.I
    I[:, I_NT] = rng.integers(1, 300, n)
    I[:, I_NC] = (I[:, I_NT] * rng.random(n) * (rng.random(n) < 0.3)).astype(np.int64)
    I[:, I_KV] = -(-I[:, I_NC] // sim.instances[0].block_size)
    return sim.instances[0], I


def _rule(I, cands, budget, free, max_seqs, bs, chunked, floor=-1):
    """fill_prefill_chunks' docstring, literally (``floor`` >= 0: take_in_order's whole-prompt admission)."""
    reqs, toks, used, repeatable = [], [], 0, False
    for r in cands:
        if budget <= 0 or len(reqs) >= max_seqs:
            break
        nc, rem, held = int(I[r, I_NC]), int(I[r, I_NT] - I[r, I_NC]), int(I[r, I_KV])
        fits = (free - used + held) * bs - nc  # tokens its KV can still grow by
        whole = max(-(-(nc + rem) // bs) - held, 0)  # blocks of its whole remaining prefill
        if chunked:
            chunk = min(rem, budget, fits)
            if floor >= 0 and held == 0 and whole > free - used - floor:
                chunk = 0  # a starting prompt must fit whole, the watermark spared
        else:  # whole prefills only; the first may exceed the budget
            chunk = rem if (rem <= budget or not reqs) and rem <= fits else 0
        if chunk < 1:
            break
        repeatable = not reqs and chunk == budget and budget < rem and chunk < fits
        reqs.append(r)
        toks.append(chunk)
        used += whole if floor >= 0 else max(-(-(nc + chunk) // bs) - held, 0)
        budget -= chunk
    return reqs, toks, used, repeatable


@pytest.mark.parametrize("chunked", [True, False])
def test_fill_prefill_chunks_follows_its_rule_on_long_queues(chunked: bool) -> None:
    rng = np.random.default_rng(7)
    inst, I = _instance(400, rng)
    drawn_past_first_piece = 0
    for _ in range(300):
        queue = rng.permutation(400)[: rng.integers(0, 400)].tolist()
        budget = int(rng.choice([0, 5, 512, 4096, 20000]))
        free = int(rng.integers(0, 3000))
        max_seqs = int(rng.integers(1, 300))
        got = fill_prefill_chunks(inst, iter(queue), budget, free, max_seqs, chunked)
        want = _rule(I, queue, budget, free, max_seqs, inst.block_size, chunked)
        assert got == want, (budget, free, max_seqs)
        drawn_past_first_piece += len(got[0]) > 8
    assert drawn_past_first_piece > 20  # the lazy continuation was exercised


def test_only_the_batch_first_prefill_may_exceed_the_budget() -> None:
    """Unchunked: the ninth whole prompt (the first of the second piece drawn) must not overrun the budget."""
    inst, I = _instance(20, np.random.default_rng(0))
    I[:, I_NT], I[:, I_NC], I[:, I_KV] = 10, 0, 0
    reqs, toks, _, _ = fill_prefill_chunks(inst, iter(range(20)), 85, 10_000, 100, chunked=False)
    assert reqs == list(range(8)) and sum(toks) == 80


def test_split_running_keeps_order() -> None:
    rng = np.random.default_rng(3)
    inst, I = _instance(50, rng)
    inst.running = rng.permutation(50)[:30].tolist()
    inst.running_changed()
    dec, pre = split_running(inst)
    one = [r for r in inst.running if I[r, I_NT] - I[r, I_NC] == 1]
    assert dec.tolist() == one
    assert pre.tolist() == [r for r in inst.running if r not in one]


def test_decodes_and_chunks_puts_decode_steps_first() -> None:
    rng = np.random.default_rng(5)
    inst, I = _instance(60, rng)
    dec = np.array([3, 1, 4], np.int64)
    queue = list(range(10, 60))
    req, tok, repeatable = decodes_and_chunks(inst, dec, iter(queue), 200, 500, 20)
    want = _rule(I, queue, 200, 500, 20, inst.block_size, True)
    assert req.tolist() == [3, 1, 4] + want[0] and tok.tolist() == [1, 1, 1] + want[1]
    assert repeatable == want[3]


def test_whole_prompt_admission_follows_its_rule() -> None:
    """Sarathi's admission (vLLM v0's block manager): a prompt starts only when all of it fits above the
    watermark, and the prefills already taken keep their remaining blocks reserved for the rest of the batch."""
    rng = np.random.default_rng(11)
    inst, I = _instance(300, rng)
    refused = 0
    for _ in range(300):
        queue = rng.permutation(300)[: rng.integers(1, 300)].tolist()
        budget, free, floor = int(rng.choice([64, 512, 4096])), int(rng.integers(0, 400)), int(rng.integers(0, 20))
        req, tok, repeatable = decodes_and_chunks(inst, _EMPTY, iter(queue), budget, free, 256, floor)
        want = _rule(I, queue, budget, free, 256, inst.block_size, True, floor)
        assert (req.tolist(), tok.tolist(), repeatable) == (want[0], want[1], want[3]), (budget, free, floor)
        plain = _rule(I, queue, budget, free, 256, inst.block_size, True)
        refused += len(want[0]) < len(plain[0])
    assert refused > 20  # the whole-prompt check binds in many of these cases


def test_sarathi_starts_a_prompt_only_when_all_of_it_fits() -> None:
    inst, I = _instance(3, np.random.default_rng(0))
    I[:, I_NT], I[:, I_NC], I[:, I_KV] = 1000, 0, 0
    bs = inst.block_size
    inst.waiting = [0, 2]
    inst.free_blocks = -(-1000 // bs) + int(0.01 * inst.total_blocks) - 1  # one block short of prompt + watermark
    I[1, I_NT], I[1, I_NC], I[1, I_KV] = 11, 10, 1  # a decode runs (its next token needs no new block): the
    inst.running = [1]                              # watermark binds while something runs
    inst.running_changed()
    for whole, admitted in ((True, []), (False, [0])):
        batch = make_policy("sarathi", inst.engine, whole_prompt=whole).scheduler.next_batch(inst, 0.0)
        assert [r for r in batch.req.tolist() if r != 1] == admitted
    inst.free_blocks += 1  # exactly prompt + watermark
    batch = make_policy("sarathi", inst.engine).scheduler.next_batch(inst, 0.0)
    assert 0 in batch.req.tolist()


@pytest.mark.parametrize("policy", ["vllm", "sarathi"])
@pytest.mark.parametrize("pilot", [True, False])
def test_a_prompt_that_fits_only_into_the_watermark_is_not_stranded(policy: str, pilot: bool) -> None:
    """A prompt of 1,241 blocks on a 1,250-block instance fits the KV but not above the 12-block watermark: it
    starts once nothing runs (else, at the head of the FCFS queue, it would strand the requests behind it)."""
    from slogym.core.request import Request, decode, prefill

    eng = ToyEngine()
    reqs = [Request(0.0, [prefill(19_850, 10.0), decode(4, 1.0)])]
    reqs += [Request(0.1 * i, [prefill(100, 10.0), decode(4, 1.0)]) for i in range(1, 6)]
    sim = Simulator(Workload.from_requests(reqs), eng, make_policy(policy, eng), seed=0, pilot=pilot).run()
    assert sim.instances[0].total_blocks == 1250 and -(-19_850 // 16) > 1250 - 12
    assert sim.result().summary["outcomes"]["finished"] == 6


def test_decode_batch_layout() -> None:
    b = decode_batch(np.array([4, 2], np.int64), [5], steady=True)
    assert b.req.tolist() == [4, 2] and b.tokens.tolist() == [1, 1]
    assert b.preempt == (5,) and b.steady


@pytest.mark.parametrize("policy", ["vllm", "sarathi"])
def test_waiting_kv_holders_do_not_deadlock_whole_prompt_admission(policy: str) -> None:
    """Requests back from tool calls wait holding their KV; when nothing runs and the queue's head needs more KV
    than is free, unstick drops the latest such holder's KV (it recomputes later) instead of idling forever.
    Before, vLLM on toolllm with the 70B TP2 preset (1,153 blocks) left 1,411 of 1,500 requests never scheduled."""
    from slogym.engines.registry import get_engine
    from slogym.workloads.scenarios import SCENARIOS, make_workload

    engine = get_engine("llama2-70b-a100-tp2")
    w = make_workload("toolllm", rate=SCENARIOS["toolllm"].default_rate * 0.3, n_requests=1500, seed=1)
    sim = Simulator(w, engine, make_policy(policy, engine), seed=1).run()
    assert sim.dropped_reasons == {}
    assert (sim.rs.finish >= w.arrival).all()
    assert all(x.free_blocks == x.total_blocks for x in sim.instances)
