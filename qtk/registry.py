"""One way to keep things registered by name: the number formats, the recipe steps' declarations and
implementations, the step records, the writers and the readers. A registry is a dict filled by a decorator in a plain
import (STYLE.md 3); it refuses a second registration under a name, and a failed lookup lists what is registered."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


class Registry(dict):
    """name -> what is registered under it, in registration order. `what` names the kind in messages."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def add(self, name: str, item: T) -> T:
        """Register `item` under `name`; a name registered already is an error (unregister it first)."""
        if name in self:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self[name] = item
        return item

    def decorator(self, name_of: Callable[[T], str], make: Callable[[T], object] | None = None) -> Callable[[T], T]:
        """A class (or function) decorator registering make(obj) (default obj) under name_of(obj); returns obj."""
        def register(obj: T) -> T:
            self.add(name_of(obj), obj if make is None else make(obj))
            return obj

        return register

    def remove(self, name: str) -> None:
        """Unregister `name` (for tests that register things of their own); a name not registered is no error."""
        self.pop(name, None)

    def lookup(self, name: str):
        """What is registered under `name`, or a ValueError listing what is."""
        if name not in self:
            raise ValueError(f"no {self.what} {name!r} (registered: {', '.join(self) or 'none'})")
        return self[name]
