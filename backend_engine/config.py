"""The engine's one frozen settings object, built at start-up and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SchedulingMode = Literal["continuous", "static"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Weight quantization of a float checkpoint at load: int8 per output channel, or int4 in
# groups of quantization_group_size (a GGUF file's quantized tensors are served as stored).
QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64)
# How int4 codes are chosen: "gptq" calibrates on text that ships with Python (the float
# model's own run, then GPTQ: about +4% perplexity at g64 where round-to-nearest is +25% on
# SmolLM2-135M; tens of seconds more to load); "rtn" rounds each group to its nearest grid.
QUANTIZATION_CALIBRATIONS = ("gptq", "rtn")
# The KV cache's element type: "auto" is the weights' dtype; int8 keeps a float32 scale per
# block and KV head beside int8 values (about 4x the tokens of float32 in the same memory).
KV_CACHE_DTYPES = ("auto", "int8")
# Speculative decoding's proposers (backend_engine.speculative): n-gram prompt lookup, and a
# small draft model sharing the target's tokenizer.
SPECULATIVE_PROPOSERS = ("ngram", "draft")
# A step of at least this many sequences proposes nothing: past it a step is bound by compute,
# not by reading the weights, and scoring drafts costs what they save (measured on this
# project's 2-core CPU with float32 SmolLM2-135M and n-gram drafts, copy-heavy prompts: 1.18x
# at 6 sequences, 1.00-1.14x at 8, 1.02x at 10, 0.95-1.00x at 12, 0.91x at 16;
# docs/benchmarks.md, issue #29).
DEFAULT_SPECULATIVE_CROSSOVER = 8


HELP = "help"  # each field's one line of help, which `tollway engine --FIELD` shows

# While another tenant waits, one tenant may run at most this share of max_num_seqs: a
# quarter of the sequences stays for the others' arrivals, and a tenant alone (nobody else
# waiting) still gets them all. 1.0 is no cap (a tenant could hold every sequence anyway).
DEFAULT_MAX_RUNNING_SHARE = 0.75

# A step's token budget when none is set, by device. On a GPU a 2,048-token step takes
# milliseconds. On a CPU it takes seconds (2.2 s for SmolLM2-135M on 2 cores), and every
# stream sharing the engine waits that long for its next token, another tenant's first token
# included: 256 keeps a CPU step near a quarter of that, with the same offline throughput
# and a lone 2,000-token prompt's first token 8-16% later (docs/benchmarks.md, issue #27).
DEFAULT_STEP_TOKENS = {"cpu": 256, "cuda": 2048}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know before it loads a model.

    ``kv_cache_memory_bytes`` is the memory budget for the paged KV cache: the
    number of blocks is derived from it and the model's shape, and nothing is
    reserved per request up front.

    Every field is also a flag of the engine's command line (``backend_engine.cli``), with
    this default and the help in its metadata: a new field needs a ``HELP`` line, nothing else.
    """

    model: str = field(metadata={HELP: "A Hugging Face checkpoint directory or a .gguf file."})
    device: str = field(default="cpu", metadata={HELP: "cpu, cuda or cuda:N"})
    dtype: str = field(default="auto", metadata={HELP: "auto, float32, bfloat16 or float16"})
    quantization: str | None = field(
        default=None,
        metadata={HELP: "Quantize a float checkpoint's linears at load: int8 or int4."},
    )
    quantization_group_size: int = field(
        default=32, metadata={HELP: "Values per int4 scale group: 32 or 64."}
    )
    quantization_calibration: str = field(
        default="gptq",
        metadata={HELP: "How int4 codes are chosen: gptq (calibrated at load) or rtn."},
    )
    dequantize: bool = field(
        default=False,
        metadata={HELP: "Widen a GGUF file's quantized weights to --dtype at load."},
    )
    kv_cache_dtype: str = field(
        default="auto", metadata={HELP: "KV cache element type: auto (the dtype) or int8."}
    )
    speculative_proposer: str | None = field(
        default=None,
        metadata={HELP: "Speculative decoding's proposer: ngram or draft (a model); none: off."},
    )
    speculative_draft_model: str | None = field(
        default=None,
        metadata={HELP: "The draft proposer's model (same tokenizer): a checkpoint or .gguf."},
    )
    num_speculative_tokens: int = field(
        # 8: float32 SmolLM2's copy-heavy answers here, 1.99x at 8 against 1.74x at 4 (a
        # draft row costs ~nothing there; where it costs, the adaptive k stops lower).
        default=8,
        metadata={HELP: "Most draft tokens a sequence proposes in a step."},
    )
    speculative_ngram_min: int = field(
        # 1: float32 SmolLM2's copy-heavy answers replayed through the proposer kept 3.0
        # tokens a step from 1-grams against 2.6 from 2-grams; open chat the same (the
        # adaptive k drops drafts that miss).
        default=1,
        metadata={HELP: "Shortest n-gram prompt lookup matches."},
    )
    speculative_ngram_max: int = field(
        default=4, metadata={HELP: "Longest n-gram prompt lookup matches (the longest wins)."}
    )
    speculative_crossover_batch_size: int = field(
        default=DEFAULT_SPECULATIVE_CROSSOVER,
        metadata={HELP: "Steps of at least this many sequences do not speculate."},
    )
    speculative_draft_cost: float | None = field(
        default=None,
        metadata={HELP: "A draft row's cost over a one-token step's; default: measured at start."},
    )
    decode_run_steps: int = field(
        # 8: SmolLM2-135M's ~5 ms CPU step pays the loop around it (~1.2 ms) once per 8 tokens
        # (backend_engine.core.decode_runs; docs/benchmarks.md, issue #28).
        default=8,
        metadata={HELP: "Most greedy decode steps run back to back in one step (1: off)."},
    )
    decode_run_max_ms: float = field(
        default=50.0,
        metadata={HELP: "Longest a decode run may take, in ms (an arriving request waits it)."},
    )
    block_size: int = field(default=16, metadata={HELP: "Tokens per KV block (a power of two)."})
    kv_cache_memory_bytes: int = field(
        # 512 MiB holds one whole 8,192-token context of the default model (SmolLM2-135M,
        # 46 KB a token in float32) with room to spare.
        default=512 * 1024 * 1024,
        metadata={HELP: "KV cache budget in bytes."},
    )
    num_kv_blocks: int | None = field(
        default=None, metadata={HELP: "Number of KV blocks; overrides the memory budget."}
    )
    enable_prefix_caching: bool = field(default=True, metadata={HELP: "Reuse shared prefixes."})
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata={HELP: "Token budget per step; default: 2048 on CUDA, 256 on the CPU."},
    )
    max_num_seqs: int = field(default=64, metadata={HELP: "Most sequences per step."})
    max_running_share: float = field(
        default=DEFAULT_MAX_RUNNING_SHARE,
        metadata={HELP: "Most of max_num_seqs one tenant runs while another waits (0-1]."},
    )
    max_model_len: int | None = field(
        default=None,
        metadata={HELP: "Longest sequence (prompt + output); default: the model's own."},
    )
    scheduling: SchedulingMode = field(
        default="continuous",
        metadata={HELP: "continuous batching, or static (a batch runs to its end)."},
    )
    # Fraction of blocks kept free when admitting new requests, so running ones
    # can grow without immediately being preempted (anti-thrashing).
    watermark: float = field(
        default=0.01, metadata={HELP: "Fraction of KV blocks kept free when admitting."}
    )
    seed: int = field(default=0, metadata={HELP: "Seed for sampling requests that set none."})
    num_threads: int | None = field(
        default=None, metadata={HELP: "CPU threads for torch; default: torch's own choice."}
    )
    show_progress: bool = field(
        default=True, metadata={HELP: "Show progress bars while loading the model."}
    )
    # A JSON-schema grammar takes about 0.1 to 1 MB; 256 of them hold a large app's schemas.
    grammar_cache_size: int = field(
        default=256, metadata={HELP: "Compiled structured-output grammars kept (an LRU cache)."}
    )
    grammar_compile_timeout_s: float = field(
        default=10.0,
        metadata={HELP: "Seconds a structured output's grammar may take to compile (else a 400)."},
    )
    # Kubernetes' default terminationGracePeriodSeconds is 30 s: the drain ends before it.
    drain_grace_s: float = field(
        default=25.0,
        metadata={HELP: "On SIGTERM, seconds requests in flight get to finish before abort."},
    )

    @property
    def step_token_budget(self) -> int:
        """``max_num_batched_tokens``, or the device's default (`DEFAULT_STEP_TOKENS`)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_STEP_TOKENS["cpu" if self.device == "cpu" else "cuda"]

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size must be one of {INT4_GROUP_SIZES}, "
                f"got {self.quantization_group_size}"
            )
        if self.quantization_calibration not in QUANTIZATION_CALIBRATIONS:
            raise ValueError(
                f"quantization_calibration must be one of {QUANTIZATION_CALIBRATIONS}, "
                f"got {self.quantization_calibration!r}"
            )
        if self.quantization is not None and self.dequantize:
            raise ValueError("quantization and dequantize exclude each other")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if (
            self.speculative_proposer is not None
            and self.speculative_proposer not in SPECULATIVE_PROPOSERS
        ):
            raise ValueError(
                f"speculative_proposer must be one of {SPECULATIVE_PROPOSERS}, "
                f"got {self.speculative_proposer!r}"
            )
        if (self.speculative_proposer == "draft") != (self.speculative_draft_model is not None):
            raise ValueError(
                "speculative_draft_model is needed by, and only by, speculative_proposer='draft'"
            )
        if self.speculative_proposer is not None and self.kv_cache_dtype == "int8":
            # A rejected draft's KV can grow its int8 block's scale, which requantizes the
            # verified tokens already there: trimming the draft cannot undo that.
            raise ValueError(
                "speculative decoding needs a float KV cache: a rejected draft would requantize "
                "an int8 block's verified tokens (use kv_cache_dtype='auto')"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError(
                "the n-gram sizes must satisfy 1 <= speculative_ngram_min <= "
                f"speculative_ngram_max, got {self.speculative_ngram_min} and "
                f"{self.speculative_ngram_max}"
            )
        if self.speculative_draft_cost is not None and not self.speculative_draft_cost >= 0:
            raise ValueError(
                f"speculative_draft_cost must be 0 or more, got {self.speculative_draft_cost}"
            )
        if self.speculative_crossover_batch_size < 1:
            raise ValueError(
                "speculative_crossover_batch_size must be at least 1, "
                f"got {self.speculative_crossover_batch_size}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if not 0.0 < self.max_running_share <= 1.0:
            raise ValueError(f"max_running_share must be in (0, 1], got {self.max_running_share}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        if self.decode_run_steps < 1:
            raise ValueError(f"decode_run_steps must be at least 1, got {self.decode_run_steps}")
        if not self.decode_run_max_ms > 0.0:
            raise ValueError(f"decode_run_max_ms must be positive, got {self.decode_run_max_ms}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.grammar_cache_size < 1:
            raise ValueError(f"grammar_cache_size must be positive, got {self.grammar_cache_size}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                f"grammar_compile_timeout_s must be positive, got {self.grammar_compile_timeout_s}"
            )
        if not self.drain_grace_s >= 0:
            raise ValueError(f"drain_grace_s must be 0 or more, got {self.drain_grace_s}")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(
                f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}"
            )
