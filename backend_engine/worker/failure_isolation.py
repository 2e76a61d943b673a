"""Pinning a batched failure on the requests that cause it, so only they fail.

The engine does its work in batches: one forward pass for every scheduled request, one
sampling call for every row of logits. When a batch raises, the fault usually lies with one
request (a seed too wide for the generator, a ``top_k`` too large for a tensor, a failure in
one request's logprobs), not with the others. :func:`isolate_failures` then retries the
batch in halves, recursively, until each failure is pinned on an item that fails alone::

    [a b c d e f]  raises
    [a b c] ok      [d e f] raises
                    [d] ok   [e f] raises
                             [e] fails alone -> e's outcome is its exception
                             [f] ok

The first attempt is the whole batch, as fast as it ever was: the cost is paid only after
a failure (about ``2 log2(n)`` extra attempts for one bad item in ``n``). A failure that
recurs with every item alone fails them all: that is not one request's fault.

``attempt`` must be safe to repeat on a subset: the engine's attempts rewrite the same KV
slots and advance a request's random generator only once its token is chosen.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def isolate_failures(
    items: Sequence[T], attempt: Callable[[Sequence[T]], Sequence[R]]
) -> list[R | Exception]:
    """``attempt(items)``, one result per item; on an exception, the same on each half.

    Returns one outcome per item, in order: the item's result, or the exception its
    attempt raised with it alone.
    """
    try:
        results = attempt(items)
    except Exception as exc:
        if len(items) <= 1:
            traceback.clear_frames(exc.__traceback__)  # the failed attempt's tensors go now
            return [exc] * len(items)
        results = None
    if results is None:  # retried outside the except block: the failed attempt's frames
        middle = len(items) // 2  # (its activations) are freed before the halves run
        return isolate_failures(items[:middle], attempt) + isolate_failures(items[middle:], attempt)
    if len(results) != len(items):
        raise RuntimeError(f"an attempt on {len(items)} items gave {len(results)} results")
    return list(results)
