"""Small synthetic GGUF files, written with ``gguf.GGUFWriter`` as llama.cpp's converter
lays them out: its tensor names, q/k rows permuted (llama), 2-D weights in the chosen type,
and, when asked for, a byte-level BPE tokenizer that ``transformers`` can read too."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2
HEAD_DIM = HIDDEN // HEADS
CONTEXT = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1 (bos), 2 (eos)
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e", "Ġ s", "a t")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TOKENS = [*SPECIAL_TOKENS, *byte_level_alphabet(), *(m.replace(" ", "") for m in MERGES)]
VOCAB = len(TOKENS)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter (``LlamaModel.permute``), written out independently."""
    shape = weight.shape
    return (
        weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def hf_tensors(
    *, tied: bool = False, bias: bool = False, seed: int = 0, scale: float = 1.0
) -> dict[str, np.ndarray]:
    """A random model's tensors under Hugging Face names, in Hugging Face layout."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": w(HIDDEN)}
    if not tied:
        tensors["lm_head.weight"] = w(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": w(HIDDEN),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "post_attention_layernorm.weight": w(HIDDEN),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
            p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
        }
        if bias:
            tensors |= {
                p + "self_attn.q_proj.bias": w(HEADS * HEAD_DIM),
                p + "self_attn.k_proj.bias": w(KV_HEADS * HEAD_DIM),
                p + "self_attn.v_proj.bias": w(KV_HEADS * HEAD_DIM),
            }
    return tensors


def llama_cpp_name(name: str) -> str:
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in names:
        return names[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    module, _, kind = rest.rpartition(".")
    short = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    return f"blk.{layer}.{short[module]}.{kind}"


def write_gguf(
    path: Path,
    tensors: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    qtype: Q = Q.F32,
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
    tokenizer_pre: str | None = None,
    add_bos_token: bool = False,
) -> Path:
    """``tensors`` (HF names, HF layout) as llama.cpp's converter writes them: its names,
    q/k rows permuted for llama, 2-D weights in ``qtype`` (norms and biases stay F32);
    ``raw`` adds tensors as given (llama.cpp name: (bytes or values, type)).
    ``tokenizer_pre`` adds a byte-level BPE tokenizer (``TOKENS``, ``MERGES``, special
    tokens, a ChatML template) with that pre-tokenizer name."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(100_000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if tokenizer_pre is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(tokenizer_pre)
        writer.add_token_list(TOKENS)
        types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
        writer.add_token_types(types + [gguf.TokenType.NORMAL] * (VOCAB - len(types)))
        writer.add_token_merges(list(MERGES))
        writer.add_add_bos_token(add_bos_token)
        writer.add_pad_token_id(2)
        writer.add_chat_template(CHAT_TEMPLATE)
    for name, values in tensors.items():
        if arch == "llama" and ".q_proj." in name:
            values = llama_cpp_permute(values, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            values = llama_cpp_permute(values, KV_HEADS)
        if values.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(
                llama_cpp_name(name), gguf.quants.quantize(values, qtype), raw_dtype=qtype
            )
        else:
            writer.add_tensor(llama_cpp_name(name), values)
    for name, (data, kind) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
