"""Chained hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its token ids and any extra keys that
change the KV (the request's cache salt, its LoRA adapter's name), so two equal
hashes mean two equal prefixes. Hashes are full 32-byte SHA-256 digests of a
msgpack encoding: deterministic across processes and runs (unlike Python's
`hash()`), and collision-free in practice, so a lookup never compares token
ids. Only full blocks are hashed.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

BlockHash = bytes

# The parent of every sequence's first block. Fixed, so hashes agree between
# scheduler restarts (and could be shared between replicas).
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"pagedserve/prefix-cache/v1").digest()

_encoder = msgspec.msgpack.Encoder()


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """The hash of one full block given its parent's hash."""
    payload = _encoder.encode((parent_hash, list(token_ids), list(extra_keys)))
    return hashlib.sha256(payload).digest()


def block_extra_keys(block_index: int, cache_salt: str | None, lora_name: str | None = None) -> tuple:
    """What besides the tokens goes into block `block_index`'s hash.

    The salt and the adapter only need to enter the first block: every later hash
    chains them. An empty salt means no salt (same namespace as requests without one);
    the adapter is tagged so that no salt can equal it.
    """
    if block_index != 0:
        return ()
    keys: tuple = (cache_salt,) if cache_salt else ()
    return keys + (("lora", lora_name),) if lora_name else keys


def lora_cache_key(lora_request) -> str | None:
    """What keys a LoRA request's blocks: its adapter's name, path and id (a name reloaded, from
    another path or the same, gets a new id: another adapter); None without one."""
    if lora_request is None:
        return None
    return f"{lora_request.lora_name}\x00{lora_request.lora_path}\x00{lora_request.lora_int_id}"


def image_extra_keys(start: int, end: int, images: Sequence[tuple[int, int, str]]) -> tuple:
    """The content hashes of the images (offset, length, hash) whose placeholder tokens fall
    in [start, end): a placeholder id alone says nothing of the image behind it."""
    return tuple(content_hash for offset, length, content_hash in images if offset < end and offset + length > start)


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None, images: Sequence[tuple[int, int, str]] = (),
                        lora_name: str | None = None) -> None:
    """Append hashes for every block of `token_ids` that became full since the
    last call (`block_hashes` holds the hashes of the leading full blocks).
    `images`: (offset, length, content hash) of the prompt's image placeholders."""
    num_full_blocks = len(token_ids) // block_size
    for index in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[index - 1] if index else ROOT_BLOCK_HASH
        start = index * block_size
        extra = block_extra_keys(index, cache_salt, lora_name)
        if images:
            extra += image_extra_keys(start, start + block_size, images)
        block_hashes.append(hash_block_tokens(parent, token_ids[start:start + block_size], extra))
