"""Shared pieces for the benchmarks: demo checkpoints and request mixes."""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def add_common_args(parser: argparse.ArgumentParser, repeats: int = 3) -> None:
    """--model, --size, --repeats and --num-threads, the same in every benchmark."""
    parser.add_argument("--model", help="checkpoint dir (default: the large demo model)")
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


def demo_model(size: str, model: str | None) -> str:
    """The checkpoint to benchmark: ``model`` if given, else a demo one written once."""
    if model:
        return model
    from backend_engine.demo_model import write_demo_checkpoint

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
