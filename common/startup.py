"""A process's start-up without the cyclic garbage collector.

Importing torch and transformers and loading a model creates hundreds of thousands of objects that live as
long as the process, and the collector walks all of them again on each full pass it makes while they load:
a quarter of the imports' CPU time (`python -c "import trainer.trainer"` on 2 cores: 2.3 CPU-s, 1.7 with the
collector off; the test suite's collection in one pytest process: 11.1 s, 7.7 s). `gc_paused()` turns the
collector off for a block (an entry point's imports) and back on after it, `without_gc` for a function (an
actor's constructor); nothing is lost: what became garbage in the block is collected by the collector's
next passes."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off inside the block; nested blocks leave it to the outermost,
    and a collector turned off before the block stays off."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def without_gc(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` runs inside `gc_paused()` (a plain function wrapper: Ray pickles an actor's methods, and a
    context manager's generator does not pickle)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with gc_paused():
            return fn(*args, **kwargs)

    return run
