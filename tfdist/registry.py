"""A tiny name -> implementation registry with lazy imports.

Entries are "package.module" or "package.module:Attribute" strings, imported
only when asked for: `--strategy=mirrored` never imports Horovod, and a
missing optional engine fails only when chosen. An unknown name is a
`UsageError` that lists the valid ones.
"""

from __future__ import annotations

import importlib

from tfdist.errors import UsageError


class Registry:
    def __init__(self, flag: str, kind: str, entries: dict[str, str]):
        self.flag, self.kind, self._entries = flag, kind, dict(entries)

    def register(self, name: str, entry) -> None:
        """Add `name`: a "package.module[:Attribute]" string (imported when
        chosen) or the object itself (e.g. an adapter class defined in a
        user's own module). Refuses to replace an existing entry."""
        if name in self._entries:
            raise UsageError(f"{self.flag}={name!r} is already registered "
                             f"({self._entries[name]})")
        self._entries[name] = entry

    def unregister(self, name: str) -> None:
        """Remove `name` (e.g. an engine a test registered for itself)."""
        self.check(name)
        del self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def order(self) -> list[str]:
        """The names in the order they were registered."""
        return list(self._entries)

    def entry(self, name: str):
        """What is registered as `name`, as registered (not imported)."""
        self.check(name)
        return self._entries[name]

    def check(self, name: str) -> None:
        if name not in self._entries:
            raise UsageError(f"{self.flag}={name!r} is not a registered {self.kind}; "
                             f"valid: {', '.join(self.names())}")

    def load(self, name: str):
        """The module (or the attribute of it) registered as `name`."""
        self.check(name)
        entry = self._entries[name]
        if not isinstance(entry, str):
            return entry
        module_name, _, attribute = entry.partition(":")
        module = importlib.import_module(module_name)
        return getattr(module, attribute) if attribute else module
