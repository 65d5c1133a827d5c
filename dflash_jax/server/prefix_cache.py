"""Snapshots of decode states across requests and conversations, keyed by the token ids they hold, the least recently
used dropped first to keep their device bytes within a budget (docs/server.md, "Prefix cache")."""

from __future__ import annotations

import collections
from typing import Sequence

from dflash_jax.engine.state import Snapshot


class PrefixCache:
    """Device-resident snapshots by the token ids they cover. A prompt continues from the longest snapshot whose ids
    are a prefix of it, never from inside one: the recurrent state cannot be rewound. A budget of 0 keeps nothing."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache's budget must be at least 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        # by the ids they hold, the least recently used first
        self._entries: collections.OrderedDict[tuple[int, ...], Snapshot] = collections.OrderedDict()
        self.nbytes = 0  # the snapshots' device bytes, always within the budget

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ids: Sequence[int]) -> bool:
        return tuple(ids) in self._entries

    def keys(self) -> list[tuple[int, ...]]:
        """The ids of every snapshot, least recently used first."""
        return list(self._entries)

    def add(self, ids: Sequence[int], snapshot: Snapshot) -> bool:
        """Keep a snapshot of the state after `ids` (replacing one of the same ids) as the most recently used,
        dropping the least recently used until it fits; one larger than the whole budget is not kept (False)."""
        key = tuple(ids)
        if len(key) != snapshot.length:
            raise ValueError(f"a snapshot of {snapshot.length} tokens filed under {len(key)} ids")
        size = snapshot.nbytes
        if size > self.budget:
            return False
        self._drop(key)
        while self.nbytes + size > self.budget:
            self._drop(next(iter(self._entries)))
        self._entries[key] = snapshot
        self.nbytes += size
        return True

    def lookup(self, ids: Sequence[int], longer_than: int = 0) -> Snapshot | None:
        """The longest snapshot of more than `longer_than` ids that are a prefix of `ids` and fewer (the last prompt
        id must run to give the next token's logits), now the most recently used; None if there is none."""
        ids, best = tuple(ids), None
        for key in self._entries:
            if longer_than < len(key) < len(ids) and (best is None or len(key) > len(best)) and ids[:len(key)] == key:
                best = key
        if best is None:
            return None
        self._entries.move_to_end(best)
        return self._entries[best]

    def _drop(self, key: tuple[int, ...]) -> None:
        snapshot = self._entries.pop(key, None)
        if snapshot is not None:
            self.nbytes -= snapshot.nbytes
