"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Types are checked strictly (``"ten"`` is not a number, ``"true"`` is not a bool);
fields this server does not know are ignored, as OpenAI's own API does. The sampling
fields' ranges, widths and lengths are not repeated here: the engine server's ``read_model``
checks them first against the table the gateway uses too (``field_rules``), and drops
``null`` fields so they take their defaults.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (transformers' formula, as vLLM's)
    logit_bias: dict[str, float] | None = None  # token id (a string of digits) -> bias
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

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` keyed by token id (the field rules checked each key is one)."""
        return {int(token): bias for token, bias in (self.logit_bias or {}).items()}

    def requested_logprobs(self) -> int | None:
        """How many top alternatives to report per token; None for no logprobs."""
        return None


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


class ToolCall(BaseModel):
    """One call in an assistant message's ``tool_calls``."""

    model_config = _STRICT

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One turn. ``developer`` is rendered as ``system``; a ``tool`` turn answers the assistant
    call named by ``tool_call_id``; an assistant turn may hold only ``tool_calls``."""

    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.role == "assistant":
            if self.content is None and not self.tool_calls:
                raise ValueError("an assistant message needs content or tool_calls")
        elif self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The turn as OpenAI's JSON writes it, text parts joined (what ``chat_rendering``
        takes, from the engine and from the gateway's counter alike)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; none: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT

    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this function."""

    model_config = _STRICT

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    # A JSON Schema; ``true`` (or ``{}``) admits any JSON value. ``null`` is "not given".
    json_schema: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")

    @field_validator("json_schema", mode="before")
    @classmethod
    def _null_is_not_given(cls, value: Any) -> Any:
        return {} if value is None else value

    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs 'json_schema'")
        return self


class StructuredOutputs(BaseModel):
    """The Tollway extension (vLLM's ``structured_outputs``): exactly one of a JSON Schema
    (``json``), a ``regex``, a ``choice`` of strings, or a Lark ``grammar``."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        fields = ("json_schema", "regex", "choice", "grammar")
        given = [f for f in fields if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of 'json', 'regex', 'choice', 'grammar'"
            )
        return self


class ConstrainedRequest(GenerationRequest):
    """The output constraints both endpoints take (``response_format`` is an extension on
    /v1/completions, as vLLM's)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> ConstrainedRequest:
        is_formatted = self.response_format is not None and self.response_format.type != "text"
        if is_formatted and self.structured_outputs is not None:
            raise ValueError("give either 'response_format' or 'structured_outputs', not both")
        return self


Prompt = str | list[int]


class CompletionRequest(ConstrainedRequest):
    """``prompt``: one prompt (a string or token ids) or a list of them, one choice each
    (times ``n``); ``echo`` puts each prompt's text (and, with ``logprobs``, its tokens'
    logprobs) before its completion."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(
        cls, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(prompt, list) and (not prompt or any(p == [] for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    def prompts(self) -> list[Prompt]:
        """Each prompt of the request, in order (a token-id list is one prompt)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [[int(t) for t in prompt if isinstance(t, int)]]
        return [p if isinstance(p, str) else list(p) for p in prompt if isinstance(p, str | list)]

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(ConstrainedRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("'tool_choice' is only allowed when 'tools' are specified")
        if isinstance(choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or []}
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names the function {choice.function.name!r}, "
                    "which is not in 'tools'"
                )
        return self

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """OpenAI's default: ``auto`` when tools are given, else ``none``."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as ``model_files.chat_rendering`` takes it."""
        return [m.template_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools, as OpenAI's JSON writes them (what chat templates take), or None."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


class AbortRequest(BaseModel):
    """``POST /abort_request``: the ``x-request-id`` a generation was sent with."""

    model_config = _STRICT

    request_id: Annotated[str, Field(min_length=1, max_length=128)]
