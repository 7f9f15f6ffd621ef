"""Slot-equivariant actor-critic networks for the slogym envs (SB3 policies).

Batching-v0 scores each of its K candidates and Routing-v0 picks one of its instances: both actions are one
value per *slot* (a candidate, an instance) plus a few extra outputs (the token-budget level, the defer
logit). A plain MLP on the flattened observation must learn a separate mapping for every slot position
through a shared bottleneck. Here one small network scores every slot from that slot's features and the
context (everything else in the observation) -- the same function for every slot, so "earliest deadline
first" or "least-loaded instance" is one rule to learn, not K of them -- in the style of Deep Sets
(Zaheer et al. 2017):

    h_i     = enc([slot_i, context])                 per slot, shared weights
    pooled  = mean of h_i over valid slots
    mean_i  = score([h_i, pooled])                   the action's mean (Box) or logit (Discrete) for slot i
    extra   = head([pooled, context])                budget level / defer logit
    value   = critic([pooled, context])

The network emits the action's means / logits itself (SB3's ``action_net`` is the identity). The flattened
observation is split back into slots with a ``layout`` (see :func:`slot_layout`) stored in the policy's
keyword arguments, so a saved model reloads without the env.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from gymnasium import spaces
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.policies import ActorCriticPolicy
from torch import nn

__all__ = ["slot_layout", "SlotNet", "SlotPolicy", "MaskableSlotPolicy"]


def slot_layout(space: spaces.Dict, items: list[str], mask: str | None, n_extra: int) -> dict[str, Any]:
    """Where each part of ``space`` lies in its flattened form (``gymnasium.spaces.flatten`` order): the
    per-slot ``items`` (arrays whose first axis is the slot), the ``mask`` entry (1 = real slot), and the
    context (every other entry); ``n_extra`` outputs follow the slot outputs in the action."""
    offsets, o = {}, 0
    for key, sub in space.spaces.items():
        offsets[key] = (o, spaces.flatdim(sub))
        o += offsets[key][1]
    n_slots = int(space[items[0]].shape[0])
    for k in items:
        if space[k].shape[0] != n_slots:
            raise ValueError(f"slot entry {k!r} has {space[k].shape[0]} slots, {items[0]!r} has {n_slots}")
    return {
        "n_slots": n_slots, "n_extra": int(n_extra),
        "items": [[offsets[k][0], offsets[k][1] // n_slots] for k in items],
        "mask": offsets[mask][0] if mask else None,
        "context": [list(offsets[k]) for k in space.spaces if k not in items and k != mask],
    }


class SlotNet(nn.Module):
    """SB3 ``mlp_extractor``: ``forward_actor`` gives (batch, n_slots + n_extra) action means / logits,
    ``forward_critic`` the (batch, hidden) value latent. See the module docstring."""

    def __init__(self, layout: dict[str, Any], hidden: int) -> None:
        super().__init__()
        self.n, self.n_extra = layout["n_slots"], layout["n_extra"]
        self.items, self.mask, self.context = layout["items"], layout["mask"], layout["context"]
        item_dim = sum(w for _, w in self.items)
        ctx_dim = sum(s for _, s in self.context)
        self.enc = nn.Sequential(nn.Linear(item_dim + ctx_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                 nn.Tanh())
        self.score = nn.Linear(2 * hidden, 1)
        self.extra = nn.Linear(hidden + ctx_dim, self.n_extra)
        self.critic = nn.Sequential(nn.Linear(hidden + ctx_dim, hidden), nn.Tanh())
        self.latent_dim_pi, self.latent_dim_vf = self.n + self.n_extra, hidden

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-slot encodings (B, n, hidden), pooled encoding (B, hidden), context (B, ctx)."""
        b = x.shape[0]
        slots = torch.cat([x[:, o:o + self.n * w].reshape(b, self.n, w) for o, w in self.items], dim=-1)
        ctx = torch.cat([x[:, o:o + s] for o, s in self.context], dim=-1)
        h = self.enc(torch.cat([slots, ctx.unsqueeze(1).expand(b, self.n, ctx.shape[1])], dim=-1))
        m = x[:, self.mask:self.mask + self.n].unsqueeze(-1) if self.mask is not None else torch.ones_like(h[..., :1])
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        return h, pooled, ctx

    def _actor(self, h: torch.Tensor, pooled: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        per_slot = self.score(torch.cat([h, pooled.unsqueeze(1).expand_as(h)], dim=-1)).squeeze(-1)
        return torch.cat([per_slot, self.extra(torch.cat([pooled, ctx], dim=-1))], dim=-1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, pooled, ctx = self._encode(x)
        return self._actor(h, pooled, ctx), self.critic(torch.cat([pooled, ctx], dim=-1))

    def forward_actor(self, x: torch.Tensor) -> torch.Tensor:
        return self._actor(*self._encode(x))

    def forward_critic(self, x: torch.Tensor) -> torch.Tensor:
        _, pooled, ctx = self._encode(x)
        return self.critic(torch.cat([pooled, ctx], dim=-1))


class _SlotMixin:
    """Builds a :class:`SlotNet` in place of SB3's MLP extractor and drops ``action_net``.

    ``extra_log_std`` (Box actions) sets the initial exploration log-std of the extra outputs apart from
    the slot scores': Batching-v0's budget level spans 16..32768 tokens over [-1, 1], so the slot scores'
    noise would swing the budget by thousands of tokens."""

    def __init__(self, *args: Any, layout: dict[str, Any], hidden: int = 64, extra_log_std: float | None = None,
                 **kwargs: Any) -> None:
        self.layout, self.hidden, self.extra_log_std = layout, hidden, extra_log_std
        super().__init__(*args, **kwargs)

    def _build_mlp_extractor(self) -> None:
        self.mlp_extractor = SlotNet(self.layout, self.hidden)

    def _build(self, lr_schedule: Any) -> None:
        super()._build(lr_schedule)
        self.action_net = nn.Identity()  # SlotNet emits the means / logits itself
        if self.ortho_init:  # small initial outputs, as SB3 does for its action_net
            for head in (self.mlp_extractor.score, self.mlp_extractor.extra):
                head.apply(partial(self.init_weights, gain=0.01))
        if self.extra_log_std is not None and hasattr(self, "log_std"):
            with torch.no_grad():
                self.log_std[-self.layout["n_extra"]:] = self.extra_log_std
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)

    def _get_constructor_parameters(self) -> dict[str, Any]:
        return super()._get_constructor_parameters() | {
            "layout": self.layout, "hidden": self.hidden, "extra_log_std": self.extra_log_std}


class SlotPolicy(_SlotMixin, ActorCriticPolicy):
    """PPO policy (Box actions: a Gaussian per slot score + the extra outputs)."""


class MaskableSlotPolicy(_SlotMixin, MaskableActorCriticPolicy):
    """MaskablePPO policy (Discrete actions: one logit per slot + the extra ones, invalid ones masked)."""
