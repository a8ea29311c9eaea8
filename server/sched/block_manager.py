"""Paged KV block manager: ref-counted blocks, prefix caching of full blocks (a chain of keys), lazy
LRU eviction. Block 0 is reserved as the agents' write target for padding.

A full block's key is SHA-256 of its parent's key and its token ids, the chain rooted in a salt
naming what else changes the KV (model, dtypes): an accidental or crafted collision of Python's
`hash()` would serve KV computed for other text (vLLM moved to SHA-256 for this). A hit is also
checked against the block's own tokens and its parent's key, kept beside it, so even a colliding key
never reuses a block whose prefix differs (SGLang's radix tree compares tokens the same way)."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable

Key = bytes
ROOT = b""


def sha256_key(parent: Key, tokens: tuple[int, ...]) -> Key:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()  # 64-bit ids: no id is cut


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, salt: str = "",
                 key: Callable[[Key, tuple[int, ...]], Key] = sha256_key):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.key, self.root = key, hashlib.sha256(salt.encode()).digest()
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))
        self.refs = [0] * num_blocks
        self.hash_of: dict[int, Key] = {}  # block -> key of the full block's token chain
        self.by_hash: dict[Key, int] = {}  # key -> block
        self.content: dict[int, tuple[Key, tuple[int, ...]]] = {}  # block -> (its parent's key, its tokens)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def usage(self) -> float:
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def blocks_needed(self, table: list[int], length: int) -> int:
        return max(0, -(-length // self.block_size) - len(table))

    def _take(self) -> int:
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.by_hash[self.hash_of.pop(block)]
            del self.content[block]
        self.refs[block] = 1
        return block

    def _block(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size:(i + 1) * self.block_size])

    def root_of(self, adapter: int) -> Key:
        """Where a chain starts: the server's salt, and the LoRA adapter (KV is never shared across adapters)."""
        return self.root if not adapter else hashlib.sha256(self.root + b"lora" + adapter.to_bytes(8, "little")).digest()

    def chain_hashes(self, tokens: list[int], known: list[Key] | None = None, adapter: int = 0) -> list[Key]:
        """Key chain of the full blocks of `tokens` (under `adapter`). `known` (a sequence's cache, a
        prefix of the answer) is extended in place, so a growing sequence hashes each block once."""
        out = known if known is not None else []
        parent = out[-1] if out else self.root_of(adapter)
        for i in range(len(out), len(tokens) // self.block_size):
            parent = self.key(parent, self._block(tokens, i))
            out.append(parent)
        return out

    def match_prefix(self, tokens: list[int], adapter: int = 0) -> list[int]:
        """Take references on cached full blocks that prefix `tokens`; at least one token is left to
        compute, so the last block is never taken when the whole prompt is cached."""
        if not self.prefix_caching:
            return []
        hashes, root = self.chain_hashes(tokens[:len(tokens) - 1], adapter=adapter), self.root_of(adapter)
        table: list[int] = []
        for i, h in enumerate(hashes):
            block = self.by_hash.get(h)
            if block is None or self.content[block] != (hashes[i - 1] if i else root, self._block(tokens, i)):
                break
            if self.refs[block] == 0:
                self.evictable.pop(block, None)
            self.refs[block] += 1
            table.append(block)
        return table

    def cached(self, hashes: list[Key]) -> int:
        """How many of a key chain's first blocks this cache holds, taking no references: where a
        request would find most of its prompt (server/engine/routing.py). Its admission checks the
        blocks' tokens as match_prefix does."""
        n = 0
        while n < len(hashes) and hashes[n] in self.by_hash:
            n += 1
        return n

    def grow(self, table: list[int], length: int) -> bool:
        """Extend `table` to hold `length` tokens; False (and no change) if blocks run out."""
        need = self.blocks_needed(table, length)
        if need > self.num_free:
            return False
        table.extend(self._take() for _ in range(need))
        return True

    def register_full(self, table: list[int], tokens: list[int], computed: int, hashes: list[Key],
                      adapter: int = 0) -> None:
        """Publish the computed full blocks of a sequence for prefix reuse; `hashes` is the
        sequence's chain-hash cache (see chain_hashes)."""
        if not self.prefix_caching:
            return
        full = computed // self.block_size
        if len(hashes) < full:
            self.chain_hashes(tokens[:full * self.block_size], hashes, adapter)
        for i, (block, h) in enumerate(zip(table[:full], hashes)):
            if block not in self.hash_of and h not in self.by_hash:
                self.hash_of[block], self.by_hash[h] = h, block
                self.content[block] = (hashes[i - 1] if i else self.root_of(adapter), self._block(tokens, i))

    def release(self, table: list[int]) -> None:
        for block in table:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        table.clear()
