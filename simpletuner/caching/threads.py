"""Thread helpers of the cache fills: work run ahead of its consumer, and a parallel map with a progress bar.

File reads, image decoding and blake2b release the GIL, so threads help on these CPU stages.
"""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from typing import Any, Callable, Generator, Iterable, Sequence

from tqdm import tqdm


def run_ahead(
    pool: Executor | None, fn: Callable[[Any], Any], args: Iterable[Any], depth: int
) -> Generator[Any, None, None]:
    """``fn(a)`` for each ``a`` in order, computed on ``pool`` up to ``depth`` ahead (inline when
    ``pool`` is None). Closing the generator cancels what has not started and waits for the rest."""
    if pool is None:
        for arg in args:
            yield fn(arg)
        return
    todo = iter(args)
    ahead: deque = deque(pool.submit(fn, arg) for arg in itertools.islice(todo, max(1, depth)))
    try:
        while ahead:
            future = ahead.popleft()
            for arg in itertools.islice(todo, 1):
                ahead.append(pool.submit(fn, arg))
            yield future.result()
    finally:
        for future in ahead:
            future.cancel()
        wait(list(ahead))


def run_ahead_on_threads(
    fn: Callable[[Any], Any], args: Iterable[Any], workers: int, pool: Executor | None = None
) -> Generator[Any, None, None]:
    """:func:`run_ahead` on ``pool`` (left running for its owner), else on ``workers`` threads started
    for this run and shut down when it ends, up to ``2 * workers`` ahead; inline when ``workers < 1``."""
    if workers < 1:
        yield from run_ahead(None, fn, args, 0)
        return
    if pool is not None:
        yield from run_ahead(pool, fn, args, 2 * workers)
        return
    own = ThreadPoolExecutor(workers, thread_name_prefix="cache-prepare")
    try:
        yield from run_ahead(own, fn, args, 2 * workers)
    finally:
        own.shutdown(wait=True, cancel_futures=True)


def map_threads(
    fn: Callable[[Any], Any], items: Sequence[Any], workers: int, pool: Executor | None, desc: str
) -> list[Any]:
    """``[fn(item) for item in items]`` on ``pool``, else on ``workers`` threads (file reads and
    blake2b release the GIL), else inline; with a progress bar on a terminal."""
    progress = tqdm(total=len(items), desc=desc, unit="file", disable=None)
    try:
        if pool is None and workers < 1:
            out = []
            for item in items:
                out.append(fn(item))
                progress.update(1)
            return out
        own = pool is None
        executor = pool if pool is not None else ThreadPoolExecutor(workers, thread_name_prefix="cache-hash")
        try:
            out = []
            for result in executor.map(fn, items):
                out.append(result)
                progress.update(1)
            return out
        finally:
            if own:
                executor.shutdown(wait=True, cancel_futures=True)
    finally:
        progress.close()
