"""How long a package's first import takes, wherever in a command it happens.

The CLI reports what a command spent importing torch apart from the work it timed: a conversion that reads
and casts without torch imports it only where it needs it after all (a cast numpy cannot make exactly, a file
the torch-free reader leaves to torch), that is, inside the conversion's timed seconds. A finder placed first
on ``sys.meta_path`` times the package's execution (all of its own imports with it) where it really runs: it
wraps the ``exec_module`` of the loader Python found for it, a loader of that one file (a ``FileLoader``:
packages installed as files), and unwraps it after that one call (or at the end of the `timing_import` block);
a package loaded otherwise (built in, from a zip archive, whose loaders serve other modules too) is not timed.
Nothing is timed if the package was already imported.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import time
from collections.abc import Iterator
from types import ModuleType


# loaders made for one file each (``importlib``'s `FileLoader`s), not shared with other modules
_FILE_LOADERS = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader,
                 importlib.machinery.ExtensionFileLoader)


class ImportClock(importlib.abc.MetaPathFinder):
    """The seconds spent executing ``name``'s first import while the clock is on ``sys.meta_path``
    (`timing_import`). ``seconds`` is 0.0 when the package was not imported in that time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seconds = 0.0
        self._looking = False
        self._wrapped: list[importlib.abc.Loader] = []

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or self._looking:
            return None
        self._looking = True  # the finders after this one give the real spec
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._looking = False
        loader = spec.loader if spec is not None else None
        if not isinstance(loader, _FILE_LOADERS):
            return spec
        run = loader.exec_module

        def timed(module: ModuleType) -> None:
            self.unwrap()  # one call: a reload runs the loader's own method
            started = time.perf_counter()
            try:
                run(module)
            finally:
                self.seconds += time.perf_counter() - started

        loader.exec_module = timed  # type: ignore[method-assign]  # on this file's own loader only
        self._wrapped.append(loader)
        return spec

    def unwrap(self) -> None:
        """Give the loaders wrapped so far their own ``exec_module`` back."""
        while self._wrapped:
            vars(self._wrapped.pop()).pop("exec_module", None)


@contextlib.contextmanager
def timing_import(name: str) -> Iterator[ImportClock]:
    """Time ``name``'s first import if it happens inside the block: ``with timing_import("torch") as clock:``
    then ``clock.seconds``."""
    clock = ImportClock(name)
    if name not in sys.modules:
        sys.meta_path.insert(0, clock)
    try:
        yield clock
    finally:
        if clock in sys.meta_path:
            sys.meta_path.remove(clock)
        clock.unwrap()
