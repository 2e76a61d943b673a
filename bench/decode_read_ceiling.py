"""How much of the memory roofline a decode step's structure allows: our single-stream decode
beside a C loop that only reads the same bytes the same way, in one run.

    python -m bench.decode_read_ceiling                  # the shipped SmolLM2 Q4_1 GGUF
    python -m bench.decode_read_ceiling --repeats 9

``bench.single_stream_decode`` holds our decode against ``bandwidth / bytes read per
token``, the bandwidth a large copy's. But the native decoder does not stream one long
buffer: its threads split each stage's bytes (a layer's q/k/v projection with the KV cache
its attention reads, o, gate/up, down; then the output projection) and meet at a barrier
after each stage, nine times a layer. A stage's slice is 100-550 KB a thread on SmolLM2, so
each starts cold and ends waiting for the other thread.

The **reads alone** arm (``bench/csrc/step_reads.c``) reads exactly those bytes, on huge
pages as the engine's weights and KV cache are, in those stages, split between the threads
the same way, with the same barriers, and does nothing else: no arithmetic, attention, norms
or Python. So its fraction of the roofline is the most this step's structure allows on this
machine's memory; ours over it is how close the decoder's work comes to it.

Each repeat measures, back to back: the bandwidth (``single_stream_decode.copy_bandwidth`` on
huge pages), the reads alone for ``--output-len`` tokens, and our engine decoding
``--output-len`` tokens after a ``--prompt-len`` prompt (the KV cache read at the mean
context, as ``single_stream_decode`` counts it). Medians and paired ratios are quoted.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.single_stream_decode import (
    copy_bandwidth,
    kv_bytes_read,
    model_runner,
    our_decode_rate,
    weight_bytes_read,
)
from bench.workloads import add_common_args, checkpoint, command_line

if TYPE_CHECKING:
    from backend_engine import LLM

SOURCE = Path(__file__).parent / "csrc" / "step_reads.c"
LINE_BYTES = 64
# The native decoder's barriers after each stage of a single-stream step (decoder_cpu.c):
# q/k/v, then rotary and the KV store, the attention and its partitions' combine; o, then the
# post-attention norm; gate/up with SiLU; down, then the next layer's input norm (or the final
# norm); the output projection, then the argmax.
BARRIERS_AFTER_QKV = 4
BARRIERS_AFTER_O = 2
BARRIERS_AFTER_GATE_UP = 1
BARRIERS_AFTER_DOWN = 2
BARRIERS_AFTER_OUTPUT = 2


@dataclass(frozen=True)
class Stage:
    """Bytes one token reads between two of the decoder's barriers, and the barriers after."""

    bytes: int
    barriers: int


def step_stages(model: nn.Module, kv_bytes_per_layer: int) -> list[Stage]:
    """The stages of one decode step of ``model`` (a Llama-family ``CausalLM`` as the engine
    builds it): each layer's linears as :func:`weight_bytes_read` counts them, the input
    norm with q/k/v (and the layer's KV, which the decoder fetches during q/k/v), the
    post-attention norm with gate/up, the final norm with the output projection."""
    backbone = model.model
    layers = list(backbone.layers)

    def size(*modules: nn.Module) -> int:
        return sum(weight_bytes_read(nn.ModuleList([m])) for m in modules)

    stages: list[Stage] = []
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        stages += [
            Stage(
                size(layer.input_layernorm, attention.qkv_proj) + kv_bytes_per_layer,
                BARRIERS_AFTER_QKV,
            ),
            Stage(size(attention.o_proj), BARRIERS_AFTER_O),
            Stage(size(layer.post_attention_layernorm, mlp.gate_up_proj), BARRIERS_AFTER_GATE_UP),
            Stage(size(mlp.down_proj), BARRIERS_AFTER_DOWN),
        ]
    stages.append(Stage(size(backbone.norm, model.lm_head), BARRIERS_AFTER_OUTPUT))
    return stages


class StepReads:
    """The reads alone: ``stages``' bytes on huge pages, read by ``step_reads.c``."""

    def __init__(self, stages: list[Stage], num_threads: int) -> None:
        from kernels.cpu_build import load_kernels
        from kernels.huge_pages import huge_page_empty

        library = load_kernels(
            SOURCE,
            "the reads-alone arm cannot run",
            ("tollway_step_reads_abi_version", 1),
            {
                "tollway_step_reads": (
                    [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int],
                    ctypes.c_int64,
                )
            },
        )
        if library is None:
            raise RuntimeError(f"{SOURCE.name} did not build: no C compiler, or native kernels off")
        self._library = library
        self.num_threads = num_threads
        self.sizes = torch.tensor([s.bytes for s in stages], dtype=torch.int64)
        self.barriers = torch.tensor([s.barriers for s in stages], dtype=torch.int32)
        lines = sum(-(-s.bytes // LINE_BYTES) for s in stages)
        self.buffer = huge_page_empty((lines * LINE_BYTES,), torch.uint8)
        self.buffer.fill_(1)  # fault the pages in, and nothing is a zero page

    def read(self, tokens: int) -> int:
        """Read every stage ``tokens`` times; the xor of every 8-byte word read."""
        return int(
            self._library.tollway_step_reads(
                self.buffer.data_ptr(),
                self.sizes.data_ptr(),
                self.barriers.data_ptr(),
                len(self.sizes),
                tokens,
                self.num_threads,
            )
        )

    def rate(self, tokens: int) -> float:
        """Tokens per second of ``tokens`` steps' reads."""
        start = time.perf_counter()
        self.read(tokens)
        return tokens / (time.perf_counter() - start)


def _runs(values: list[float], fmt: str = ".1f") -> str:
    return "(runs: " + ", ".join(f"{x:{fmt}}" for x in values) + ")"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    add_common_args(parser, repeats=7, default_model="smollm2")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    num_threads = torch.get_num_threads()

    from backend_engine import LLM

    model = checkpoint(args.model, args.size)
    llm: LLM = LLM(
        model=model,
        dtype="float32",
        enable_prefix_caching=False,
        num_threads=num_threads,
        kv_cache_memory_bytes=64 * 1024 * 1024,
    )
    vocab = llm.engine.model_config.vocab_size
    prompt = [10 + (i * 7919) % (vocab - 20) for i in range(args.prompt_len)]
    mean_context = args.prompt_len + args.output_len / 2
    torch_model = model_runner(llm).model
    num_layers = len(list(torch_model.model.layers))
    kv_per_layer = round(kv_bytes_read(llm, mean_context) / num_layers)
    stages = step_stages(torch_model, kv_per_layer)
    per_token = sum(s.bytes for s in stages)
    reads = StepReads(stages, num_threads)

    our_decode_rate(llm, prompt, 8)  # warm-up
    reads.rate(8)
    bandwidths: list[float] = []
    rates: dict[str, list[float]] = {"reads alone": [], "ours": []}
    for repeat in range(args.repeats):
        bandwidths.append(copy_bandwidth(huge_pages=True))
        arms = ["reads alone", "ours"] if repeat % 2 == 0 else ["ours", "reads alone"]
        for arm in arms:
            rates[arm].append(
                reads.rate(args.output_len)
                if arm == "reads alone"
                else our_decode_rate(llm, prompt, args.output_len)
            )

    print(f"command: {command_line()}")
    print(
        f"model: {model}; threads: {num_threads}; prompt {args.prompt_len} tokens, "
        f"{args.output_len} decoded (mean context {mean_context:.0f}), repeats: {args.repeats}"
    )
    print(
        f"bytes read per token: {per_token / 1e6:.1f} MB (weights "
        f"{weight_bytes_read(torch_model) / 1e6:.1f} MB + KV {kv_per_layer * num_layers / 1e6:.1f}"
        f" MB) in {len(stages)} stages, {sum(s.barriers for s in stages)} barriers"
    )
    print(
        f"memory bandwidth (torch copy, read + write, on huge pages): "
        f"{statistics.median(bandwidths) / 1e9:6.2f} GB/s  " + _runs([b / 1e9 for b in bandwidths])
    )
    fractions: dict[str, float] = {}
    for arm, values in rates.items():
        shares = [rate * per_token / bw for rate, bw in zip(values, bandwidths, strict=True)]
        fractions[arm] = statistics.median(shares)
        print(
            f"{arm:12s} {statistics.median(values):7.1f} tokens/s  {_runs(values)}; "
            f"{fractions[arm]:.0%} of the roofline  {_runs([f * 100 for f in shares], '.0f')}"
        )
    paired = statistics.median(
        o / r for o, r in zip(rates["ours"], rates["reads alone"], strict=True)
    )
    print(f"ours / reads alone (paired median): {paired:.3f}")
    print(
        f"80% of the roofline needs ours at {0.8 / fractions['reads alone']:.0%} of the reads alone"
    )


if __name__ == "__main__":
    main()
