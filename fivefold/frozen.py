"""Frozen dataclasses that serve as cache keys, hashed once per object."""
from __future__ import annotations

import dataclasses


def hashed_once(cls: type) -> type:
    """`cls`, a frozen dataclass, with its hash computed at first use and kept on the object: the
    generated __hash__ hashes every field again at each dict lookup, and the planner's caches key on a
    few interned objects of these classes (the runtime's precision policy, the architecture traits,
    the sharding, the time assumptions: ~235,000 lookups in a 1024-GPU search). Equality is the
    dataclass's own; the kept hash stays out of pickles and copies (a str hashes differently in
    another process)."""
    names = tuple(f.name for f in dataclasses.fields(cls) if (f.compare if f.hash is None else f.hash))

    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash"]
        except KeyError:
            kept = self.__dict__["_hash"] = hash(tuple(getattr(self, name) for name in names))
            return kept

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    cls.__hash__ = __hash__
    cls.__getstate__ = __getstate__
    return cls
