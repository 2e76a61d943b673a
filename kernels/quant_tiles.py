"""GGUF blocks regrouped sixteen rows at a time, the layout the fastest CPU kernel reads.

Why: ``kernels/csrc/quant_tiles.h`` takes one activation word against sixteen rows of W in
one AVX-512 VNNI instruction, with the sixteen rows' scales in one vector; that needs the
rows' blocks side by side. A tile holds exactly the bytes of the file's sixteen blocks, so
tiling costs no memory; it is done once, at load (:meth:`GGUFBlockWeight.tiled
<kernels.cpu_quant_linear.GGUFBlockWeight.tiled>`), and undone where the file's layout is
needed (writing a GGUF file, widening rows, an embedding's rows).

Layout of tile-block b (block b of rows 16t .. 16t + 15), for Q4_0, Q4_1 and Q8_0:
``fp16 d[16]``, then for Q4_1 ``fp16 m[16]``, then the quant bytes as 32-bit words
``q[G][16][4]``: word (g, j) is row j's quant bytes 4g .. 4g + 3 (G = 4 for the 4-bit types,
8 for Q8_0, whose bytes are stored XOR 0x80, that is q + 128 as unsigned). ``tiles`` is
uint8 ``[out_features / 16, in_features / 32 * 16 * block bytes]``.
"""

from __future__ import annotations

from functools import cache

import torch

TILE_ROWS = 16
TILED_TYPE_FLAG = 64  # quant_tiles.h's TILED_TYPE: the kernel's type id of a tiled weight
# ggml type id -> (bytes of a block's fp16 fields, bytes of its quants)
_FIELDS = {2: (2, 16), 3: (4, 16), 8: (2, 32)}  # Q4_0, Q4_1, Q8_0
_Q8_0 = 8


def is_tileable(quant_type: int, out_features: int) -> bool:
    """Whether a weight of this type and row count can be tiled."""
    return quant_type in _FIELDS and out_features % TILE_ROWS == 0


def tile(blocks: torch.Tensor, quant_type: int) -> torch.Tensor:
    """``blocks`` ([out_features, row bytes], the file's layout) as tiles."""
    fields, quants = _FIELDS[quant_type]
    num_tiles = blocks.shape[0] // TILE_ROWS
    raw = blocks.reshape(num_tiles, TILE_ROWS, -1, fields + quants)
    num_blocks = raw.shape[2]
    # [tile, row, block, field, byte] -> [tile, block, field, row, byte]
    scales = raw[..., :fields].reshape(num_tiles, TILE_ROWS, num_blocks, fields // 2, 2)
    words = raw[..., fields:].reshape(num_tiles, TILE_ROWS, num_blocks, quants // 4, 4)
    words = words.permute(0, 2, 3, 1, 4)
    if quant_type == _Q8_0:
        words = words ^ 0x80
    tiled = torch.cat(
        (
            scales.permute(0, 2, 3, 1, 4).reshape(num_tiles, num_blocks, -1),
            words.reshape(num_tiles, num_blocks, -1),
        ),
        dim=2,
    )
    return tiled.reshape(num_tiles, -1).contiguous()


def untile(tiles: torch.Tensor, quant_type: int) -> torch.Tensor:
    """Tiles back in the file's layout ``[out_features, row bytes]`` (a new tensor)."""
    blocks = _in_row_order(tiles, quant_type)
    if quant_type == _Q8_0:  # the quants, after each block's scale, back to signed
        fields, quants = _FIELDS[quant_type]
        blocks.reshape(blocks.shape[0], -1, fields + quants)[..., fields:] ^= 0x80
    return blocks


def rows_of(tiles: torch.Tensor, quant_type: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[n]``) in the file's layout, ``[n, row bytes]``: an embedding's
    tokens, gathered byte by byte from their tiles without untiling the rest."""
    tile_bytes = tiles.shape[1]
    at = (rows // TILE_ROWS * tile_bytes).unsqueeze(1) + _lane_offsets(quant_type, tile_bytes)[
        rows % TILE_ROWS
    ]
    picked = tiles.reshape(-1)[at]
    if quant_type == _Q8_0:
        fields, quants = _FIELDS[quant_type]
        picked.reshape(picked.shape[0], -1, fields + quants)[..., fields:] ^= 0x80
    return picked


@cache
def _lane_offsets(quant_type: int, tile_bytes: int) -> torch.Tensor:
    """``[16, row bytes]`` int64: where each byte of a tile's row j lies in the tile."""
    return _in_row_order(torch.arange(tile_bytes).reshape(1, -1), quant_type)


def _in_row_order(tiles: torch.Tensor, quant_type: int) -> torch.Tensor:
    """The tiles' elements (bytes, or anything laid out as they are) in the rows' order."""
    fields, quants = _FIELDS[quant_type]
    num_tiles = tiles.shape[0]
    raw = tiles.reshape(num_tiles, -1, TILE_ROWS * (fields + quants))
    num_blocks = raw.shape[1]
    scales = raw[..., : TILE_ROWS * fields].reshape(
        num_tiles, num_blocks, fields // 2, TILE_ROWS, 2
    )
    words = raw[..., TILE_ROWS * fields :].reshape(num_tiles, num_blocks, quants // 4, TILE_ROWS, 4)
    # [tile, block, field, row, byte] -> [tile, row, block, field, byte]
    blocks = torch.cat(
        (
            scales.permute(0, 3, 1, 2, 4).reshape(num_tiles, TILE_ROWS, num_blocks, fields),
            words.permute(0, 3, 1, 2, 4).reshape(num_tiles, TILE_ROWS, num_blocks, quants),
        ),
        dim=3,
    )
    return blocks.reshape(num_tiles * TILE_ROWS, -1)
