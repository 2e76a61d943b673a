"""The model's shape and numerics, parsed once from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_ROPE_TYPES = ("default", "llama3", "linear")
_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs from ``config.json``, with defaults filled in.

    ``rope_scaling`` is ``None`` for plain RoPE, else a dict with at least ``rope_type``
    (``"llama3"`` or ``"linear"``) and that type's parameters; both the older
    ``rope_scaling`` + ``rope_theta`` keys and transformers 5's ``rope_parameters`` are read.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mistral/Qwen2 sliding-window attention: equal to full attention up to this many tokens.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def max_model_len(self) -> int:
        """The longest context this engine can serve exactly (no sliding-window support)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def check_max_model_len(self, requested: int | None) -> int:
        """The effective context limit for an engine asking for ``requested`` (None = max)."""
        if requested is None:
            return self.max_model_len
        if requested > self.max_model_len:
            reason = (
                f"the sliding window ({self.sliding_window} tokens) is not supported"
                if self.sliding_window is not None and self.sliding_window < requested
                else f"max_position_embeddings is {self.max_position_embeddings}"
            )
            raise ValueError(
                f"max_model_len={requested} exceeds this model's limit of "
                f"{self.max_model_len} tokens: {reason}"
            )
        return requested

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json found at {config_path}")
        with config_path.open() as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, check_support: bool = True) -> ModelConfig:
        """``check_support=False`` reads a model this engine does not run, as the capacity
        planner does (it plans any Llama-style decoder): its architecture, RoPE type and dtype
        are then taken as given instead of refused."""
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else "<missing 'architectures'>"
        if check_support and architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        rope_theta, rope_scaling = _parse_rope(raw, check_support)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            torch_dtype=_parse_dtype(raw.get("torch_dtype") or raw.get("dtype"), check_support),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=_parse_sliding_window(raw, architecture),
        )


def _parse_rope(raw: dict[str, Any], check_support: bool) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if check_support and rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type
    return theta, scaling


def _parse_dtype(name: str | None, check_support: bool) -> str:
    if name is None:
        return "float32"
    name = name.removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        if not check_support:
            return name
        raise ValueError(f"unsupported torch_dtype {name!r} in config.json")
    return _DTYPE_NAMES[name]


def _parse_sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    if architecture == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        return None
    return int(window)
