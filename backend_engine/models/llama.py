"""One decoder-only transformer for Llama, Qwen2 and Mistral checkpoints.

    tokens -> embed -> N x [RMSNorm -> attention (RoPE, paged KV) -> +residual
                            RMSNorm -> SwiGLU MLP                 -> +residual] -> RMSNorm

Each "+residual" is computed together with the RMSNorm after it (:mod:`kernels.rms_norm`,
one fused pass on CPU), so a layer returns its MLP output and the residual stream side by
side, and the next layer (or the final norm) adds them. The three architectures differ only
in config values (Qwen2 has q/k/v biases). The batch is packed and flat (see
:class:`AttentionMetadata`): every tensor below is per token, and the paged-attention
kernels handle the per-sequence structure. Module names follow the Hugging Face
checkpoints, except that q/k/v and gate/up are fused into one matmul each at load time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from backend_engine.model_loader.weights import check_weight_names
from backend_engine.models.attention_metadata import AttentionMetadata
from backend_engine.models.linear_assembly import LinearAssembler, Shard
from backend_engine.models.packed_linear import PackedLinear
from backend_engine.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
from backend_engine.models.rotary import RotaryEmbedding
from kernels import cpu_decoder, rms_norm
from kernels.cpu_decoder import (
    DecoderShape,
    LayerWeights,
    LinearWeight,
    NativeDecoder,
    TokenTables,
)
from kernels.cpu_quant_linear import GGUFBlockWeight
from kernels.rotary import apply_rotary
from model_files.model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # 2 x [num_blocks, block_size, num_kv_heads, head_dim]

# checkpoint name part -> (fused parameter name part, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Buffers some older checkpoints saved; recomputed here, so ignored.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        return rms_norm.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, residual + x), both [num_tokens, hidden]
        """Add ``x`` to the residual stream and normalise the sum (one fused pass on CPU);
        ``residual`` may be updated in place."""
        return rms_norm.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.shard_sizes = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]
        self.qkv_proj = nn.Linear(
            config.hidden_size, sum(self.shard_sizes), bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.shard_sizes[0], config.hidden_size, bias=False, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # [tokens, q+k+v heads, d]
        # Queries and keys rotate together (in place on CPU); q and k are views of the result.
        qk = apply_rotary(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        key_cache, value_cache = kv_cache
        kernels.store_kv(k, v, key_cache, value_cache, md.slot_mapping)

        num_decode = md.num_decode_tokens
        if num_decode == num_tokens:
            out = kernels.paged_decode_attention(
                q, key_cache, value_cache, md.decode_block_tables, md.decode_seq_lens, self.scale
            )
        elif num_decode == 0:
            out = self._prefill(q, key_cache, value_cache, md)
        else:
            out = torch.cat(
                [
                    kernels.paged_decode_attention(
                        q[:num_decode],
                        key_cache,
                        value_cache,
                        md.decode_block_tables,
                        md.decode_seq_lens,
                        self.scale,
                    ),
                    self._prefill(q[num_decode:], key_cache, value_cache, md),
                ]
            )
        # out: [num_tokens, num_heads, head_dim]
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))

    def _prefill(
        self,
        q: torch.Tensor,  # [num_prefill_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [num_prefill_tokens, num_heads, head_dim]
        return kernels.paged_prefill_attention(
            q,
            key_cache,
            value_cache,
            md.prefill_block_tables,
            md.prefill_cu_seqlens_q,
            md.prefill_seq_lens,
            self.scale,
        )


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # 2 x [num_tokens, intermediate]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]: the last layer's output, or the embeddings
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None before the first layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, the residual stream)
        """The residual stream is carried beside the layers' outputs, so each add fuses with
        the RMSNorm after it: ``residual + h`` is what Hugging Face's layer returns."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        x = self.self_attn(x, cos, sin, kv_cache, md)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual

    def native_weights(self, kv_cache: KVCache) -> LayerWeights | None:
        """This layer as :mod:`kernels.cpu_decoder` reads it, or ``None`` unless its four
        linears run a native kernel (oneDNN-packed float32 or GGUF blocks) and only q/k/v
        have a bias."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        qkv, o, gate_up, down = (_native_linear(linear) for linear in linears)
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        if any(linear.bias is not None for linear in linears[1:]):
            return None
        key_cache, value_cache = kv_cache
        return LayerWeights(
            input_norm=self.input_layernorm.weight.detach(),
            qkv=qkv,
            qkv_bias=attn.qkv_proj.bias,
            o=o,
            post_norm=self.post_attention_layernorm.weight.detach(),
            gate_up=gate_up,
            down=down,
            key_cache=key_cache,
            value_cache=value_cache,
        )


def _native_linear(linear: nn.Module) -> LinearWeight | None:
    if isinstance(linear, PackedLinear):
        return linear.native_weight
    if isinstance(linear, QuantizedLinear):
        return linear.native_segments
    return None


class Backbone(nn.Module):
    """The ``model.`` prefix of checkpoint names."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            [DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    """Parameters are uninitialised until :meth:`load_weights` fills them.

    With ``lazy_linears`` the linears and the embedding are not allocated at all: each is
    built when its weights arrive (:mod:`backend_engine.models.linear_assembly`), quantized
    if they come quantized, so a quantized model never holds its weights in float."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        lazy_linears: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.lazy_linears = lazy_linears
        with torch.device("meta"):
            self.model = Backbone(config, dtype)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if lazy_linears:
            for module in self.modules():
                if not isinstance(module, nn.Linear | nn.Embedding):
                    module.to_empty(device=device, recurse=False)
        else:
            self.to_empty(device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling, device
        )
        # Decode-only steps' layers in one native call (see bind_native_decoder).
        self.native_decoder: NativeDecoder | None = None
        self._native_kv_caches: Sequence[KVCache] | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: Sequence[KVCache],  # one per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] after the final norm
        cos, sin = self.rotary(positions, self.dtype)  # 2 x [num_tokens, 1, head_dim // 2]
        h = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        md = attn_metadata
        if self._runs_natively(kv_caches, md, h.shape[0]):
            assert self.native_decoder is not None
            return self.native_decoder(
                h, cos, sin, md.slot_mapping, md.decode_block_tables, md.decode_seq_lens
            )
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, cos, sin, kv_cache, attn_metadata)
        if residual is None:  # no layers
            return self.model.norm(h)
        return self.model.norm.add_and_norm(h, residual)[0]

    @torch.inference_mode()
    def forward_logits(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: Sequence[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, vocab] float32
        """Every token's logits: ``compute_logits(forward(...))``, as one native call (the
        layers and the output projection) where the step is the native decoder's and it has
        the output projection bound. For steps whose every row is sampled (decodes)."""
        md = attn_metadata
        decoder = self.native_decoder
        if decoder is None or decoder.output is None:
            return self.compute_logits(self(input_ids, positions, kv_caches, md))
        if not self._runs_natively(kv_caches, md, input_ids.shape[0]):
            return self.compute_logits(self(input_ids, positions, kv_caches, md))
        cos, sin = self.rotary(positions, self.dtype)
        h = self.model.embed_tokens(input_ids)
        return decoder(
            h, cos, sin, md.slot_mapping, md.decode_block_tables, md.decode_seq_lens, logits=True
        )

    def native_decode_run(
        self,
        kv_caches: Sequence[KVCache],
        input_ids: torch.Tensor,  # [num_seqs] int64: each sequence's last token
        slots: torch.Tensor,  # [num_steps, num_seqs] int64
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        seq_lens: torch.Tensor,  # [num_steps, num_seqs] int32
    ) -> torch.Tensor | None:  # [num_steps, num_seqs] int64, or None: not natively
        """A greedy decode run as one native call, each step from token ids to argmax
        (``NativeDecoder.decode_run``), where the decoder has the embedding, the rotary table
        and the output projection bound to these caches; ``None`` otherwise."""
        decoder = self.native_decoder
        if decoder is None or decoder.tokens is None or kv_caches is not self._native_kv_caches:
            return None
        if not 0 < input_ids.shape[0] <= cpu_decoder.MAX_TOKENS:
            return None
        return decoder.decode_run(input_ids, slots, block_tables, seq_lens)

    def _token_tables(self) -> TokenTables | None:
        """The embedding and rotary table as a native decoder reads them, if it can."""
        embedding = self.model.embed_tokens
        table: torch.Tensor | GGUFBlockWeight
        if isinstance(embedding, QuantizedEmbedding):
            table = embedding.weight
        elif isinstance(embedding, nn.Embedding) and embedding.weight.dtype == torch.float32:
            table = embedding.weight.detach()
        else:
            return None
        cos_sin = self.rotary.cos_sin
        if cos_sin.dtype != torch.float32 or self.dtype != torch.float32:
            return None
        return TokenTables(table, cos_sin)

    def _runs_natively(
        self, kv_caches: Sequence[KVCache], md: AttentionMetadata, num_tokens: int
    ) -> bool:
        """Whether a step runs on the native decoder: decodes only, few enough, on the
        caches it is bound to."""
        return (
            self.native_decoder is not None
            and kv_caches is self._native_kv_caches
            and 0 < md.num_decode_tokens == num_tokens <= cpu_decoder.MAX_TOKENS
        )

    def bind_native_decoder(self, kv_caches: Sequence[KVCache]) -> bool:
        """Run decode-only steps of up to ``kernels.cpu_decoder.MAX_TOKENS`` sequences on
        ``kv_caches`` as one native call (:mod:`kernels.cpu_decoder`), when the model fits it:
        float32 activations on the CPU, every linear on a native kernel (oneDNN-packed float32,
        see ``packed_linear``, or a GGUF file's blocks, see ``quantized_linear``), float32 or
        int8 KV caches; the output projection too, when it runs on one (``forward_logits``).
        Returns whether it does; other steps run layer by layer."""
        decoder_layers = cast(Sequence[DecoderLayer], self.model.layers)
        layers = [
            layer.native_weights(kv_cache)
            for layer, kv_cache in zip(decoder_layers, kv_caches, strict=True)
        ]
        if not all(layers):
            return False
        c = self.config
        shape = DecoderShape(
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        )
        self.native_decoder = NativeDecoder.build(
            [layer for layer in layers if layer is not None],
            self.model.norm.weight.detach(),
            shape,
            _native_linear(self.lm_head),
            self._token_tables(),
        )
        self._native_kv_caches = kv_caches if self.native_decoder is not None else None
        return self.native_decoder is not None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Shard]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up as they arrive; with
        ``lazy_linears``, build the linears and the embedding from their (quantized or float)
        weights instead."""
        params = dict(self.named_parameters())
        expected = self._checkpoint_names()
        loaded: set[str] = set()
        unexpected: set[str] = set()
        assembler = LinearAssembler(
            self,
            self.dtype,
            self.device,
            _FUSED,
            {fused: self._shard_sizes(fused) for fused in ("qkv_proj", "gate_up_proj")},
        )
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the output projection
            if name in expected and self.lazy_linears and assembler.take(name, tensor):
                loaded.add(name)
                continue
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"tensor {name} is quantized; only linears can take that")
            target = self._target(name, params)
            if target is None or name not in expected:
                unexpected.add(name)
                continue
            if target.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
        check_weight_names(expected - loaded, unexpected)
        assembler.finish()
        if self.lazy_linears and self.config.tie_word_embeddings:
            self._tie_output_projection()

    def _tie_output_projection(self) -> None:
        embedding = self.model.embed_tokens
        if isinstance(embedding, QuantizedEmbedding):
            self.lm_head = QuantizedLinear([embedding.weight], None)
            (shared,) = self.lm_head.segments  # maybe tiled: one copy serves both
            assert isinstance(shared, GGUFBlockWeight)
            embedding.weight = shared
        else:
            lm_head = nn.Linear(
                self.config.hidden_size, self.config.vocab_size, bias=False, device="meta"
            )
            lm_head.weight = embedding.weight
            self.lm_head = lm_head

    def _target(self, name: str, params: dict[str, nn.Parameter]) -> torch.Tensor | None:
        """The (slice of the) parameter a checkpoint tensor goes into, or None if unknown."""
        parts = name.split(".")
        fused = _FUSED.get(parts[-2]) if len(parts) >= 2 else None
        if fused is None:
            return params.get(name)
        fused_name, shard = fused
        param = params.get(".".join([*parts[:-2], fused_name, parts[-1]]))
        if param is None:
            return None
        sizes = self._shard_sizes(fused_name)
        return param.narrow(0, sum(sizes[:shard]), sizes[shard])

    def _shard_sizes(self, fused_name: str) -> list[int]:
        if fused_name == "gate_up_proj":
            return [self.config.intermediate_size] * 2
        c = self.config
        return [c.num_attention_heads * c.head_dim] + [c.num_key_value_heads * c.head_dim] * 2

    def _checkpoint_names(self) -> set[str]:
        """Every tensor name the checkpoint must provide (the unfused HF names)."""
        names: set[str] = set()
        for name, _ in self.named_parameters():
            *prefix, module, leaf = name.split(".")
            sources = [k for k, (fused, _) in _FUSED.items() if fused == module] or [module]
            names.update(".".join([*prefix, source, leaf]) for source in sources)
        return names
