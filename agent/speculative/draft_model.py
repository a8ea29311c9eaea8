"""A draft model on the agent (`self_int8`: the served weights quantised to int8; `draft`: a smaller
model with the same vocabulary): k greedy drafts per drafting row, from the draft's own forward.

The draft's KV cache has the target's geometry (num_blocks x block_size) and is addressed by the
target's block tables, as vLLM's draft layers are: the server's blocks, preemption and frees hold
for both, and no second allocator exists. What the draft has computed of a sequence is kept lazily:
a drafting row first catches up on the tokens its history gained since it last drafted (the whole
prompt the first time, else its newest token and whatever drafts the verification kept), packed
with the other rows into one call of the draft's static graphs, then decodes k - 1 more. One call's
tokens are a step's whole catch-up: a long prompt catches up over several steps, drafting nothing
until it has, so no step waits for a draft's prefill. Greedy drafts are point masses, so
verification (agent/speculative/verify.py) stays exact whatever the draft computes: a stale or wrong draft
KV only costs acceptance, never a token."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import numpy as np

from agent.runner_config import bucket
from shm.step import StepInputs

if TYPE_CHECKING:
    from agent.runner import ModelRunner


@dataclass(slots=True)
class Cached:
    """A sequence's draft KV: `n` leading history tokens computed; `fed` the drafts fed after them
    (their KV is valid as far as the verification kept them)."""
    n: int = 0
    fed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


@dataclass(slots=True)
class Row:
    """One drafting row of a draft call: tokens from `pos`, written through `table`."""
    seq: int
    tokens: np.ndarray
    pos: int
    table: np.ndarray


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, method: str):
        """`runner`: an agent.runner.ModelRunner of the draft weights whose KV pool has the target's
        num_blocks and block_size (its graphs built before ready)."""
        self.runner, self.method = runner, method
        self.bs = runner.rc.block_size
        rc = runner.rc
        # catch-up tokens a step: one call of a bucket whose graphs keep every row's logits
        self.budget = max(b for b in rc.token_buckets if b <= (rc.mixed_tokens or rc.token_buckets[-1]))
        self.cached: dict[int, Cached] = {}

    def graph_compiles(self) -> int:
        return len(self.runner.compiled)

    def warmup(self) -> None:  # its graphs after the target's, in the same fixed order (the compile-cache key names it)
        self.runner.warmup(freeze=False)

    def forget(self, seqs: Iterable[int]) -> None:
        for s in seqs:
            self.cached.pop(int(s), None)

    def reset(self) -> None:
        self.cached.clear()

    def propose_step(self, x: StepInputs, starts: np.ndarray, rows: list[int],
                     histories: list[np.ndarray]) -> list[np.ndarray]:
        """Drafts for step rows `rows` (each with x.spec_len[r] slots), from their histories (each
        ending with the token the row feeds this step); none for a row still catching up."""
        calls, drafting, left = [], [], self.budget
        need = [h.size - self._valid(self.cached.setdefault(int(x.seq_ids[r]), Cached()), h)
                for r, h in zip(rows, histories)]
        for i in sorted(range(len(rows)), key=need.__getitem__):  # short catch-ups first
            take = min(need[i], left)
            if take <= 0:
                continue
            r, hist = rows[i], histories[i]
            c = self.cached[int(x.seq_ids[r])]
            n = hist.size - need[i]
            calls.append(Row(int(x.seq_ids[r]), hist[n:n + take], n, x.block_tables[r]))
            c.n, c.fed, left = n + take, c.fed[:0], left - take
            if take == need[i]:
                drafting.append((i, len(calls) - 1))
        firsts = self._decode(calls)
        drafts = [np.zeros(0, np.int32) for _ in rows]
        for i, call in drafting:
            drafts[i] = np.zeros(int(x.spec_len[rows[i]]), np.int32)
            drafts[i][0] = firsts[call]
        for j in range(1, max((d.size for d in drafts), default=1)):  # draft j fed at position len(hist) + j - 1
            live = [i for i, d in enumerate(drafts) if d.size > j]
            step = [Row(int(x.seq_ids[rows[i]]), drafts[i][j - 1:j], histories[i].size + j - 1, x.block_tables[rows[i]])
                    for i in live]
            for i, t in zip(live, self._decode(step)):
                drafts[i][j] = t
        for i, _ in drafting:
            self.cached[int(x.seq_ids[rows[i]])].fed = drafts[i][:-1]
        return drafts

    @staticmethod
    def _valid(c: Cached, hist: np.ndarray) -> int:
        """History tokens whose draft KV holds: what was computed, and the fed drafts the history kept;
        never the last (the token this row feeds, whose logits give the first draft)."""
        if c.n > hist.size - 1:
            return 0
        kept = hist[c.n:c.n + c.fed.size]
        same = kept == c.fed[:kept.size]
        n = c.n + (int(np.argmin(same)) if not same.all() else kept.size)
        return min(n, hist.size - 1)

    def _decode(self, rows: list[Row]) -> np.ndarray:
        """One draft forward over `rows` (fits the draft's graphs); the argmax after each row's last token."""
        if not rows:
            return np.zeros(0, np.int32)
        qlens = np.array([r.tokens.size for r in rows], np.int32)
        tokens = np.concatenate([r.tokens for r in rows]).astype(np.int32)
        positions = np.concatenate([np.arange(r.pos, r.pos + r.tokens.size) for r in rows]).astype(np.int32)
        width = max(r.table.size for r in rows)
        tables = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            tables[i, :r.table.size] = r.table
        owner = np.repeat(np.arange(len(rows)), qlens)
        slots = tables[owner, positions // self.bs] * self.bs + positions % self.bs
        n = len(rows)
        x = StepInputs(tokens=tokens, positions=positions, slots=slots.astype(np.int32), query_lens=qlens,
                       block_tables=tables, seq_ids=np.array([r.seq for r in rows], np.int64),
                       sample=np.ones(n, np.int32), feed=np.zeros(n, np.int32),
                       targets=np.full(tokens.size, -1, np.int32), spec_len=np.zeros(n, np.int32),
                       adapter=np.zeros(n, np.int32))
        bucket(tokens.size, self.runner.rc.token_buckets)  # fits, or ValueError before the model runs
        logits, _ = self.runner.forward(x)
        return np.argmax(logits[:n], axis=1).astype(np.int32)
