"""The KV block manager: prefix cache, LRU eviction, SHA-256 prefix keys verified against the tokens."""
from __future__ import annotations

from server.sched.block_manager import BlockManager


def test_block_manager_prefix_cache_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    t1 = bm.match_prefix(prompt)
    assert t1 == [] and bm.grow(t1, 5) and 0 not in t1
    bm.register_full(t1, prompt, 5, [])
    t2 = bm.match_prefix(prompt)
    assert t2 == t1[:2]  # two full blocks shared
    assert bm.refs[t1[0]] == 2
    bm.release(t1)
    bm.release(t2)
    assert bm.num_free == 5  # cached blocks count as free (evictable)
    t3: list[int] = []
    assert bm.grow(t3, 10) and len(t3) == 5  # evicts the cached blocks, oldest first
    assert bm.match_prefix(prompt) == []
    assert not bm.grow(t3, 12)  # out of blocks: refused, table unchanged
    assert len(t3) == 5


def test_match_prefix_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4]
    t = bm.match_prefix(prompt)
    bm.grow(t, 4)
    bm.register_full(t, prompt, 4, [])
    assert len(bm.match_prefix(prompt)) == 1  # not both blocks: the last token must run for its logits


def test_incremental_block_hashes_equal_a_fresh_chain():
    """A sequence's hash cache grows block by block as decode proceeds; the chain must equal the
    one computed from scratch, or prefix hits would silently stop (or, worse, match wrong blocks)."""
    bm = BlockManager(num_blocks=16, block_size=3)
    tokens = list(range(100, 120))
    cache: list[bytes] = []
    table: list[int] = []
    for n in range(1, len(tokens) + 1):
        assert bm.grow(table, n)
        bm.register_full(table, tokens[:n], n, cache)
        assert cache == bm.chain_hashes(tokens[:n])
    assert bm.match_prefix(tokens + [7]) == table[:len(tokens) // 3]


def _registered(bm: BlockManager, tokens: list[int]) -> list[int]:
    table: list[int] = []
    assert bm.grow(table, len(tokens))
    bm.register_full(table, tokens, len(tokens), [])
    return table


def test_a_colliding_prefix_key_never_reuses_another_texts_block():
    """Keys forced to collide (a stub key function): a hit is checked against the block's own tokens
    and its parent's key, so KV computed for other text is never served."""
    everything_collides = BlockManager(num_blocks=16, block_size=2, key=lambda parent, tokens: b"same")
    _registered(everything_collides, [1, 2, 3, 4])
    assert everything_collides.match_prefix([9, 8, 3, 4, 5]) == []
    assert len(everything_collides.match_prefix([1, 2, 3, 4, 5])) == 1  # the same first block is reused

    # a key blind to the parent: [3, 4] after [5, 6] shares its key with [3, 4] after [1, 2]
    parentless = BlockManager(num_blocks=16, block_size=2, key=lambda parent, tokens: bytes(tokens))
    a = _registered(parentless, [5, 6, 3, 4])
    b = _registered(parentless, [1, 2, 7, 7])
    assert parentless.match_prefix([1, 2, 3, 4, 9]) == [b[0]]  # not a[1]: its KV saw 5, 6
    assert parentless.match_prefix([5, 6, 3, 4, 9]) == a


def test_prefix_keys_are_sha256_chained_from_a_salt():
    one, other = BlockManager(8, 2, salt="model-a|float32"), BlockManager(8, 2, salt="model-a|int8")
    keys = one.chain_hashes([1, 2, 3, 4])
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)  # SHA-256 digests
    assert keys != other.chain_hashes([1, 2, 3, 4])  # what changes the KV changes the keys
