"""The prefix cache's block hash: one chain hash per full block of token ids.

The engine keys its prefix cache by it, and a gateway computes a prompt's chain with this same
function (seeded with the ``extra_key`` an engine's ``/kv_events`` snapshot gives) to find
which replica holds the prompt's leading blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes) -> BlockHash:
    """Chain hash of one full block: parent hash, the block's tokens, extra key.

    The extra key (e.g. the model's identity) only seeds the first block: every
    later hash depends on it through the chain.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent if parent is not None else b"root:" + extra_key)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()
