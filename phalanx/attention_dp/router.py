"""Cache-aware placement of new requests on attention-DP ranks. Pure Python: no torch.

Every rank runs this on the same inputs — each rank's prefix match length for every new
request and each rank's load, allgathered — so every rank computes the same placement without
a coordinator, then keeps its own share.

For a request of L prompt tokens and rank r::

    score(r) = (L - match[r]) + β · L · load[r] / capacity[r]

the tokens r would have to compute plus its load as a share of its capacity, in units of the
request (β = 0 routes on cache alone, larger β balances harder). Lowest score wins; ties go to
the lowest rank; a rank at capacity is skipped unless every rank is. Requests are placed in
arrival order and each placement adds one to that rank's load.

A shared prefix (a chat template's system prompt) would otherwise pull every request onto the
one rank that holds it: once the loads differ by ``balance_threshold`` requests or more, the
next request goes to the least-loaded rank instead. With ``load_only`` the match lengths are
ignored (score = load / capacity).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class PlacementProbe(NamedTuple):
    """What one rank tells the others about itself before a placement (travels as an array)."""

    matches: list[int]     # cached prompt tokens of each new request on this rank
    load: int              # requests this rank owns now
    capacity: int          # most requests it takes


@dataclass(frozen=True)
class RouterConfig:
    load_balance_weight: float = 1.0   # β
    load_only: bool = False
    balance_threshold: int = 4         # load gap (requests) beyond which balance overrides the cache


def place(prompt_lens: Sequence[int], matches: Sequence[Sequence[int]], loads: Sequence[int],
          capacities: Sequence[int], cfg: RouterConfig = RouterConfig()) -> list[int]:  # noqa: B008 (frozen)
    """The rank of each new request.

    prompt_lens[i]: tokens of request i; matches[r][i]: tokens of request i cached on rank r;
    loads[r]: requests rank r owns now; capacities[r]: most requests rank r takes.
    """
    loads = list(loads)
    ranks = range(len(loads))
    out = []
    for i, L in enumerate(prompt_lens):
        open_ranks = [r for r in ranks if loads[r] < capacities[r]] or list(ranks)
        if max(loads) - min(loads) >= cfg.balance_threshold:
            best = min(open_ranks, key=lambda r: (loads[r] / max(1, capacities[r]), r))
        else:
            best = min(open_ranks, key=lambda r: (_score(L, matches[r][i], loads[r], capacities[r], cfg), r))
        loads[best] += 1
        out.append(best)
    return out


def _score(L: int, match: int, load: int, capacity: int, cfg: RouterConfig) -> float:
    share = load / max(1, capacity)
    if cfg.load_only:
        return share
    return (L - match) + cfg.load_balance_weight * L * share
