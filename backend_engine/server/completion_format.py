"""OpenAI's text completion shape, whole and as stream chunks (the interface of
`openai_format.ChatFormatter`).

Logprobs have the legacy shape: parallel lists of ``tokens``, ``token_logprobs``,
``top_logprobs`` ({token: logprob} maps) and ``text_offset``, each choice's offsets counting
from 0 over its own tokens. With ``echo`` a choice's text starts with its prompt's (streamed:
in the choice's first chunk), and with ``logprobs`` too, the prompt's tokens come first in
its logprobs, from the engine's prompt logprobs: the first token has nothing before it, so
its ``token_logprobs`` and ``top_logprobs`` entries are null, as OpenAI's are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backend_engine.outputs import RequestOutputDelta, TokenLogprob
from backend_engine.server.choice_streams import ChoiceDelta
from backend_engine.server.engine_prompts import EnginePrompt
from backend_engine.server.openai_format import JSON, ResponseIdentity, by_choice, joined
from backend_engine.server.token_text import TokenText

# A token to report: its id and its logprob (None: a prompt's first, or unknown).
_Entry = tuple[int, TokenLogprob | None]


class CompletionFormatter:
    object_whole = "text_completion"
    object_chunk = "text_completion"

    def __init__(
        self,
        ident: ResponseIdentity,
        token_text: TokenText,
        want_logprobs: bool,
        prompts: Sequence[EnginePrompt] = (),
        *,
        echo: bool = False,
    ) -> None:
        """``prompts``: the request's, by prompt index (what ``echo`` repeats)."""
        self.ident = ident
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.prompts = prompts
        self.echo = echo
        self._text_offsets: dict[int, int] = {}  # each choice's next text_offset
        # Streamed: the prompt logprobs each prompt's choices have shown so far.
        self._prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}

    def _logprobs(self, index: int, entries: list[_Entry]) -> JSON | None:
        if not self.want_logprobs:
            return None
        offset = self._text_offsets.get(index, 0)
        tokens, offsets = [], []
        for token_id, _ in entries:
            token = self.token_text(token_id)[0]
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob if lp else None for _, lp in entries],
            "top_logprobs": [
                {self.token_text(t)[0]: p for t, p in lp.top} if lp else None for _, lp in entries
            ],
            "text_offset": offsets,
        }

    def _prompt_entries(
        self, prompt_index: int, prompt_logprobs: list[TokenLogprob | None] | None
    ) -> list[_Entry]:
        """The prompt's tokens, each with its logprob (given the tokens before it)."""
        if prompt_logprobs is not None:
            self._prompt_logprobs[prompt_index] = prompt_logprobs
        logprobs = self._prompt_logprobs.get(prompt_index, [])
        token_ids = self.prompts[prompt_index].token_ids
        return [(t, logprobs[n] if n < len(logprobs) else None) for n, t in enumerate(token_ids)]

    def _choice(
        self, index: int, text: str, logprobs: JSON | None, finish_reason: str | None
    ) -> JSON:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def whole(self, choices: list[ChoiceDelta], usage: JSON) -> JSON:
        prompt_of = {c.index: c.prompt_index for c in choices}
        answers = [
            self._whole_choice(index, prompt_of[index], deltas)
            for index, deltas in by_choice(choices).items()
        ]
        return {**self.ident.envelope(self.object_whole, answers), "usage": usage}

    def _whole_choice(
        self, index: int, prompt_index: int, deltas: list[RequestOutputDelta]
    ) -> JSON:
        text, logprobs = joined(deltas)
        entries: list[_Entry] = [(lp.token_id, lp) for lp in logprobs]
        if self.echo:
            text = self.prompts[prompt_index].text + text
            if self.want_logprobs:
                given = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None)
                entries = self._prompt_entries(prompt_index, given) + entries
        return self._choice(index, text, self._logprobs(index, entries), deltas[-1].finish_reason)

    def opening_chunks(self) -> list[JSON]:
        return []

    def chunks(self, choice: ChoiceDelta) -> list[JSON]:
        delta, index = choice.delta, choice.index
        text = delta.new_text
        entries: list[_Entry] = [(lp.token_id, lp) for lp in delta.new_logprobs]
        is_first = index not in self._text_offsets
        self._text_offsets.setdefault(index, 0)
        if self.echo and is_first:
            text = self.prompts[choice.prompt_index].text + text
            if self.want_logprobs:
                prompt = self._prompt_entries(choice.prompt_index, delta.prompt_logprobs)
                entries = prompt + entries
        if not (text or entries or delta.finished):
            return []
        finish_reason: Any = delta.finish_reason
        return [
            self.ident.envelope(
                self.object_chunk,
                [self._choice(index, text, self._logprobs(index, entries), finish_reason)],
            )
        ]

    def usage_chunk(self, usage: JSON) -> JSON:
        return {**self.ident.envelope(self.object_chunk, []), "usage": usage}
