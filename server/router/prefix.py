"""Prefix residency per replica: which KV blocks of a prompt a replica likely holds.

A prompt's blocks are named exactly as the engine's prefix cache names them (`hash_block` chained over
full blocks of `block_size` tokens, server/engine/kv_cache.py), so "replica R holds block h" means R
can skip computing it. Two sources, kept in one index per replica:

- routed: the blocks of prompts this router sent to R, least recently routed evicted first, at most the
  replica's KV block count (the approximate mode of llm-d's prefix scorer);
- exact: the replica's own block stored/evicted events (`GET /v1/kv_events`), starting from a snapshot,
  so a router that restarts learns the residency again at once.

An evicted event removes a block from both, so a routed guess the replica has overwritten is dropped.
"""

from __future__ import annotations

from collections import OrderedDict

from conveyor.server.block_hash import hash_block


def block_hashes(token_ids: list[int], block_size: int, root: bytes | None = None) -> list[bytes]:
    """The hash chain of the full blocks of `token_ids` (a trailing partial block has no hash); `root`:
    the first block's parent, `lora_hash_root(digest)` under a LoRA adapter, as the engine's."""
    hashes: list[bytes] = []
    parent: bytes | None = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """The blocks one replica is believed to hold. `capacity`: the replica's KV block count."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self.routed: OrderedDict[bytes, None] = OrderedDict()
        self.stored: set[bytes] = set()
        self.exact = False  # True once the replica's event stream has given a snapshot

    def match(self, hashes: list[bytes]) -> int:
        """How many leading blocks of the chain `hashes` the replica holds."""
        for i, h in enumerate(hashes):
            if h not in self.stored and h not in self.routed:
                return i
        return len(hashes)

    def routed_to(self, hashes: list[bytes]) -> None:
        """Remember a prompt sent to this replica (its blocks become most recently used)."""
        for h in hashes:
            self.routed[h] = None
            self.routed.move_to_end(h)
        while len(self.routed) > self.capacity:
            self.routed.popitem(last=False)

    def apply_event(self, event: dict) -> None:
        """One event of `/v1/kv_events`: snapshot, stored, evicted or cleared."""
        kind = event.get("type")
        hashes = {bytes.fromhex(h) for h in event.get("hashes", ())}
        if kind == "snapshot":
            self.stored = hashes
            self.routed.clear()
            self.exact = True
            if event.get("num_blocks"):
                self.capacity = int(event["num_blocks"])
        elif kind == "stored":
            self.stored |= hashes
        elif kind == "evicted":
            self.stored -= hashes
            for h in hashes:
                self.routed.pop(h, None)
        elif kind == "cleared":
            self.stored.clear()
            self.routed.clear()
