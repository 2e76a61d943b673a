"""The completion endpoints' bodies for the OpenAPI document (pydantic).

Requests: the engine's own request models (`openai_protocol.request_models`), which validate
every field the gateway forwards, plus the gateway's ``tollway_hint``. Responses: OpenAI's
shapes, as the engine's `openai_format` writes them and the gateway relays them; a streamed
answer is ``text/event-stream`` whose ``data:`` lines are the chunk models, then ``[DONE]``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from openai_protocol.field_rules import RULES, Endpoint
from openai_protocol.request_models import ChatCompletionRequest, CompletionRequest, ToolCall

Hint = Literal["small", "large"] | None
_HINT = "Tollway: on a routing alias (model: auto), ask for its small or large model."


def _field_rules(endpoint: Endpoint) -> ConfigDict:
    """Lay the field rules' JSON Schema keywords (ranges, lengths: ``field_rules``, which both
    the gateway and the engine check) over the fields pydantic describes by type alone; an
    optional field may be ``null`` (it then takes its default)."""

    def extra(schema: dict[str, Any]) -> None:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        for name, rule in RULES[endpoint].items():
            if name in properties:
                keywords = rule.json_schema()
                base = {} if "anyOf" in keywords else properties[name]
                field = {**base, **keywords}
                if name not in required and isinstance(field.get("type"), str):
                    field["type"] = [field["type"], "null"]  # null is "not given"
                properties[name] = field

    return ConfigDict(json_schema_extra=extra)


class ChatCompletionBody(ChatCompletionRequest):
    model_config = _field_rules("chat")

    tollway_hint: Hint = Field(default=None, description=_HINT)


class CompletionBody(CompletionRequest):
    model_config = _field_rules("completions")

    tollway_hint: Hint = Field(default=None, description=_HINT)


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None  # OpenAI's; always null here


class AssistantMessage(BaseModel):
    """The answer: its text, or (``finish_reason: "tool_calls"``) the calls it makes, with
    ``content`` null."""

    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None  # OpenAI's; always null here (the models served never refuse)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    """One choice per ``n``, each with its ``index``; ``usage`` counts the prompt once and
    every choice's completion tokens."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None  # the engine build and weights that answered
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # the next piece of the arguments' JSON


class ToolCallDelta(BaseModel):
    """A piece of the call at ``index``: its first carries ``id``, ``type`` and the name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion, its choice named by ``index`` (with
    ``n`` > 1 the choices' chunks interleave); the last has ``usage`` and no choices (always
    sent by the engine; relayed when ``stream_options.include_usage``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """With ``echo``, the prompt's tokens come first; the very first has no logprob (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    """A text completion, whole; streamed, each ``data:`` event has this shape with a piece
    of the text (``usage`` on the last one only). One choice per prompt times ``n``: choice
    ``i * n + j`` is prompt ``i``'s ``j``-th; with ``echo`` its text starts with the prompt's."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """A model, rollout or routing alias the caller's key may use."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    """The models (and routing aliases) the caller's key may use."""

    object: Literal["list"]
    data: list[ModelCard]


REQUEST_MODELS: list[type[BaseModel]] = [ChatCompletionBody, CompletionBody]
RESPONSE_MODELS: list[type[BaseModel]] = [
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelCard,
    ModelList,
]
