"""Chained hashes of full KV blocks: the one implementation shared by the prefill
worker's prefix cache and the router's prefix index.

Block ``i`` of a token sequence (tokens ``[i*block_size, (i+1)*block_size)``) hashes
to a 64-bit unsigned integer that depends on the block's tokens AND on every block
before it::

    h_{-1} = root_hash(model_id)                       # the root sentinel
    h_i    = blake2b(le_u64(h_{i-1}) || le_i64(tok_0) || ... || le_i64(tok_{B-1}),
                     digest_size=8)  read as a little-endian uint64

so equal hashes mean equal prefixes (up to 2^-64 collisions), and the hash of a
block is the identity of "this prefix, up to the end of this block". Only FULL
blocks are hashed; a partial last block has no hash.

The root sentinel is ``blake2b(b"pdserve.kv_block.v1\\0" || utf8(model_id), digest_size=8)``:
a non-zero constant per model, so two models (or two tokenizers) that share a
cluster never share a hash. ``model_id=""`` is the default model.

A request's ``cache_salt`` (vLLM's: tenants that must not share cached prefixes give different salts) roots
its chain at :func:`salted_root` instead, so its blocks never hash equal to another salt's or an unsalted
request's.

The bytes are fixed (little-endian, int64 tokens, blake2b): values are the same in
every process and on every machine, unlike Python's salted ``hash()``. Changing
any of this is a wire-format change for the KV events (``docs/kv_events.md``).
The scheme is vLLM's automatic prefix caching (hash-chained blocks).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from functools import lru_cache

_ROOT_DOMAIN = b"pdserve.kv_block.v1\0"
_U64 = struct.Struct("<Q")


@lru_cache(maxsize=64)
def root_hash(model_id: str = "") -> int:
    """The parent hash of a sequence's first block for ``model_id`` (uint64)."""
    return int.from_bytes(hashlib.blake2b(_ROOT_DOMAIN + model_id.encode(), digest_size=8).digest(), "little")


_SALT_DOMAIN = b"pdserve.cache_salt.v1\0"


def salted_root(root: int, salt: str) -> int:
    """The parent hash of the first block of a request with ``cache_salt`` ``salt`` (``root``: the model's
    :func:`root_hash`): ``blake2b(domain || le_u64(root) || utf8(salt), digest_size=8)``; ``root`` for ""."""
    if not salt:
        return root
    return int.from_bytes(hashlib.blake2b(_SALT_DOMAIN + _U64.pack(root) + salt.encode(), digest_size=8).digest(),
                          "little")


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    """``H(parent, tokens)`` for one block (no length check: any number of tokens).

    Raises:
        OverflowError: ``parent`` is not a uint64 or a token does not fit an int64.
    """
    data = _U64.pack(parent) + _pack(tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None,
                 model_id: str = "") -> list[int]:
    """Chained hashes of every full block of ``token_ids``.

    Args:
        token_ids: the token sequence (ints in int64 range; a list, tuple, array or 1-D numpy array).
        block_size: tokens per block (> 0).
        parent: hash of the block just before ``token_ids[0]`` (to continue a chain);
            ``None`` = start of a sequence, i.e. :func:`root_hash` of ``model_id``.
        model_id: salt that separates models; ignored when ``parent`` is given.
    Returns:
        ``len(token_ids) // block_size`` uint64 hashes; element ``i`` covers blocks ``0..i``.
    Raises:
        ValueError: ``block_size`` is not positive.
        OverflowError: a token does not fit an int64.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(token_ids) // block_size
    if n == 0:
        return []
    h = root_hash(model_id) if parent is None else parent
    data = _pack(token_ids[: n * block_size])
    step = block_size * 8
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    out = []
    append = out.append
    for off in range(0, n * step, step):  # one C call per block: bytes concat beats hasher.update
        h = from_bytes(blake2b(h.to_bytes(8, "little") + data[off:off + step], digest_size=8).digest(), "little")
        append(h)
    return out


def _pack(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian int64 bytes."""
    if hasattr(tokens, "astype"):  # numpy: one C conversion
        return tokens.astype("<i8", copy=False).tobytes()
    a = array("q", tokens)
    if a.itemsize != 8:  # pragma: no cover - 'q' is 8 bytes on every supported platform
        raise RuntimeError("array('q') is not 64-bit here")
    if _BIG_ENDIAN:  # pragma: no cover
        a.byteswap()
    return a.tobytes()


_BIG_ENDIAN = struct.pack("=H", 1) == b"\x00\x01"
