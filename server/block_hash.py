"""The identity of a full KV block, shared by the engine's prefix cache and the router's prefix index (the
router must name a prompt's blocks exactly as the replica will)."""

from __future__ import annotations

import hashlib
from array import array


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Identity of a full block: a 128-bit BLAKE2b digest of its parent's hash and its token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def lora_hash_root(digest: str) -> bytes:
    """The parent hash of the first block of a request under the LoRA adapter whose files have `digest`
    (`model.lora.adapter_digest`), so a prefix computed under one adapter (its K/V depends on the
    adapter's weights and scaling) is never reused under another, under the base model (whose first
    blocks have no parent), or under the same name after its files changed."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"lora\0" + digest.encode())
    return h.digest()


def rope_hash_root(parent_hash: bytes | None, rope_key: int) -> bytes:
    """The parent hash of the first block of a request whose rotary angles depend on its length
    (`ModelShape.rope_cache_key`), below its adapter's root (`parent_hash`, None for the base model):
    K/V computed with one table (LongRoPE's short or long factors, dynamic NTK's base for one length)
    is never reused by a request that computes it with another."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"root")
    h.update(b"rope\0" + str(rope_key).encode())
    return h.digest()
