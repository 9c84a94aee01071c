"""Which backend gets the next request. Pure functions of what the router knows (healthy backends, their
outstanding tokens, how many leading prompt blocks each one caches), so they test without I/O.

Prefix-aware follows SGLang's router: a cache hit saves prefill only if the backend is not already
swamped, so the cache match decides only while the system is balanced; otherwise the least loaded wins."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence


class Policy(Protocol):
    name: str
    uses_cache: bool

    def choose(self, backends: Sequence[str], load: Mapping[str, int],
               matched: Mapping[str, int] | None = None) -> str:
        """One of `backends` (non-empty). load: outstanding tokens; matched: leading prompt blocks cached."""
        ...


def least_loaded(backends: Sequence[str], load: Mapping[str, int], turn: int = 0) -> str:
    """Fewest outstanding tokens; ties take turns (`turn`), so idle backends share the work."""
    lowest = min(load.get(b, 0) for b in backends)
    ties = [b for b in backends if load.get(b, 0) == lowest]
    return ties[turn % len(ties)]


@dataclass
class RoundRobin:
    name: str = "round-robin"
    uses_cache: bool = False
    _next: int = 0

    def choose(self, backends: Sequence[str], load: Mapping[str, int],
               matched: Mapping[str, int] | None = None) -> str:
        b = backends[self._next % len(backends)]
        self._next += 1
        return b


@dataclass
class LeastLoad:
    name: str = "least-load"
    uses_cache: bool = False
    _turn: int = 0

    def choose(self, backends: Sequence[str], load: Mapping[str, int],
               matched: Mapping[str, int] | None = None) -> str:
        self._turn += 1
        return least_loaded(backends, load, self._turn - 1)


@dataclass
class PrefixAware:
    """Longest cached prefix, unless its backend's load exceeds the least loaded one's by both
    `balance_abs` tokens and a factor `balance_rel` (then: least-load). No match anywhere: least-load."""
    balance_abs: int = 2048
    balance_rel: float = 1.5
    name: str = "prefix-aware"
    uses_cache: bool = True
    _turn: int = 0

    def choose(self, backends: Sequence[str], load: Mapping[str, int],
               matched: Mapping[str, int] | None = None) -> str:
        self._turn += 1
        lightest = least_loaded(backends, load, self._turn - 1)
        matched = matched or {}
        best = max((matched.get(b, 0) for b in backends), default=0)
        if best == 0:
            return lightest
        holders = [b for b in backends if matched.get(b, 0) == best]
        chosen = least_loaded(holders, load, self._turn - 1)
        if self.overloaded(load.get(chosen, 0), load.get(lightest, 0)):
            return lightest
        return chosen

    def overloaded(self, chosen_load: int, min_load: int) -> bool:
        return chosen_load - min_load > self.balance_abs and chosen_load > self.balance_rel * min_load


POLICIES = {"round-robin": RoundRobin, "least-load": LeastLoad, "prefix-aware": PrefixAware}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}") from None
