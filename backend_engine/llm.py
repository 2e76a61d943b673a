"""The offline API: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

from backend_engine.config import EngineConfig, SchedulingMode
from backend_engine.llm_engine import LLMEngine
from backend_engine.outputs import RequestOutput, TokenLogprob
from backend_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import Unpack


class EngineOptions(TypedDict, total=False):
    """:class:`EngineConfig`'s fields other than ``model``, as :class:`LLM`'s keyword
    arguments: names and types only; every default is EngineConfig's."""

    device: str
    dtype: str
    block_size: int
    kv_cache_memory_bytes: int
    num_kv_blocks: int | None
    enable_prefix_caching: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int | None
    scheduling: SchedulingMode
    watermark: float
    seed: int
    num_threads: int | None
    show_progress: bool
    drain_grace_s: float  # a server's setting: an LLM has no drain


class LLM:
    """Load a checkpoint and generate for a list of prompts with continuous batching.

    >>> llm = LLM(model="ckpt_dir", device="cpu", dtype="float32")
    >>> [out.text for out in llm.generate(["Hello"], SamplingParams(temperature=0))]
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
        """Run every prompt to completion; outputs come back in prompt order."""
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
        order: list[str] = []
        # Validate every prompt before queueing any, so a bad one leaves nothing behind.
        requests = [
            engine.make_request(f"offline-{next(self._ids)}", prompt, params)
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        for request in requests:
            engine.add(request)
            order.append(request.request_id)
        texts: dict[str, list[str]] = {rid: [] for rid in order}
        tokens: dict[str, list[int]] = {rid: [] for rid in order}
        logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid in order}
        results: dict[str, RequestOutput] = {}
        wants_logprobs = {
            rid: p.logprobs is not None for rid, p in zip(order, params_list, strict=True)
        }
        prompt_ids = {rid: engine.scheduler.requests[rid].prompt_token_ids for rid in order}
        while engine.has_unfinished():
            for delta in engine.step():
                rid = delta.request_id
                texts[rid].append(delta.new_text)
                tokens[rid].extend(delta.new_token_ids)
                logprobs[rid].extend(delta.new_logprobs)
                if delta.finished:
                    results[rid] = RequestOutput(
                        request_id=rid,
                        prompt_token_ids=prompt_ids[rid],
                        token_ids=tokens[rid],
                        text="".join(texts[rid]),
                        finish_reason=delta.finish_reason,
                        num_cached_tokens=delta.num_cached_tokens,
                        logprobs=logprobs[rid] if wants_logprobs[rid] else None,
                        error=delta.error,
                    )
        return [results[rid] for rid in order]


__all__ = ["LLM"]
