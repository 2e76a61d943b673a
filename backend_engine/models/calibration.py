"""Calibration for GPTQ: each decoder linear's input Hessian, from the float model's own run.

GPTQ (:mod:`kernels.gptq_quantization`) needs, for every linear it quantizes, ``H = 2 X X^T /
num_tokens`` of the inputs ``X`` the layer sees on real text. They are measured here by running
the engine's own float model (the same forward that serves requests, no other library) over
``CALIBRATION_TOKENS`` tokens of calibration text in prompts of ``CALIBRATION_WINDOW`` tokens,
with a hook on each decoder linear that adds ``x^T x`` up (a prompt's in float32, the sum over
prompts in float64). The inputs are the float model's (every layer's Hessian from one run, not
re-measured behind the layers already quantized), which is what lets a quantizer stream the
checkpoint's tensors through afterwards, one at a time.

The text: the docstrings of the Python standard library's modules (``ast``-parsed from the
installed sources in sorted order, never imported): English prose about code, on every machine,
never downloaded. It is not the text perplexity is measured on (``bench.perplexity`` reads the
Language Reference's help() topics, ``pydoc_data.topics``, another set of documents), so a
calibrated model is not scored on what it was calibrated with. How many tokens, measured on
SmolLM2-135M int4 g64 (perplexity against float32 on 8,192 tokens of help() topics): 4,096
+4.9%, 8,192 +4.1%, 12,288 +4.5%, 16,384 +3.9%; 8,192 (16 prompts, seconds on 2 cores for a
135M model) is the default. GPTQ's paper used 128 x 2,048 tokens of C4 for far larger models.

Fused linears (q/k/v, gate/up) read one input, so their parts share one Hessian, keyed by each
part's Hugging Face weight name, the names the quantizer sees.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from backend_engine.models.attention_metadata import AttentionMetadata
from backend_engine.models.llama import CausalLM
from model_files.tokenizer import Tokenizer

CALIBRATION_METHODS = ("gptq", "rtn")  # GPTQ, or round-to-nearest (searched grids)
CALIBRATION_TOKENS = 8192
CALIBRATION_WINDOW = 512  # tokens a calibration prompt
MIN_DOCSTRING_CHARS = 200  # a module's one-line docstring says little
KV_BLOCK_SIZE = 16
# An engine module name's last part -> the checkpoint's weight names it holds.
_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "o_proj": ("o_proj",),
    "down_proj": ("down_proj",),
}


def calibrated_hessians(
    model: CausalLM, tokenizer: Tokenizer, show_progress: bool = False
) -> dict[str, torch.Tensor]:
    """The decoder linears' input Hessians of the float ``model`` on the calibration text."""
    return input_hessians(model, calibration_token_ids(tokenizer), show_progress=show_progress)


def calibration_text(stdlib: Path | None = None) -> str:
    """The module docstrings of the standard library at ``stdlib`` (the running Python's by
    default), in sorted file order."""
    root = Path(sysconfig.get_paths()["stdlib"]) if stdlib is None else stdlib
    docstrings = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a file this Python cannot parse (test data): not prose anyway
        docstring = ast.get_docstring(tree)
        if docstring is not None and len(docstring) >= MIN_DOCSTRING_CHARS:
            docstrings.append(docstring)
    return "\n\n".join(docstrings)


def calibration_token_ids(tokenizer: Tokenizer, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    token_ids = tokenizer.encode(calibration_text(), add_special_tokens=False)
    if len(token_ids) < num_tokens:
        raise ValueError(f"the calibration text has {len(token_ids)} tokens, {num_tokens} asked")
    return token_ids[:num_tokens]


@torch.inference_mode()
def input_hessians(
    model: CausalLM,
    token_ids: list[int],
    window: int = CALIBRATION_WINDOW,
    show_progress: bool = False,
) -> dict[str, torch.Tensor]:
    """``2 X X^T / num_tokens`` (float32 ``[K, K]``, on the model's device) of every decoder
    linear's inputs over ``token_ids`` cut into prompts of ``window``, under the checkpoint
    name of each weight the linear holds."""
    sums: dict[str, torch.Tensor] = {}
    linears = {name: module for name, module in model.named_modules() if _is_decoder_linear(name)}

    def accumulate(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...], object], None]:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: object) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()  # [num_tokens, K]
            moment = (x.T @ x).double()  # a prompt's sum in float32, the prompts' in float64
            if name in sums:
                sums[name] += moment
            else:
                sums[name] = moment

        return hook

    handles = [module.register_forward_hook(accumulate(name)) for name, module in linears.items()]
    try:
        prompts = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
        for prompt in _progress(prompts, show_progress):
            _prefill(model, prompt)
    finally:
        for handle in handles:
            handle.remove()
    hessians: dict[str, torch.Tensor] = {}
    for name, total in sums.items():
        hessian = (2 * total / len(token_ids)).float()
        prefix, module_name = name.rsplit(".", 1)
        for part in _PARTS[module_name]:
            hessians[f"{prefix}.{part}.weight"] = hessian
    return hessians


def _is_decoder_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[-1] in _PARTS


def _prefill(model: CausalLM, tokens: list[int]) -> None:
    """``tokens`` as one prompt on a private KV cache (the outputs are not needed)."""
    config, device = model.config, model.device
    num_tokens = len(tokens)
    num_blocks = -(-num_tokens // KV_BLOCK_SIZE)
    shape = (num_blocks, KV_BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    kv_caches = [
        (
            torch.zeros(shape, dtype=model.dtype, device=device),
            torch.zeros(shape, dtype=model.dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]
    int32 = torch.int32
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros((0, 0), dtype=int32, device=device),
        decode_seq_lens=torch.zeros(0, dtype=int32, device=device),
        prefill_block_tables=torch.arange(num_blocks, dtype=int32, device=device)[None],
        prefill_cu_seqlens_q=torch.tensor([0, num_tokens], dtype=int32, device=device),
        prefill_seq_lens=torch.tensor([num_tokens], dtype=int32, device=device),
        max_prefill_seq_len=num_tokens,
        max_prefill_query_len=num_tokens,
    )
    positions = torch.arange(num_tokens, device=device)
    model(torch.tensor(tokens, device=device), positions, kv_caches, metadata)


def _progress(prompts: list[list[int]], show_progress: bool) -> Iterator[list[int]]:
    if not show_progress:
        yield from prompts
        return
    columns = (
        TextColumn("[bold]Calibrating (gptq)"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("prompts"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task("calibrate", total=len(prompts))
        for prompt in prompts:
            yield prompt
            progress.advance(task)
