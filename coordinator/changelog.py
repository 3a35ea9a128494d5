"""A bounded log of what changed, for readers that keep a mark and ask what changed since (issue 32).

A reader that derives something per name (a host's gauges, a GPU's idle judgment) keeps a mark and asks
``since(mark)`` for the names changed after it, instead of looking at every name of a fleet each time. The log holds
at most ``kept`` names: past that its older half goes, and a mark from before it is answered None, as is one from
before ``void()`` (a reset of what the names came from): then anything may have changed, and the reader looks at
everything. Pure; no I/O.
"""
from __future__ import annotations


class ChangeLog:
    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._names: list[str] = []   # the name of each change, oldest first
        self._start = 0               # the mark of ``_names[0]``

    def add(self, name: str) -> None:
        self._names.append(name)
        if len(self._names) > self.kept:
            cut = len(self._names) // 2
            del self._names[:cut]
            self._start += cut

    def since(self, mark: int) -> tuple[int, set[str] | None]:
        """The names changed since ``mark`` (a mark this returned before; -1 or 0 at first), and the mark to pass
        next time; None instead of the names when the log no longer reaches back to ``mark``."""
        end = self._start + len(self._names)
        if mark < self._start:
            return end, None
        return end, set(self._names[mark - self._start:])

    def void(self) -> None:
        """Every mark given so far is answered None from now on."""
        self._start += len(self._names) + 1
        self._names.clear()


__all__ = ["ChangeLog"]
