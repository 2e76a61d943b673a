"""Build a model's linears and embedding from quantized or float shards as they arrive.

Why: a model loaded with quantized weights must never hold them in float. Its linears and
embedding are left unallocated (on PyTorch's ``meta`` device) when the model is built; each
one is made here once every shard it needs has arrived (q, k and v for a fused q/k/v; a
bias beside each weight shard when the module has one):

- every weight shard quantized: a :class:`QuantizedLinear` (or :class:`QuantizedEmbedding`);
- any shard float (a GGUF file's F16 tensor beside quantized ones, a tensor that could not
  be quantized): every shard widened to the model's dtype, a plain ``nn.Linear``, which the
  CPU runner packs for oneDNN as usual.

Shards are held only until their module is complete; checkpoints store a layer's tensors
together, so at most about one layer's weights wait at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from backend_engine.models.quantized_linear import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedTensor,
    dequantize,
)
from kernels.cpu_quant_linear import GGUFBlockWeight

Shard = torch.Tensor | QuantizedTensor


@dataclass
class _PendingModule:
    num_shards: int
    has_bias: bool
    weights: dict[int, Shard] = field(default_factory=dict)
    biases: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def is_complete(self) -> bool:
        return len(self.weights) == self.num_shards and (
            not self.has_bias or len(self.biases) == self.num_shards
        )


class LinearAssembler:
    """Takes the shards of a model's unallocated linears and embedding, and puts each module
    in place when it is complete. ``shard_sizes(fused_name)`` gives a fused module's shards'
    row counts; ``fused`` maps a checkpoint name part to (fused name part, shard index)."""

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype,
        device: torch.device,
        fused: dict[str, tuple[str, int]],
        shard_sizes: dict[str, list[int]],
    ) -> None:
        self._model = model
        self._dtype = dtype
        self._device = device
        self._fused = fused
        self._shard_sizes = shard_sizes
        self._pending: dict[str, _PendingModule] = {}

    def take(self, name: str, value: Shard) -> bool:
        """Whether ``name`` belongs to an unallocated linear or embedding (then it is held,
        and its module built once complete); ``False`` for every other tensor."""
        parts = name.split(".")
        if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
            return False
        fused = self._fused.get(parts[-2])
        module_parts = [*parts[:-2], fused[0]] if fused is not None else parts[:-1]
        module_name = ".".join(module_parts)
        module = _submodule(self._model, module_name)
        if not isinstance(module, nn.Linear | nn.Embedding) or not module.weight.is_meta:
            return False
        shard = 0 if fused is None else fused[1]
        pending = self._pending.get(module_name)
        if pending is None:
            num_shards = len(self._shard_sizes[fused[0]]) if fused is not None else 1
            has_bias = isinstance(module, nn.Linear) and module.bias is not None
            pending = self._pending[module_name] = _PendingModule(num_shards, has_bias)
        self._check_shape(name, module, value, shard, fused)
        if parts[-1] == "bias":
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"tensor {name} is a bias and must be float")
            pending.biases[shard] = value
        else:
            pending.weights[shard] = value
        if pending.is_complete:
            self._build(module_name, module, self._pending.pop(module_name))
        return True

    def finish(self) -> None:
        """Raise if a module got only some of its shards."""
        if self._pending:
            raise ValueError(
                "checkpoint does not match the model config; incomplete modules: "
                + ", ".join(sorted(self._pending))
            )

    def _check_shape(
        self,
        name: str,
        module: nn.Module,
        value: Shard,
        shard: int,
        fused: tuple[str, int] | None,
    ) -> None:
        is_bias = name.endswith(".bias")
        if isinstance(module, nn.Embedding):
            full = (module.num_embeddings, module.embedding_dim)
        else:
            assert isinstance(module, nn.Linear)
            full = (module.out_features, module.in_features)
        rows = self._shard_sizes[fused[0]][shard] if fused is not None else full[0]
        want = (rows,) if is_bias else (rows, full[1])
        got = (
            tuple(value.shape)
            if isinstance(value, torch.Tensor)
            else (value.out_features, value.in_features)
        )
        if got != want:
            raise ValueError(f"tensor {name} has shape {got}, the config implies {want}")

    def _build(self, module_name: str, module: nn.Module, pending: _PendingModule) -> None:
        weights = [pending.weights[i] for i in range(pending.num_shards)]
        bias = (
            torch.cat([pending.biases[i] for i in range(pending.num_shards)]).to(
                self._dtype, copy=False
            )
            if pending.has_bias
            else None
        )
        quantized = [w for w in weights if not isinstance(w, torch.Tensor)]
        built: nn.Module
        if isinstance(module, nn.Embedding):
            (weight,) = weights
            if isinstance(weight, GGUFBlockWeight):
                built = QuantizedEmbedding(weight, self._dtype)
            else:
                built = nn.Embedding.from_pretrained(self._float(weight), freeze=True)
        elif len(quantized) == len(weights):
            built = QuantizedLinear(quantized, None if bias is None else bias.to(self._device))
        else:
            built = _float_linear(torch.cat([self._float(w) for w in weights]), bias, self._device)
        parent_name, _, child = module_name.rpartition(".")
        setattr(_submodule(self._model, parent_name), child, built)

    def _float(self, weight: Shard) -> torch.Tensor:
        values = weight if isinstance(weight, torch.Tensor) else dequantize(weight)
        return values.to(device=self._device, dtype=self._dtype)


def _float_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device
) -> nn.Linear:
    out_features, in_features = weight.shape
    with torch.device("meta"):
        linear = nn.Linear(in_features, out_features, bias=bias is not None, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(device), requires_grad=False)
    return linear


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return None
