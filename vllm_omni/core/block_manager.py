"""Fixed-size KV blocks with ref counts and hash-chained prefix caching.

A full block is identified by the hash of (hash of the previous block, its token
ids), so a hit on block i implies hits on blocks 0..i-1. Freed blocks keep their
hash and stay findable until they are reused (LRU eviction from the free queue).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from vllm_omni.core.request import Request


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    # sha256 rather than Python's hash(): a collision would silently reuse wrong KV.
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        # Blocks with ref count 0, least recently freed first (evicted first).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache ---------------------------------------------------------
    def _request_block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, request.token_ids[i * bs : (i + 1) * bs]))
        return hashes[:num_full_blocks]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request.

        At least one token is always left to compute, so the step produces logits.
        """
        if not (self.enable_prefix_caching and request.cacheable):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self._request_block_hashes(request, max_blocks):
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # --- allocation -----------------------------------------------------------
    def has_room(self, request: Request, num_new_tokens: int) -> bool:
        """The request's blocks already hold `num_new_tokens` more (most decode steps)."""
        return request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * self.block_size

    def allocate(self, request: Request, num_new_tokens: int, cached_prefix: list[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after taking the cached
        prefix blocks, if any). Returns False, changing nothing, if the pool is too small."""
        total_tokens = request.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens) - len(request.block_ids) - len(cached_prefix)
        # Cached blocks that sit in the free queue stop being free when taken.
        num_revived = sum(1 for b in cached_prefix if self.ref_counts[b] == 0)
        if num_new_blocks + num_revived > self.num_free_blocks:
            return False
        for block_id in cached_prefix:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1
        request.block_ids.extend(cached_prefix)
        request.num_hashed_blocks = len(request.block_ids)
        for _ in range(max(num_new_blocks, 0)):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            if self.cached.get(block_hash) == block_id:
                del self.cached[block_hash]
            self.block_hash[block_id] = None

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not (self.enable_prefix_caching and request.cacheable):
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_hashed_blocks:
            return
        hashes = self._request_block_hashes(request, num_full)
        for i in range(request.num_hashed_blocks, num_full):
            block_id = request.block_ids[i]
            # Same content computed twice concurrently: keep the first copy findable.
            if hashes[i] not in self.cached and self.block_hash[block_id] is None:
                self.cached[hashes[i]] = block_id
                self.block_hash[block_id] = hashes[i]
        request.num_hashed_blocks = num_full

    def free(self, request: Request) -> None:
        # Reverse order: a request's tail blocks are the least likely to be shared,
        # so they are evicted before its head blocks.
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
                if self.block_hash[block_id] is None:
                    # Nothing to find in it later: reuse it first.
                    self.free_queue.move_to_end(block_id, last=False)
        request.block_ids = []
        request.num_hashed_blocks = 0
