"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Types are checked strictly (``"ten"`` is not a number, ``"true"`` is not a bool);
fields this server does not know are ignored, as OpenAI's own API does. The sampling
fields' ranges, widths and lengths are not repeated here: the engine server's ``read_model``
checks them first against the table the gateway uses too (``field_rules``), and drops
``null`` fields so they take their defaults.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_STRICT = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _STRICT

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension; -1 and 0 both disable it
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    user: str | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """How many top alternatives to report per token; None for no logprobs."""
        return None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) and len(prompt) != 1:
            raise ValueError(f"only one prompt per request is supported, got {len(prompt)}")
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, str]]:
        """The conversation as the tokenizer's chat template takes it."""
        return [{"role": m.role, "content": m.text} for m in self.messages]


class AbortRequest(BaseModel):
    """``POST /abort_request``: the ``x-request-id`` a generation was sent with."""

    model_config = _STRICT

    request_id: Annotated[str, Field(min_length=1, max_length=128)]
