"""A draft model on the agent (`self_int8`: the served weights quantised to int8; `draft`: a smaller
model with the same vocabulary): k greedy drafts per drafting row, from the draft's own forward.

The draft's KV cache has the target's geometry (num_blocks x block_size) and is addressed by the
target's block tables, as vLLM's draft layers are: the server's blocks, preemption and frees hold
for both, and no second allocator exists. What the draft has computed of a sequence is kept lazily:
a drafting row first catches up on the tokens its history gained since it last drafted (the whole
prompt the first time, else its newest token and whatever drafts the verification kept), packed
with the other rows into the draft's own static graphs, then decodes k - 1 more. Greedy drafts are
point masses, so verification (agent/spec/verify.py) stays exact whatever the draft computes: a
stale or wrong draft KV only costs acceptance, never a token."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agent.runner_config import bucket
from shm.step import StepInputs


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
    def __init__(self, runner, method: str):
        """`runner`: an agent.runner.ModelRunner of the draft weights whose KV pool has the target's
        num_blocks and block_size (its graphs built before ready)."""
        self.runner, self.method = runner, method
        self.bs = runner.rc.block_size
        rc = runner.rc
        self.max_tokens = rc.mixed_tokens or rc.token_buckets[-1]  # a call's tokens: every row's logits kept
        self.cached: dict[int, Cached] = {}

    def forget(self, seqs) -> None:
        for s in seqs:
            self.cached.pop(int(s), None)

    def reset(self) -> None:
        self.cached.clear()

    def propose_step(self, x: StepInputs, starts: np.ndarray, rows: list[int],
                     histories: list[np.ndarray]) -> list[np.ndarray]:
        """Drafts for step rows `rows` (each with x.spec_len[r] slots), from their histories (each
        ending with the token the row feeds this step)."""
        calls, ks = [], []
        for r, hist in zip(rows, histories):
            seq = int(x.seq_ids[r])
            c = self.cached.setdefault(seq, Cached())
            n = self._valid(c, hist)
            calls.append(Row(seq, hist[n:], n, x.block_tables[r]))
            ks.append(int(x.spec_len[r]))
            c.n = hist.size
        drafts = [np.zeros(k, np.int32) for k in ks]
        for i, t in enumerate(self._catch_up(calls)):
            drafts[i][0] = t
        for j in range(1, max(ks, default=1)):  # feed draft j at position len(hist) + j - 1
            live = [i for i, k in enumerate(ks) if k > j]
            step = [Row(calls[i].seq, drafts[i][j - 1:j], histories[i].size + j - 1, calls[i].table) for i in live]
            for i, t in zip(live, self._decode(step)):
                drafts[i][j] = t
        for row, d, k in zip(calls, drafts, ks):
            self.cached[row.seq].fed = d[:k - 1]
        return drafts

    @staticmethod
    def _valid(c: Cached, hist: np.ndarray) -> int:
        """History tokens whose draft KV holds: what was computed, and the fed drafts the history kept."""
        if c.n > hist.size - 1:  # never past the token this row feeds (its KV is this step's)
            return 0
        kept = hist[c.n:c.n + c.fed.size]
        same = kept == c.fed[:kept.size]
        n = c.n + (int(np.argmin(same)) if not same.all() else kept.size)
        return min(n, hist.size - 1)

    def _catch_up(self, rows: list[Row]) -> np.ndarray:
        """Each row's tokens computed in as few calls as fit the draft's graphs; the argmax after each
        row's last token."""
        out = np.zeros(len(rows), np.int32)
        pending = [(i, 0) for i in range(len(rows))]  # (row, tokens of it done)
        while pending:
            batch, budget, nxt = [], self.max_tokens, []
            for i, done in pending:
                take = min(rows[i].tokens.size - done, budget)
                if take <= 0 or len(batch) >= self.runner.rc.max_running:
                    nxt.append((i, done))
                    continue
                r = rows[i]
                batch.append((i, done + take == r.tokens.size, Row(r.seq, r.tokens[done:done + take], r.pos + done, r.table)))
                budget -= take
                if done + take < r.tokens.size:
                    nxt.append((i, done + take))
            for (i, final, _), t in zip(batch, self._decode([b[2] for b in batch])):
                if final:
                    out[i] = t
            pending = nxt
        return out

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
