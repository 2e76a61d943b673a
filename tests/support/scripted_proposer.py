"""Speculative decoding's proposer, scripted: test doubles for the pluggable ``Proposer``.

The n-gram proposer only proposes what the text already repeated, so its kept drafts are
never a token's first occurrence, and on a random model it is right or wrong as the text
happens to loop. These proposers choose instead: each request's known continuation (the
reference output of a run without speculation), with chosen drafts made wrong, so a test
can place kept runs and rejections where it needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from backend_engine.core.request import Request

# Which drafts to spoil: (output position the draft would take, its index among the drafts).
SpoilRule = Callable[[int, int], bool]


def never(position: int, index: int) -> bool:
    return False


class ScriptedProposer:
    """Proposes the next ``k`` tokens of each request's reference output (looked up by its
    prompt; requests with no reference get no drafts), the drafts ``spoil`` picks replaced
    by another token (so the target rejects them)."""

    name = "scripted"

    def __init__(
        self,
        references: Mapping[tuple[int, ...], Sequence[int]],
        vocab_size: int,
        spoil: SpoilRule = never,
    ) -> None:
        self.references = dict(references)
        self.vocab_size = vocab_size
        self.spoil = spoil
        self.forgotten: list[str] = []

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        reference = self.references.get(tuple(request.prompt_token_ids))
        if reference is None:
            return ()
        start = request.num_output_tokens
        drafts = list(reference[start : start + k])
        for index, token_id in enumerate(drafts):
            if self.spoil(start + index, index):
                drafts[index] = (token_id + 1) % self.vocab_size
        return tuple(drafts)

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)
