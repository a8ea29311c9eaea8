"""Paged KV block manager: ref-counted blocks, prefix caching of full blocks (hash chain), lazy LRU
eviction. Block 0 is reserved as the agents' write target for padding."""
from __future__ import annotations

from collections import OrderedDict


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))
        self.refs = [0] * num_blocks
        self.hash_of: dict[int, int] = {}  # block -> hash of the full block's token chain
        self.by_hash: dict[int, int] = {}  # hash -> block
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
        self.refs[block] = 1
        return block

    def chain_hashes(self, tokens: list[int], known: list[int] | None = None) -> list[int]:
        """Hash chain of the full blocks of `tokens`. `known` (a sequence's cache, a prefix of the
        answer) is extended in place, so a growing sequence hashes each block once."""
        out = known if known is not None else []
        parent = out[-1] if out else 0
        for i in range(len(out), len(tokens) // self.block_size):
            parent = hash((parent, tuple(tokens[i * self.block_size:(i + 1) * self.block_size])))
            out.append(parent)
        return out

    def match_prefix(self, tokens: list[int]) -> list[int]:
        """Take references on cached full blocks that prefix `tokens`; at least one token is left to
        compute, so the last block is never taken when the whole prompt is cached."""
        if not self.prefix_caching:
            return []
        hashes = self.chain_hashes(tokens[:len(tokens) - 1])
        table = []
        for h in hashes:
            block = self.by_hash.get(h)
            if block is None:
                break
            if self.refs[block] == 0:
                self.evictable.pop(block, None)
            self.refs[block] += 1
            table.append(block)
        return table

    def grow(self, table: list[int], length: int) -> bool:
        """Extend `table` to hold `length` tokens; False (and no change) if blocks run out."""
        need = self.blocks_needed(table, length)
        if need > self.num_free:
            return False
        table.extend(self._take() for _ in range(need))
        return True

    def register_full(self, table: list[int], tokens: list[int], computed: int, hashes: list[int]) -> None:
        """Publish the computed full blocks of a sequence for prefix reuse; `hashes` is the
        sequence's chain-hash cache (see chain_hashes)."""
        if not self.prefix_caching:
            return
        full = computed // self.block_size
        if len(hashes) < full:
            self.chain_hashes(tokens[:full * self.block_size], hashes)
        for block, h in zip(table[:full], hashes):
            if block not in self.hash_of and h not in self.by_hash:
                self.hash_of[block], self.by_hash[h] = h, block

    def release(self, table: list[int]) -> None:
        for block in table:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        table.clear()
