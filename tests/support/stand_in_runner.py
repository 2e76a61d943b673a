"""A stand-in for the model inside a real engine, for environments without torch.

`LLMEngine`, `AsyncEngine` and the engine's HTTP server run as they are (tokenizing,
validation, scheduling, the KV blocks, stop rules, detokenizing, usage, metrics, errors);
only the tokens come from here instead of a forward pass:

    AsyncEngine(EngineConfig(model=str(demo_model_files())), plan_runner=plan_stand_in_runner())

Each sampled token is the next word of a fixed text, chosen by its position: never an end of
sequence or a special token, so every request runs to its ``max_tokens`` (as with
``ignore_eos``). Sampling parameters change nothing. A step takes ``step_s`` seconds, about
what the tiny demo model takes on a CPU, so a stream lasts as long as a real one would and a
client can leave in the middle of it. Asked for logprobs, it reports its own distribution:
half the mass on its token, the other half spread evenly over the vocabulary; so are prompt
logprobs (``prompt_logprobs``), prompt token ``j`` scored as if sampled at position ``j``.
The choices of an ``n`` > 1 request get the same token as their leader at the step that forks
them (the same position); it holds no KV, so the scheduler's block copies have nothing to copy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from backend_engine.config import EngineConfig
from backend_engine.core.scheduler import ScheduledRequest, SchedulerOutput
from backend_engine.core.step_runner import PlanRunner, RunnerOutput, SampledToken
from backend_engine.outputs import TokenLogprob
from backend_engine.sampling_params import SamplingParams
from model_files.checkpoint import Checkpoint
from model_files.model_config import ModelConfig

TEXT = " the cat sat on the mat and looked at the moon for a while"
STEP_S = 0.002
_FLOAT32_BYTES = 4


class StandInRunner:
    """A `StepRunner` whose token for position ``p`` is word ``p`` (cyclically) of ``TEXT``."""

    def __init__(self, checkpoint: Checkpoint, step_s: float) -> None:
        tokenizer = checkpoint.tokenizer()
        encoded = tokenizer.encode(TEXT, add_special_tokens=False)
        self.words = [t for t in encoded if not tokenizer.is_special(t)]
        assert self.words
        assert not set(self.words) & tokenizer.eos_token_ids
        self.vocab_size = tokenizer.vocab_size
        self.step_s = step_s

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        time.sleep(self.step_s)
        sampled: dict[str, SampledToken] = {}
        for item in output.scheduled:
            if item.do_sample:
                sampled[item.request_id] = self._sample(item)
                for fork in item.forks:
                    sampled[fork.request_id] = self._sample(item, fork.sampling_params)
        prompt_logprobs = {
            item.request_id: self._prompt_logprobs(item)
            for item in output.scheduled
            if item.sampling_params.prompt_logprobs is not None
            and item.num_reported_prompt_logprobs < item.num_prompt_tokens
        }
        return RunnerOutput(sampled, failed={}, prompt_logprobs=prompt_logprobs)

    def release(self, request_id: str) -> None:
        pass  # it holds nothing per request

    def _prompt_logprobs(self, item: ScheduledRequest) -> list[TokenLogprob | None]:
        """The prompt logprobs this chunk owes (after those already reported), by the same
        distribution: prompt token ``j`` is scored as if it were sampled at position ``j``."""
        k = item.sampling_params.prompt_logprobs or 0
        rest = math.log(0.5 / self.vocab_size)
        chosen = math.log(0.5 + 0.5 / self.vocab_size)
        reported = item.num_reported_prompt_logprobs
        entries: list[TokenLogprob | None] = [None] if reported == 0 else []
        end = min(item.start_position + item.num_tokens + 1, item.num_prompt_tokens)
        for j in range(max(reported, 1), end):
            word = self.words[j % len(self.words)]
            token_id = item.all_token_ids[j]
            others = [t for t in range(k + 1) if t != word][: max(k - 1, 0)]
            top = ((word, chosen), *((t, rest) for t in others)) if k > 0 else ()
            entries.append(TokenLogprob(token_id, chosen if token_id == word else rest, top))
        return entries

    def _sample(self, item: ScheduledRequest, params: SamplingParams | None = None) -> SampledToken:
        position = item.start_position + item.num_tokens  # of the token sampled now
        token_id = self.words[position % len(self.words)]
        k = (params or item.sampling_params).logprobs
        if k is None:
            return SampledToken(token_id, None)
        rest = math.log(0.5 / self.vocab_size)
        chosen = math.log(0.5 + 0.5 / self.vocab_size)
        others = [t for t in range(k + 1) if t != token_id][: max(k - 1, 0)]
        top = ((token_id, chosen), *((t, rest) for t in others)) if k > 0 else ()
        return SampledToken(token_id, TokenLogprob(token_id, chosen, top))


@dataclass(frozen=True)
class StandInPlan:
    model_config: ModelConfig
    block_size: int
    step_s: float
    kv_dtype: str = "float32"

    @property
    def kv_bytes_per_block(self) -> int:  # as the model's float32 cache would be
        config = self.model_config
        per_token = 2 * config.num_key_value_heads * config.head_dim * _FLOAT32_BYTES
        return per_token * self.block_size * config.num_hidden_layers

    def build(self, num_blocks: int, checkpoint: Checkpoint) -> StandInRunner:
        return StandInRunner(checkpoint, self.step_s)


def plan_stand_in_runner(step_s: float = STEP_S) -> PlanRunner:
    """A `PlanRunner` for `LLMEngine` / `AsyncEngine`: the stand-in, ``step_s`` per step."""

    def plan(config: EngineConfig, model_config: ModelConfig) -> StandInPlan:
        return StandInPlan(model_config, config.block_size, step_s)

    return plan


@dataclass(frozen=True)
class DemoEngineModel:
    """What an in-process engine serves (the ``demo_engine_model`` fixture):
    ``AsyncEngine(EngineConfig(model=str(checkpoint)), plan_runner=plan_runner)``."""

    checkpoint: Path
    plan_runner: PlanRunner | None  # None: the checkpoint's own model computes the tokens
