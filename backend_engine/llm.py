"""The offline API: ``LLM(...).generate(prompts, sampling_params)`` and ``LLM(...).chat(...)``."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypedDict

from backend_engine.config import EngineConfig, SchedulingMode
from backend_engine.llm_engine import LLMEngine
from backend_engine.outputs import RequestOutput, TokenLogprob
from backend_engine.sampling_params import SamplingParams
from backend_engine.structured_output.tool_grammar import tool_call_constraint
from backend_engine.text.tool_call_parser import ParsedToolCall, parse_tool_calls

if TYPE_CHECKING:
    from typing_extensions import Unpack


class EngineOptions(TypedDict, total=False):
    """:class:`EngineConfig`'s fields other than ``model``, as :class:`LLM`'s keyword
    arguments: names and types only; every default is EngineConfig's."""

    device: str
    dtype: str
    quantization: str | None
    quantization_group_size: int
    quantization_calibration: str
    dequantize: bool
    kv_cache_dtype: str
    decode_run_steps: int
    decode_run_max_ms: float
    block_size: int
    kv_cache_memory_bytes: int
    num_kv_blocks: int | None
    enable_prefix_caching: bool
    max_num_batched_tokens: int | None
    max_num_seqs: int
    max_running_share: float
    max_model_len: int | None
    scheduling: SchedulingMode
    watermark: float
    seed: int
    num_threads: int | None
    show_progress: bool
    grammar_cache_size: int
    grammar_compile_timeout_s: float
    speculative_proposer: str | None
    speculative_draft_model: str | None
    num_speculative_tokens: int
    speculative_ngram_min: int
    speculative_ngram_max: int
    speculative_crossover_batch_size: int
    speculative_draft_cost: float | None
    drain_grace_s: float  # a server's setting: an LLM has no drain


class LLM:
    """Load a checkpoint and generate for a list of prompts with continuous batching.

    >>> llm = LLM(model="ckpt_dir", device="cpu", dtype="float32")
    >>> [out.text for out in llm.generate(["Hello"], SamplingParams(temperature=0))]

    Structured outputs take the server's constraints, without a server::

        person = OutputConstraint.json_schema(schema, "response_format")
        llm.generate(["..."], SamplingParams(structured_output=person))
        llm.chat([{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                 tool_choice="required")[0].tool_calls
    """

    def __init__(self, model: str, **options: Unpack[EngineOptions]) -> None:
        """``options``: any :class:`EngineConfig` field, with EngineConfig's defaults, except
        that progress bars are off unless ``show_progress=True`` (a library call, not a
        command line)."""
        options.setdefault("show_progress", False)
        self.config = EngineConfig(model=str(model), **options)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        One output per prompt; a prompt whose params have ``n`` > 1 gives ``n`` outputs in a
        row instead, one per choice (``index`` 0 to n - 1, the same ``request_id``), its prompt
        prefilled once."""
        prompt_list: list[str | list[int]] = (
            [prompts]
            if isinstance(prompts, str)
            else [p if isinstance(p, str) else list(p) for p in prompts]
        )
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        engine = self.engine
        # Validate every prompt before queueing any, so a bad one leaves nothing behind.
        requests = [
            engine.make_request(f"offline-{next(self._ids)}", prompt, params)
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        order: list[tuple[str, int]] = []  # (request id, choice index)
        prompt_ids: dict[str, list[int]] = {}
        wants_logprobs: dict[str, bool] = {}
        for request, params in zip(requests, params_list, strict=True):
            engine.add(request)
            rid = request.request_id
            order.extend((rid, index) for index in range(params.n))
            prompt_ids[rid] = request.prompt_token_ids
            wants_logprobs[rid] = params.logprobs is not None
        texts: dict[tuple[str, int], list[str]] = {key: [] for key in order}
        tokens: dict[tuple[str, int], list[int]] = {key: [] for key in order}
        logprobs: dict[tuple[str, int], list[TokenLogprob]] = {key: [] for key in order}
        prompt_logprobs: dict[tuple[str, int], list[TokenLogprob | None]] = {}
        results: dict[tuple[str, int], RequestOutput] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                rid, key = delta.request_id, (delta.request_id, delta.index)
                texts[key].append(delta.new_text)
                tokens[key].extend(delta.new_token_ids)
                logprobs[key].extend(delta.new_logprobs)
                if delta.prompt_logprobs is not None:
                    prompt_logprobs[key] = delta.prompt_logprobs
                if delta.finished:
                    results[key] = RequestOutput(
                        request_id=rid,
                        prompt_token_ids=prompt_ids[rid],
                        token_ids=tokens[key],
                        text="".join(texts[key]),
                        finish_reason=delta.finish_reason,
                        num_cached_tokens=delta.num_cached_tokens,
                        logprobs=logprobs[key] if wants_logprobs[rid] else None,
                        error=delta.error,
                        index=delta.index,
                        prompt_logprobs=prompt_logprobs.get(key),
                    )
        return [results[key] for key in order]

    def chat(
        self,
        conversations: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[ChatOutput]:
        """Answer one conversation (a list of OpenAI-shaped messages) or several, as the
        server's /v1/chat/completions does: the chat template renders the messages and
        ``tools``; ``tool_choice`` (OpenAI's values; ``"auto"`` when tools are given) constrains
        the answer to tool calls, which come back parsed. A ``structured_output`` in the
        sampling params constrains it instead (not both)."""
        batch = _conversations(conversations)
        choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
        tool_constraint = (
            tool_call_constraint(tools, choice, parallel_tool_calls) if tools else None
        )
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(batch)
        else:
            params_list = list(sampling_params)
        if tool_constraint is not None:
            if any(p.structured_output is not None for p in params_list):
                raise ValueError("give either tools (with a tool_choice) or a structured_output")
            params_list = [replace(p, structured_output=tool_constraint) for p in params_list]
        prompts = [self.tokenizer.encode_chat(messages, tools=tools) for messages in batch]
        outputs = self.generate(prompts, params_list)
        reads_calls = tool_constraint is not None
        return [_chat_output(out, reads_calls) for out in outputs]


@dataclass(frozen=True)
class ChatOutput:
    """A conversation's answer: the engine's output, and the message it makes (``content``
    None when the answer is only tool calls; ``finish_reason`` "tool_calls" when it made
    calls and ended on its own)."""

    output: RequestOutput
    content: str | None
    tool_calls: tuple[ParsedToolCall, ...]
    finish_reason: str | None


def _conversations(
    conversations: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
) -> list[list[dict[str, Any]]]:
    """One conversation (messages) or several, as a list of conversations."""
    if conversations and isinstance(conversations[0], Mapping):
        return [[dict(m) for m in conversations if isinstance(m, Mapping)]]
    return [[dict(m) for m in c] for c in conversations if not isinstance(c, Mapping)]


def _chat_output(output: RequestOutput, reads_calls: bool) -> ChatOutput:
    if not reads_calls:
        return ChatOutput(output, output.text, (), output.finish_reason)
    answer = parse_tool_calls(output.text)
    made_calls = bool(answer.tool_calls) and output.finish_reason == "stop"
    finish_reason = "tool_calls" if made_calls else output.finish_reason
    return ChatOutput(output, answer.content, answer.tool_calls, finish_reason)


__all__ = ["LLM", "ChatOutput"]
