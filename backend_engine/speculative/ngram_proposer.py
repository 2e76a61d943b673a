"""Prompt lookup: draft tokens copied from what followed the same n-gram earlier in the sequence.

Answers that copy from their prompt (edits, rewrites, quotes, extraction, code changes) repeat
long runs of it; once the last few tokens match an earlier place, the tokens after that place
are a free guess at what comes next, with no model to run. Only the target decides what is
kept, so a wrong guess costs a little verification and nothing else.

A step must not scan the whole history (a 30,000-token prompt, every step, every sequence), so
each sequence keeps an index that is fed its tokens once, as they become final: the prompt,
then each accepted output token (never a draft). The index is a tree of contexts read
backwards from a position: the child of the root under token ``a`` stands for the 1-gram
``a``, its child under ``b`` for the 2-gram ``b a``, and so on to ``max_n``. Each node holds
where the text continued after that n-gram's most recent occurrence::

    tokens  x  a  b  c  a  b | end            the context tree: [where the text went on]
    pos     0  1  2  3  4  5                  root ─b─► [3] ─a─► [3] ─x─► [3]
                                              root ─a─► [5] ─c─► [5]
                                                           └─x─► [2]
                                              (and root ─c─► [4], root ─x─► [1], ...)

    With max_n = 3 the suffix "c a b" (read b, a, c) matches as far as "a b": k = 3
    proposes tokens[3:6] = c a b.

Appending the token at position ``L`` records the n-grams that end just before it (``tokens[L
- n : L]`` for ``n`` up to ``max_n``) as continuing at ``L``: one walk of ``max_n`` steps. The
sequence's own last n-gram is recorded only once a token follows it, so a lookup always finds
an *earlier* occurrence, never the suffix itself. A proposal walks the current suffix down the
tree (``max_n`` steps) and copies up to ``k`` tokens from the deepest match of at least
``min_n`` tokens (longer contexts predict better; the most recent occurrence is the one stored).

Rolling tokens back (a truncated output) undoes their appends in reverse order from a log of
what each append overwrote: ``max_n`` steps a token, never a rebuild.

Cost, measured on 30,000 tokens that never repeat (the worst case: every n-gram a new node)
with max_n = 4: about 4 us and under 1 KiB a token (SmolLM2-135M's float32 KV cache takes
45 KiB a token), 1 us a token to roll back, well under a microsecond a proposal. A long prompt
can be fed chunk by chunk, as it is prefilled, so that no one step pays for all of it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

# In the undo log: the node did not exist before this append (undoing removes it).
_CREATED = -1


class _ContextNode:
    """One n-gram read backwards from its end; ``continuation_start`` is where the text went
    on after its most recent recorded occurrence."""

    __slots__ = ("children", "continuation_start")

    def __init__(self, continuation_start: int) -> None:
        self.children: dict[int, _ContextNode] | None = None
        self.continuation_start = continuation_start


class NgramIndex:
    """One sequence's prompt-lookup index: fed its final tokens, asked for ``k`` drafts."""

    def __init__(self, min_n: int, max_n: int, token_ids: Iterable[int] = ()) -> None:
        if min_n < 1:
            raise ValueError(f"min_n must be at least 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n ({max_n}) must be at least min_n ({min_n})")
        self.min_n = min_n
        self.max_n = max_n
        self._token_ids: list[int] = []
        self._root = _ContextNode(continuation_start=0)
        # Per appended token, min(max_n, its position) entries: what each node on its path
        # held before (or _CREATED), shallowest first. Undone from the end by truncate().
        self._undo_log = array("q")
        self.extend(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    def append(self, token_id: int) -> None:
        """Add the sequence's next final token (a prompt token or an accepted output token)."""
        tokens = self._token_ids
        position = len(tokens)
        node = self._root
        for n in range(1, min(self.max_n, position) + 1):
            if node.children is None:
                node.children = {}
            key = tokens[position - n]
            child = node.children.get(key)
            if child is None:
                child = _ContextNode(continuation_start=position)
                node.children[key] = child
                self._undo_log.append(_CREATED)
            else:
                self._undo_log.append(child.continuation_start)
                child.continuation_start = position
            node = child
        tokens.append(token_id)

    def extend(self, token_ids: Iterable[int]) -> None:
        for token_id in token_ids:
            self.append(token_id)

    def truncate(self, num_tokens: int) -> None:
        """Roll the sequence back to its first ``num_tokens`` tokens, as if the later ones had
        never been appended."""
        if not 0 <= num_tokens <= len(self._token_ids):
            raise ValueError(
                f"cannot truncate {len(self._token_ids)} tokens to {num_tokens}: "
                f"num_tokens must be between 0 and {len(self._token_ids)}"
            )
        while len(self._token_ids) > num_tokens:
            self._undo_last_append()

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the
        sequence's last n tokens, for the largest n in ``[min_n, max_n]`` that has one; fewer
        when the sequence ends first, none when no such n-gram occurred before."""
        if k < 0:
            raise ValueError(f"k must be at least 0, got {k}")
        tokens = self._token_ids
        length = len(tokens)
        continuation_start: int | None = None
        node = self._root
        for n in range(1, min(self.max_n, length) + 1):
            if node.children is None:
                break
            child = node.children.get(tokens[length - n])
            if child is None:
                break
            node = child
            if n >= self.min_n:
                continuation_start = node.continuation_start
        if continuation_start is None or k == 0:
            return ()
        return tuple(tokens[continuation_start : continuation_start + k])

    def _undo_last_append(self) -> None:
        tokens = self._token_ids
        tokens.pop()
        position = len(tokens)  # the removed token's position: its append recorded this path
        depth = min(self.max_n, position)
        if depth == 0:
            return
        previous = self._undo_log[-depth:]
        del self._undo_log[-depth:]
        node = self._root
        for n, before in enumerate(previous, start=1):
            parent = node
            assert parent.children is not None  # the append walked this path
            key = tokens[position - n]
            node = parent.children[key]
            if before == _CREATED:
                # Everything deeper on this path was created by the same append.
                del parent.children[key]
                if not parent.children:
                    parent.children = None
                return
            node.continuation_start = before
