"""Streaming token ids → text, one token at a time, without breaking UTF-8 characters."""

from __future__ import annotations

from collections.abc import Sequence

from model_files.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Tokens of context decoded before the unread ones, so that decoders that depend on the
# previous token (a leading-space rule, a byte split over tokens) see it.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas.

    Two offsets into ``token_ids`` (prompt + output) bound the decode window::

        token_ids:  ... | prefix_offset ... read_offset | new tokens ...
                          \\__ already emitted __/        \\_ not yet _/

    Each step decodes ``token_ids[prefix_offset:read_offset]`` (cached) and
    ``token_ids[prefix_offset:]``; the text past the first one is the candidate delta. A
    byte-level BPE token may carry part of a multi-byte character, which decodes to U+FFFD:
    such a candidate is held back until a later token completes it. Once a delta is emitted the
    window slides forward, so each step decodes a few tokens rather than the whole sequence.

    Invariant: the emitted deltas plus :meth:`flush` equal
    ``tokenizer.decode(output_token_ids, skip_special_tokens)``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids)
        self._num_prompt_tokens = len(self._token_ids)
        self._read_offset = len(self._token_ids)
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._chunks: list[str] = []

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(
            self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_prompt_tokens :]

    @property
    def text(self) -> str:
        """All output text emitted so far (held-back bytes excluded)."""
        return "".join(self._chunks)

    def add(self, token_id: int) -> str:
        """Append one generated token and return the text it completes (possibly "")."""
        self._token_ids.append(token_id)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._advance(new_text)

    def flush(self) -> str:
        """Release held-back text (at the end of a request); incomplete bytes become U+FFFD."""
        if self._read_offset == len(self._token_ids):
            return ""
        return self._advance(self._decode(self._prefix_offset))

    def _advance(self, new_text: str) -> str:
        """Emit what ``new_text`` adds past the prefix window, then slide the window."""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._chunks.append(delta)
        return delta
