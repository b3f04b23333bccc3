"""Each adapter's requests on servers that other clients reach too (gateways route to the
servers' own ports): the agent's own streams, completed by what each server's metrics say.

A server's metrics count all its running and waiting requests, and name the adapters among
them, but count none per adapter. So, per server and state, the requests the agent's own
streams do not explain are estimated: each named adapter has at least one, and the rest are
shared evenly among the named adapters (the base model's when none is named). Exact when every
request is the agent's, or when the others all use one adapter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping


def adapter_counts(own: Mapping[str | None, int], total: int, named: Iterable[str]) -> Counter[str | None]:
    """One server's requests in one state per adapter (None: the base model): `own` (the agent's
    streams), `total` (the server's count, every client's) and `named` (the adapters its metrics
    name in that state)."""
    counts: Counter[str | None] = Counter({adapter: count for adapter, count in own.items() if count > 0})
    others = total - sum(counts.values())
    adapters = sorted(set(named))
    for adapter in adapters:
        if others > 0 and counts[adapter] == 0:  # named: at least one request of it runs
            counts[adapter] = 1
            others -= 1
    if others <= 0:
        return counts
    if not adapters:
        counts[None] += others
        return counts
    share, rest = divmod(others, len(adapters))
    for index, adapter in enumerate(adapters):
        counts[adapter] += share + (1 if index < rest else 0)
    return counts
