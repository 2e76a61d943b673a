"""logit_bias and the penalties end to end on a tiny demo model: what greedy picks under them,
that requests without them are not touched, and (the referee) that greedy under them equals
transformers' greedy with the same stage written from the formulas."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend_engine import LLM, SamplingParams

NUM_NEW_TOKENS = 12
PROMPTS = ["Hello there", "The quick brown fox", "1 + 1 =", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(demo_checkpoint) -> LLM:
    return LLM(model=str(demo_checkpoint(size="tiny")), dtype="float32")


def greedy(**options: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, **options)


def test_a_bias_of_minus_100_keeps_greedy_off_its_picks(llm: LLM) -> None:
    for prompt in PROMPTS:
        picks = llm.generate([prompt], greedy())[0].token_ids
        banned = {t: -100.0 for t in picks}
        output = llm.generate([prompt], greedy(logit_bias=banned))[0].token_ids
        assert len(output) == NUM_NEW_TOKENS
        assert not set(output) & set(banned), (prompt, picks, output)


def test_a_bias_of_plus_100_makes_greedy_emit_the_token(llm: LLM) -> None:
    token = llm.tokenizer.encode(" cat", add_special_tokens=False)[-1]
    for prompt in PROMPTS:
        output = llm.generate([prompt], greedy(logit_bias={token: 100.0}))[0]
        assert output.token_ids == [token] * NUM_NEW_TOKENS


def test_neighbours_without_them_produce_what_they_produce_alone(llm: LLM) -> None:
    plain = [
        greedy(),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=NUM_NEW_TOKENS, seed=7, logprobs=2),
        greedy(logprobs=3),
    ]
    alone = [llm.generate([p], [s])[0].token_ids for p, s in zip(PROMPTS, plain, strict=False)]
    using = [
        greedy(logit_bias={t: 5.0 for t in range(40, 80)}, presence_penalty=1.5),
        greedy(frequency_penalty=2.0, repetition_penalty=1.8),
        SamplingParams(
            temperature=1.0, max_tokens=NUM_NEW_TOKENS, presence_penalty=-2.0, logit_bias={9: 30}
        ),
    ]
    # Interleaved, so every plain row sits between rows that use the stage.
    prompts = [p for i in range(3) for p in (PROMPTS[-1 - i], PROMPTS[i])]
    params = [s for pair in zip(using, plain, strict=True) for s in pair]
    batched = llm.generate(prompts, params)
    assert [o.token_ids for o in batched[1::2]] == alone
    # ... and the rows that use them did get something else than plain greedy.
    assert batched[0].token_ids != llm.generate([prompts[0]], greedy())[0].token_ids


def test_every_choice_of_n_gets_the_stage_from_its_first_token(llm: LLM) -> None:
    """The choices forked off one prefill sample their first token from the leader's row, each
    under its own params: each must get the bias and penalties, as n=1 does."""
    token = llm.tokenizer.encode(" cat", add_special_tokens=False)[-1]
    options = {"logit_bias": {token: 100.0}}
    choices = llm.generate([PROMPTS[0]], greedy(n=3, **options))
    assert [c.token_ids for c in choices] == [[token] * NUM_NEW_TOKENS] * 3
    penalized = {"frequency_penalty": 2.0, "presence_penalty": 1.0, "repetition_penalty": 1.5}
    alone = llm.generate([PROMPTS[1]], greedy(**penalized))[0].token_ids
    choices = llm.generate([PROMPTS[1]], greedy(n=3, **penalized))
    assert [c.token_ids for c in choices] == [alone] * 3


def test_a_logit_bias_id_outside_the_vocabulary_is_refused(llm: LLM) -> None:
    vocab_size = llm.engine.model_config.vocab_size
    params = SamplingParams(logit_bias={5: 1.0, vocab_size: 2.0})
    with pytest.raises(ValueError, match="logit_bias") as refused:
        llm.engine.make_request("r", "Hello", params)
    assert str(vocab_size) in str(refused.value)
    llm.engine.make_request("r", "Hello", SamplingParams(logit_bias={vocab_size - 1: 2.0}))


# The referee: transformers' greedy with the stage as one logits processor, from the formulas.

STAGE = {
    "bias_and_openai_penalties": {
        "logit_bias": {11: 4.0, 12: -3.0, 200: 2.5},
        "presence_penalty": 0.8,
        "frequency_penalty": 0.6,
    },
    "repetition": {"repetition_penalty": 1.7},
    "everything_negative": {
        "logit_bias": {3: -1.0},
        "presence_penalty": -1.0,
        "frequency_penalty": -0.5,
        "repetition_penalty": 0.8,
    },
}
ENGINE_SETTINGS = {
    "defaults": {},
    "tiny_chunked_prefill_budget": {"max_num_batched_tokens": 7},
    "forced_preemption": {"num_kv_blocks": 12, "block_size": 4},
}


def referee_greedy(path: Path, prompt: list[int], stage: dict[str, object]) -> list[int]:
    transformers = pytest.importorskip("transformers")
    bias: dict[int, float] = stage.get("logit_bias", {})  # type: ignore[assignment]
    presence = float(stage.get("presence_penalty", 0.0))  # type: ignore[arg-type]
    frequency = float(stage.get("frequency_penalty", 0.0))  # type: ignore[arg-type]
    repetition = float(stage.get("repetition_penalty", 1.0))  # type: ignore[arg-type]

    class Stage(transformers.LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            scores = scores.clone()
            for token_id, value in bias.items():
                scores[:, token_id] += value
            if repetition != 1.0:
                scores = transformers.RepetitionPenaltyLogitsProcessor(repetition)(
                    input_ids, scores
                )
            output = input_ids[0, len(prompt) :]
            counts = torch.bincount(output, minlength=scores.shape[1]).to(scores.dtype)
            return scores - (presence * (counts > 0).to(scores.dtype) + frequency * counts)

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList([Stage()]),
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.referee
@pytest.mark.parametrize("settings", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("stage", list(STAGE))
def test_greedy_under_the_stage_matches_transformers(demo_checkpoint, stage, settings) -> None:
    path = demo_checkpoint(size="tiny")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (3, 9, 20)]
    # Prompts repeat a few tokens, so the repetition penalty has prompt tokens to act on.
    prompts.append([5, 6, 5, 6, 5, 6, 7])
    expected = [referee_greedy(path, p, STAGE[stage]) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", **ENGINE_SETTINGS[settings])
    outputs = llm.generate(prompts, greedy(**STAGE[stage]))
    assert [o.token_ids for o in outputs] == expected
    if settings == "forced_preemption":
        assert llm.engine.scheduler.num_preemptions > 0
