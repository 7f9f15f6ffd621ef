"""``slogym/Batching-v0``: iteration-level batching by priority scores.

Steps whenever an instance starts an iteration (or every ``quantum`` iterations, reusing the last scores).

Candidates: the first ``K`` of the instance's running requests (running order) followed by its waiting
requests (queue order). ``K`` defaults to the engine's ``max_num_seqs + 16``, so every running request and the
head of the queue are candidates.

Action ``Box(-1, 1, (K + 1,))``: a score per candidate slot and a token-budget level. The environment forms
the batch from the scores:

* score < -0.9: preempt the candidate by recompute now (if it is running);
* -0.9 <= score < 0: skip it this iteration;
* score >= 0: schedule it, highest score first -- a decode step takes one token, a prefill takes a chunk of
  ``min(remaining, budget left, KV that fits)`` tokens -- until the budget
  ``16 + (level + 1) / 2 * (32768 - 16)`` tokens is spent. When a decode step needs a KV block and none is
  free, running candidates with lower scores are preempted (lowest first) to make room.

Observation (``Dict``, ``float32``, clipped to [-10, 10]):

==============  =========  ==================================================================================
key             shape      features
==============  =========  ==================================================================================
``candidates``  (K, 10)    running flag, decode-ready flag, tokens left to compute (log scale), context tokens
                           (log scale), output tokens generated (log scale), predicted output p90 (log scale),
                           slack to the next token's deadline (s), TPOT SLO (/100 ms), time waiting since the
                           current stage became ready (s), no-SLO flag
``valid``       (K,)       1 for a real candidate, 0 for padding
``instance``    (6,)       this instance's load features (as ``instances`` in Routing-v0) and its index / n
``recent``      (2,)       EWMA (0.95) of recent SLO outcomes, fraction of the episode done
==============  =========  ==================================================================================

Baselines expressible (``expert_action(name)``): any scheduler's batch is encoded exactly -- members get
decreasing positive scores in batch order, its preemptions the preempt band, the budget its token total --
so vLLM FCFS, Sarathi, EDF (and later Tempo LSDF, SJF, Autellix PLAS, SA, SLOs-Serve) replay through the env
with the same metrics as native runs, provided the batch's requests are among the first ``K`` candidates.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np
from gymnasium import spaces

from slogym.baselines import make_policy
from slogym.baselines.common import BatchBuilder
from slogym.core.batch import Batch
from slogym.core.instance import Instance
from slogym.core.simulator import Simulator
from slogym.envs.base import CLIP, INSTANCE_FEATURES, ServingEnv, _box, instance_features, log_tokens

B_MIN, B_MAX = 16, 32768
PREEMPT, SKIP = -0.9, 0.0


def budget_of(level: float) -> int:
    return int(round(B_MIN + (float(level) + 1.0) / 2.0 * (B_MAX - B_MIN)))


def level_of(budget: int) -> float:
    return 2.0 * (min(max(budget, B_MIN), B_MAX) - B_MIN) / (B_MAX - B_MIN) - 1.0


class BatchingEnv(ServingEnv):
    decision = "schedule"

    def __init__(self, K: int | None = None, quantum: int = 1, **kw: Any) -> None:
        if K is not None and int(K) < 1:
            raise ValueError(f"K={K}; must be >= 1")
        if int(quantum) < 1:
            raise ValueError(f"quantum={quantum}; must be >= 1")
        super().__init__(**kw)
        # default: every request the engine may run at once plus the head of the queue, so any batch fits
        self.K = int(K) if K is not None else self.engine.max_num_seqs + 16
        self.quantum = int(quantum)
        self.action_space = spaces.Box(-1.0, 1.0, (self.K + 1,), np.float32)
        self.observation_space = spaces.Dict({
            "candidates": _box(self.K, 10), "valid": _box(self.K, low=0.0, high=1.0),
            "instance": _box(len(INSTANCE_FEATURES) + 1), "recent": _box(2, low=0.0, high=1.0),
        })
        self._scores: dict[int, float] = {}
        self._level = 0.0
        self._left = 0

    def _configure(self, sim: Simulator) -> None:
        sim.agent_schedule = True
        self._left = 0

    def _advance(self, action: Any) -> Generator[tuple, float, tuple[bool, float]]:
        """Between agent decisions (``quantum`` > 1) the last scores keep forming the batches."""
        done, reward = yield from super()._advance(action)
        while not done and self._left > 0:
            self._left -= 1
            done, r = yield from super()._advance(self._form(self._msg[1], self._scores, self._level))
            reward += r
        return done, reward

    # ------------------------------------------------------------------ candidates and observation
    def candidates(self, inst: Instance | None = None) -> list[int]:
        inst = inst or self._msg[1]
        return (inst.running + inst.waiting)[: self.K]

    def _observe(self) -> dict[str, np.ndarray]:
        _, inst, now = self._msg
        sim = self.sim
        rs, w = sim.rs, sim.w
        c = np.array(self.candidates(inst), dtype=np.int64)
        n = c.size
        feats = np.zeros((self.K, 10), np.float32)
        if n:
            running = rs.status[c] == 4
            rem = rs.num_tokens[c] - rs.num_computed[c]
            dl = rs.next_deadline(w, c)
            feats[:n] = np.column_stack([
                running, rem == 1, log_tokens(rem), log_tokens(rs.num_tokens[c]), log_tokens(rs.generated[c]),
                log_tokens(self.predictor.predict(w.app[c])[:, -1]), np.nan_to_num(dl - now, posinf=CLIP),
                np.minimum(w.min_tpot[c] / 0.1, CLIP), now - rs.ready[c], w.best_effort[c],
            ])
        valid = np.zeros(self.K, np.float32)
        valid[:n] = 1.0
        own = np.append(instance_features(sim)[inst.id], inst.id / self.n_instances).astype(np.float32)
        return {"candidates": np.clip(feats, -CLIP, CLIP), "valid": valid, "instance": own,
                "recent": self._recent()}

    # ------------------------------------------------------------------ actions
    def _to_sim_action(self, action: Any) -> Batch:
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.shape != (self.K + 1,) or not np.isfinite(a).all() or (np.abs(a) > 1.0 + 1e-6).any():
            raise ValueError(f"action must be {self.K + 1} finite values in [-1, 1] ({self.action_space}); "
                             f"got shape {a.shape}, values {np.array2string(a, threshold=8, precision=3)}")
        inst = self._msg[1]
        cands = self.candidates(inst)
        self._scores = dict(zip(cands, a[: len(cands)].tolist()))
        self._level = float(a[-1])
        self._left = self.quantum - 1
        return self._form(inst, self._scores, self._level)

    def _form(self, inst: Instance, scores: dict[int, float], level: float) -> Batch:
        """The batch the scores and budget level describe (see the module docstring)."""
        rs = self.sim.rs
        cands = self.candidates(inst)
        sc = [scores.get(r, SKIP - 0.5) for r in cands]
        running = set(inst.running)
        preempt = [r for r, s in zip(cands, sc) if s < PREEMPT and r in running]
        free = inst.free_blocks + sum(int(rs.kv_blocks[r]) for r in preempt)
        order = sorted((i for i, s in enumerate(sc) if s >= SKIP), key=lambda i: -sc[i])
        b = BatchBuilder(inst, budget_of(level), free)
        # lowest-scored running candidates are the victims when a decode step finds no free block
        victims = sorted((i for i, s in enumerate(sc) if cands[i] in running and s >= PREEMPT), key=lambda i: sc[i])
        for i in order:
            if b.full:
                break
            r = cands[i]
            if r in preempt:
                continue
            if b.is_decode(r):
                need = b.decode_need(r)
                while need > b.free and victims and sc[victims[0]] < sc[i]:
                    v = cands[victims.pop(0)]
                    if v not in b.reqs and v not in preempt:
                        preempt.append(v)
                        b.free += int(rs.kv_blocks[v])
            b.take(r)
        reqs, toks = b.reqs, b.toks
        return Batch(req=np.array(reqs, np.int64), tokens=np.array(toks, np.int64), preempt=tuple(preempt))

    def expert_action(self, name: str | None = None, **params: Any) -> np.ndarray:
        """The action that makes the env form exactly the batch scheduler ``name`` (default: ``policy``)
        would form now. Raises if that batch uses requests beyond the first ``K`` candidates."""
        _, inst, now = self._msg
        if name is None:
            sched = self.sim.policy.scheduler
        else:
            sched = make_policy(name, self.engine, **params).scheduler
        batch = sched.next_batch(inst, now) or Batch()
        cands = self.candidates(inst)
        pos = {r: i for i, r in enumerate(cands)}
        missing = [int(r) for r in list(batch.req) + list(batch.preempt) if int(r) not in pos]
        if missing or batch.drop or batch.demote or batch.spec is not None:
            raise ValueError(f"the {name or self.policy_name} batch cannot be expressed with K={self.K} "
                             f"(requests {missing} are not among the first K candidates, or it drops, demotes "
                             f"or speculates)")
        a = np.full(self.K + 1, -0.5, np.float32)
        for j, r in enumerate(batch.req.tolist()):
            a[pos[r]] = 1.0 - j * (0.9 / (len(batch) + 1))
        for j, r in enumerate(batch.preempt):
            a[pos[int(r)]] = -1.0 + j * (0.05 / (len(batch.preempt) + 1))
        a[-1] = level_of(int(np.sum(batch.tokens)))
        return a
