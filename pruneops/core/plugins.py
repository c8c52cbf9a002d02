"""A small name -> object registry for everything pluggable (models, methods, quantizers...)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from pruneops.core.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered object and the one-line summary shown by listings."""

    name: str
    obj: T
    summary: str


class Registry(Generic[T]):
    """Maps names to objects; unknown names raise a `ConfigError` listing the known ones.

    Args:
        kind: What the registry holds, used in messages ("model", "pruning method").
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, summary: str = "") -> Callable[[T], T]:
        """Decorator that registers `obj` under `name`."""

        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
            self._entries[name] = Entry(name, obj, summary or (doc[0] if doc else ""))
            return obj

        return decorator

    def get(self, name: str) -> T:
        """Returns the object registered as `name`."""
        try:
            return self._entries[name].obj
        except KeyError:
            raise ConfigError(f"unknown {self.kind} {name!r}; choose from: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(sorted(self._entries.values(), key=lambda e: e.name))
