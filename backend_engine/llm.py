"""The offline API: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from backend_engine.config import EngineConfig, SchedulingMode
from backend_engine.llm_engine import LLMEngine
from backend_engine.outputs import RequestOutput, TokenLogprob
from backend_engine.sampling_params import SamplingParams


class LLM:
    """Load a checkpoint and generate for a list of prompts with continuous batching.

    >>> llm = LLM(model="ckpt_dir", device="cpu", dtype="float32")
    >>> [out.text for out in llm.generate(["Hello"], SamplingParams(temperature=0))]
    """

    def __init__(
        self,
        model: str,
        device: str = "cpu",
        dtype: str = "auto",
        block_size: int = 16,
        kv_cache_memory_bytes: int = 256 * 1024 * 1024,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        scheduling: SchedulingMode = "continuous",
        num_kv_blocks: int | None = None,
        seed: int = 0,
        show_progress: bool = False,
        num_threads: int | None = None,
    ) -> None:
        self.config = EngineConfig(
            model=str(model),
            device=device,
            dtype=dtype,
            block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            scheduling=scheduling,
            num_kv_blocks=num_kv_blocks,
            seed=seed,
            show_progress=show_progress,
            num_threads=num_threads,
        )
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
