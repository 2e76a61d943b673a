"""bench.decode_read_ceiling: the reads-alone arm reads every byte of a step once a token, in
the decoder's stages, and the stages hold what the roofline counts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bench.decode_read_ceiling import (
    BARRIERS_AFTER_DOWN,
    BARRIERS_AFTER_GATE_UP,
    BARRIERS_AFTER_O,
    BARRIERS_AFTER_OUTPUT,
    BARRIERS_AFTER_QKV,
    Stage,
    StepReads,
    step_stages,
)
from bench.single_stream_decode import model_runner, weight_bytes_read
from kernels.cpu_build import find_compiler


def xor_of_words(data: torch.Tensor) -> int:
    words = data.view(torch.int64)
    result = 0
    for word in words.tolist():
        result ^= word
    return result


@pytest.mark.skipif(find_compiler() is None, reason="needs a C compiler")
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_every_line_of_every_stage_is_read_once_a_token(num_threads: int) -> None:
    stages = [Stage(100, 1), Stage(64, 2), Stage(1000, 1), Stage(8, 3)]  # not whole lines
    reads = StepReads(stages, num_threads)
    assert reads.buffer.numel() == (2 + 1 + 16 + 1) * 64  # each stage from a new line
    generator = torch.Generator().manual_seed(0)
    reads.buffer.copy_(torch.randint(0, 256, reads.buffer.shape, generator=generator))
    assert reads.read(1) == xor_of_words(reads.buffer)
    assert reads.read(2) == 0  # each word twice
    assert reads.rate(3) > 0


def test_a_steps_stages_hold_the_bytes_and_barriers_of_the_native_decoder(
    demo_checkpoint: Callable[..., Path],
) -> None:
    from backend_engine import LLM

    llm = LLM(model=str(demo_checkpoint(size="tiny")), dtype="float32", num_threads=1)
    model = model_runner(llm).model
    num_layers = len(model.model.layers)
    stages = step_stages(model, kv_bytes_per_layer=1000)
    assert len(stages) == 4 * num_layers + 1
    assert sum(s.bytes for s in stages) == weight_bytes_read(model) + 1000 * num_layers
    per_layer = BARRIERS_AFTER_QKV + BARRIERS_AFTER_O + BARRIERS_AFTER_GATE_UP
    per_layer += BARRIERS_AFTER_DOWN
    assert per_layer == 9
    assert sum(s.barriers for s in stages) == per_layer * num_layers + BARRIERS_AFTER_OUTPUT
    assert stages[-1].bytes == weight_bytes_read(torch.nn.ModuleList([model.model.norm])) + (
        weight_bytes_read(torch.nn.ModuleList([model.lm_head]))
    )
