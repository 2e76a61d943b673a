"""One request's place in its grammar: which tokens may come next, and what came so far.

A `GrammarMatcher` is made per request from its compiled grammar (a copy of the grammar's
start state) and lives on the engine's `Request`, so it survives preemption: a recomputed
request has the same output tokens, and the matcher has accepted exactly those. The model
runner asks it for the next token's mask, then tells it the token that was sampled.
"""

from __future__ import annotations

import llguidance


class GrammarViolation(RuntimeError):
    """The matcher cannot go on: a token outside its mask, or a grammar limit reached."""


class GrammarMatcher:
    """Wraps an ``llguidance.LLMatcher``; every method raises `GrammarViolation` on an error
    state instead of returning it, so a failure is pinned on this matcher's request."""

    __slots__ = ("_matcher", "mask_bytes")

    def __init__(self, matcher: llguidance.LLMatcher, mask_bytes: int) -> None:
        self._matcher = matcher
        self.mask_bytes = mask_bytes  # one bit per token of the model's vocabulary, in int32s

    def fill_mask(self, address: int) -> None:
        """Write the next token's allowed set, one bit per token, at ``address``
        (``mask_bytes`` bytes: a contiguous int32 row). Drops the GIL while it works."""
        self._check()
        self._matcher.unsafe_compute_mask_ptr(address, self.mask_bytes)
        self._check()

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token."""
        if not self._matcher.consume_token(token_id):
            raise GrammarViolation(
                f"token {token_id} does not continue the grammar: {self._matcher.get_error()}"
            )

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` the grammar would accept in turn; the state is
        unchanged (speculative decoding's drafts past this are rejected unscored)."""
        self._check()
        return int(self._matcher.validate_tokens(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepts: drafts masked for, then not kept."""
        if num_tokens and not self._matcher.rollback(num_tokens):
            error = self._matcher.get_error()
            raise GrammarViolation(f"cannot roll back {num_tokens} tokens: {error}")

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and took its end-of-sequence token: nothing may follow."""
        return bool(self._matcher.is_stopped())

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarViolation(f"the output grammar failed: {self._matcher.get_error()}")
