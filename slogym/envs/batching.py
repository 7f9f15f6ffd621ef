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
from slogym.core.batch import Batch
from slogym.core.instance import Instance
from slogym.core.simulator import Simulator
from slogym.envs import kernels
from slogym.envs.base import CLIP, INSTANCE_FEATURES, ServingEnv, _box, log_token_table, log_tokens

B_MIN, B_MAX = 16, 32768
PREEMPT, SKIP = -0.9, 0.0
UNSCORED = SKIP - 0.5
"""Score of a candidate the last decision did not score (``quantum`` > 1): skipped."""


def _wake(sim: Simulator, t: float) -> None:
    """Timer callback of an idled instance: none needed, idle instances are offered work after every timer."""


def budget_of(level: float) -> int:
    return int(round(B_MIN + (float(level) + 1.0) / 2.0 * (B_MAX - B_MIN)))


def level_of(budget: int) -> float:
    return 2.0 * (min(max(budget, B_MIN), B_MAX) - B_MIN) / (B_MAX - B_MIN) - 1.0


class BatchingEnv(ServingEnv):
    decision = "schedule"

    def __init__(self, K: int | None = None, quantum: int = 1, idle_wait: float = 0.01, stall_timeout: float = 30.0,
                 **kw: Any) -> None:
        if K is not None and int(K) < 1:
            raise ValueError(f"K={K}; must be >= 1")
        if int(quantum) < 1:
            raise ValueError(f"quantum={quantum}; must be >= 1")
        if not (idle_wait > 0 and stall_timeout >= 0):
            raise ValueError(f"idle_wait={idle_wait} must be > 0 and stall_timeout={stall_timeout} >= 0 (seconds)")
        super().__init__(**kw)
        self.idle_wait, self.stall_timeout = float(idle_wait), float(stall_timeout)
        self._idle_since: dict[int, float] = {}  # per instance: when its unbroken run of empty batches began
        # default: every request the engine may run at once plus the head of the queue, so any batch fits
        self.K = int(K) if K is not None else self.engine.max_num_seqs + 16
        self.quantum = int(quantum)
        self.action_space = spaces.Box(-1.0, 1.0, (self.K + 1,), np.float32)
        self.observation_space = spaces.Dict({
            "candidates": _box(self.K, 10), "valid": _box(self.K, low=0.0, high=1.0),
            "instance": _box(len(INSTANCE_FEATURES) + 1), "recent": _box(2, low=0.0, high=1.0),
        })
        # log-scale predicted output p90 per app (the predictor is fixed per env)
        self._p90_log = log_tokens(self.predictor.predict(np.arange(self.n_apps))[:, -1])
        self._score = np.zeros(0)  # last decision's score per request (UNSCORED if none), see _bind
        self._scored = np.zeros(0, np.int64)  # the requests it scored
        self._slot = np.zeros(0, np.int64)  # scratch of kernels.encode_batch: -1 per request
        self._level = 0.0
        self._left = 0
        self._cands: tuple[Any, np.ndarray, int] = (None, self._scored, 0)  # (decision msg, candidates, n running)

    def _configure(self, sim: Simulator) -> None:
        sim.agent_schedule = True

    def _bind(self, sim: Simulator) -> None:
        super()._bind(sim)
        self._score = np.full(len(sim.w), UNSCORED)
        self._slot = np.full(len(sim.w), -1, np.int64)
        self._scored = np.zeros(0, np.int64)
        self._left = 0
        self._idle_since = {}

    def _advance(self, action: Any) -> Generator[tuple, float, tuple[bool, float]]:
        """Between agent decisions (``quantum`` > 1) the last scores keep forming the batches."""
        done, reward = yield from super()._advance(action)
        while not done and self._left > 0:
            self._left -= 1
            done, r = yield from super()._advance(self._form(self._level))
            reward += r
        return done, reward

    # ------------------------------------------------------------------ candidates and observation
    def candidates(self, inst: Instance | None = None) -> list[int]:
        """The candidate requests of ``inst`` (default: the instance deciding now), slot by slot."""
        if inst is None or inst is self._msg[1]:
            return self._candidates()[0].tolist()
        return (inst.running + inst.waiting)[: self.K]

    def _candidates(self) -> tuple[np.ndarray, int]:
        """The deciding instance's candidates (an int64 array) and how many of them run; computed once per
        decision (the simulator is paused in between)."""
        msg, cands, n_run = self._cands
        if msg is not self._msg:
            inst = self._msg[1]
            run = inst.running_array()[: self.K]
            n_run = run.size
            if n_run < self.K and inst.waiting:
                cands = np.concatenate((run, np.array(inst.waiting[: self.K - n_run], np.int64)))
            else:
                cands = run
            self._cands = (self._msg, cands, n_run)
        return cands, n_run

    def _observe(self) -> dict[str, np.ndarray]:
        _, inst, now = self._msg
        sim = self.sim
        rs, w = sim.rs, sim.w
        c, _ = self._candidates()
        n = c.size
        feats = np.zeros((self.K, 10), np.float32)
        if n:
            table = log_token_table(0)
            dl = rs.next_deadline(w, c)
            while need := kernels.candidate_features(rs.I, rs.status, rs.ready, c, dl, now, w.min_tpot,
                                                     w.best_effort, w.app, table, self._p90_log, CLIP, feats):
                table = log_token_table(need)
        valid = np.zeros(self.K, np.float32)
        valid[:n] = 1.0
        own = np.empty(len(INSTANCE_FEATURES) + 1, np.float32)
        own[:-1] = self._instance_features([inst])[0]
        own[-1] = inst.id / self.n_instances
        return {"candidates": feats, "valid": valid, "instance": own, "recent": self._recent()}

    # ------------------------------------------------------------------ actions
    def _to_sim_action(self, action: Any) -> Batch:
        try:
            a = np.asarray(action, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"action must be {self.K + 1} finite values in [-1, 1] ({self.action_space}); "
                             f"got {action!r}") from None
        if a.shape != (self.K + 1,) or not kernels.in_box(a, 1.0 + 1e-6):
            raise ValueError(f"action must be {self.K + 1} finite values in [-1, 1] ({self.action_space}); "
                             f"got shape {a.shape}, values {np.array2string(a, threshold=8, precision=3)}")
        cands, _ = self._candidates()
        self._score[self._scored] = UNSCORED
        self._score[cands] = a[: cands.size]
        self._scored = cands
        self._level = float(a[-1])
        self._left = self.quantum - 1
        return self._form(self._level)

    def _form(self, level: float) -> Batch:
        """The batch the last scores and the budget ``level`` describe on the deciding instance (see the
        module docstring; :func:`slogym.envs.kernels.form_batch` applies the rules)."""
        inst = self._msg[1]
        cands, n_run = self._candidates()
        reqs, toks, pre = kernels.form_batch(self.sim.rs.I, cands, self._score[cands], n_run, inst.free_blocks,
                                             budget_of(level), inst.block_size, PREEMPT, SKIP)
        if reqs.size or pre.size:
            self._idle_since.pop(inst.id, None)
        elif cands.size:
            self._wake_later(inst)
        return Batch(req=reqs, tokens=toks, preempt=tuple(pre.tolist()))

    def _wake_later(self, inst: Instance) -> None:
        """An empty batch on an instance holding requests idles it for ``idle_wait`` s, then asks again -- not
        until the next arrival, which after the last one would end the episode with every resident request
        dropped. After ``stall_timeout`` s of nothing but empty batches it waits for the next event instead (so
        an agent that never schedules still ends its episode; its requests are then dropped as ``stalled`` /
        ``never_scheduled``)."""
        now = self._msg[2]
        if now - self._idle_since.setdefault(inst.id, now) < self.stall_timeout:
            self.sim.add_timer(now + self.idle_wait, _wake)

    def expert_action(self, name: str | None = None, **params: Any) -> np.ndarray:
        """The action that makes the env form exactly the batch scheduler ``name`` (default: ``policy``)
        would form now. Raises if that batch uses requests beyond the first ``K`` candidates."""
        _, inst, now = self._decision()
        if name is None:
            sched = self.sim.policy.scheduler
        else:
            sched = make_policy(name, self.engine, **params).scheduler
        batch = sched.next_batch(inst, now) or Batch()
        cands, _ = self._candidates()
        members = np.asarray(batch.req, dtype=np.int64)
        preempt = np.array(batch.preempt, dtype=np.int64)
        a = np.full(self.K + 1, -0.5, np.float32)
        missing = kernels.encode_batch(cands, members, preempt, self._slot, a)
        if missing >= 0 or batch.drop or batch.demote or batch.spec is not None:
            known = set(cands.tolist())
            absent = [r for r in np.concatenate((members, preempt)).tolist() if r not in known]
            why = [f"requests {absent} are not among the first K={self.K} candidates"] if absent else []
            why += [f"it {verb} requests {list(rs)}" for verb, rs in (("drops", batch.drop), ("demotes", batch.demote))
                    if rs]
            why += ["it speculates (batch.spec: tokens it may have to roll back)"] if batch.spec is not None else []
            raise ValueError(f"the {name or self.policy_name} batch cannot be expressed by Batching-v0's action: "
                             f"{'; '.join(why)}")
        a[-1] = level_of(int(np.sum(batch.tokens)))
        return a
