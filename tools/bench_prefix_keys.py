"""What the prefix cache's keys cost the server: microseconds per 1,000 prompt tokens to key every
full block (SHA-256 chained from the salt, server/sched/block_manager.py) and to look a prompt up
(keys, then each hit checked against its tokens and parent), beside the Python `hash()` chain the
keys replaced. One process, best of several rounds.

    python -m tools.bench_prefix_keys [--tokens 1000] [--block-size 16]
"""
from __future__ import annotations

import argparse
import time


from server.sched.block_manager import BlockManager


def best_us(fn, rounds: int = 7, calls: int = 200) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    tokens = list(range(1000, 1000 + args.tokens))
    sha = BlockManager(1 + args.tokens // args.block_size + 1, args.block_size, salt="bench")
    old = BlockManager(2, args.block_size, key=lambda parent, block: hash((parent, block)).to_bytes(8, "little", signed=True))
    table: list[int] = []
    sha.grow(table, len(tokens))
    sha.register_full(table, tokens, len(tokens), [])
    scale = 1000 / args.tokens

    def lookup() -> None:
        sha.release(sha.match_prefix(tokens + [0]))

    print(f"{args.tokens} prompt tokens, blocks of {args.block_size}: us per 1,000 tokens")
    print(f"  keys, SHA-256 chain        {best_us(lambda: sha.chain_hashes(tokens)) * scale:8.1f}")
    print(f"  keys, Python hash() chain  {best_us(lambda: old.chain_hashes(tokens)) * scale:8.1f}")
    print(f"  lookup, all blocks hit     {best_us(lookup) * scale:8.1f}")


if __name__ == "__main__":
    main()
