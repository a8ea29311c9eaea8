"""Constrained rows on the agent: one llguidance matcher per constrained sequence, advanced by every
token the agent samples for it, and each constrained row's logits masked to what its grammar allows
before sampling. The grammar lives here, not in the server, because the agent samples: a fed (`a`)
row's mask needs the token sampled one step before, which the server has not seen yet when it
sends the next step. A step's header brings a grammar with the sequence's outputs so far when the
sequence is (re)admitted (docs/protocol.md, `grammars`); that rebuilds its matcher from scratch.

A mask depends only on the tokens before it, so the next step's masks are computed while that
step's graph runs (llguidance drops the GIL): `consume` starts them, `mask` waits for them."""
from __future__ import annotations

import ctypes
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance as llg
import llguidance.numpy as lln
import numpy as np

Row = tuple[int, int, llg.LLMatcher]  # (row of the step, sequence id, its matcher)


class Grammars:
    def __init__(self, tok: llg.LLTokenizer, vocab: int, lib: str | None = None):
        self.tok, self.vocab = tok, vocab
        self.matchers: dict[int, llg.LLMatcher] = {}
        self._apply = ctypes.CDLL(lib).MaskLogits if lib else None  # agent/kernels/bitmask.cpp
        self._executor = llg.LLExecutor()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._next: Future | None = None  # masks computed ahead: ({seq: (matcher, row)}, bitmask)

    def start(self, seq: int, grammar: str, outputs: list[int]) -> None:
        """A matcher for `seq` that has consumed its outputs so far (a bad grammar or output leaves
        it in its error state: the row then fails)."""
        m = llg.LLMatcher(self.tok, grammar, log_level=0)
        if outputs:
            m.consume_tokens(outputs)
        self.matchers[seq] = m

    def free(self, seq: int) -> None:
        self.matchers.pop(seq, None)

    def constrained(self, seq_ids: np.ndarray) -> list[Row]:
        if not self.matchers:
            return []
        return [(r, s, m) for r, s in enumerate(seq_ids.tolist()) if (m := self.matchers.get(s)) is not None]

    def mask(self, logits: np.ndarray, rows: list[Row]) -> np.ndarray:
        """In place: each constrained row's disallowed tokens to -inf. Returns the rows whose
        grammar is in its error state (they fail)."""
        ahead, bits = self._ahead()
        now = [(m, k) for k, (_, s, m) in enumerate(rows) if ahead.get(s, (None,))[0] is not m]
        if now:  # rows without a mask computed ahead (just (re)admitted): computed here
            fresh = lln.allocate_token_bitmask(len(rows), self.vocab)
            lln.fill_next_token_bitmask_par(self._executor, now, fresh)
        where = [(r, ahead[s][1], bits) if ahead.get(s, (None,))[0] is m else (r, k, fresh)
                 for k, (r, s, m) in enumerate(rows)]
        for source in {id(b): b for _, _, b in where}.values():
            picked = [(r, i) for r, i, b in where if b is source]
            self._masked(logits, source, np.array([r for r, _ in picked]), np.array([i for _, i in picked]))
        failed = np.zeros(logits.shape[0], bool)
        failed[[r for r, _, m in rows if m.is_error()]] = True
        return failed

    def _ahead(self) -> tuple[dict, np.ndarray | None]:
        """The masks computed ahead, if any and if that worked (else every mask is computed now)."""
        job, self._next = self._next, None
        try:
            return job.result() if job is not None else ({}, None)
        except Exception:  # noqa: BLE001 - computed again on the spot, where an error fails its row alone
            return {}, None

    def _masked(self, logits: np.ndarray, bits: np.ndarray, rows: np.ndarray, mask_rows: np.ndarray) -> None:
        if self._apply is not None and logits.flags.c_contiguous and logits.dtype == np.float32:
            self._apply(logits.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(logits.shape[1]),
                        bits.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(bits.shape[1]),
                        rows.astype(np.int64).ctypes.data_as(ctypes.c_void_p),
                        mask_rows.astype(np.int64).ctypes.data_as(ctypes.c_void_p),
                        ctypes.c_int64(rows.size), ctypes.c_int64(min(self.vocab, logits.shape[1])))
            return
        allowed = np.unpackbits(bits[mask_rows].view(np.uint8), axis=1, bitorder="little", count=self.vocab)
        for k, r in enumerate(rows.tolist()):
            np.putmask(logits[r], allowed[k, :logits.shape[1]] == 0, -np.inf)

    def consume(self, rows: list[Row], ids: np.ndarray) -> None:
        """Advance each row's matcher by its sampled token, then start the next step's masks."""
        for r, _, m in rows:
            if ids[r] >= 0:
                m.consume_token(int(ids[r]))
        ahead = {s: (m, k) for k, (_, s, m) in enumerate(rows)}
        bits = lln.allocate_token_bitmask(len(rows), self.vocab)
        self._next = self._pool.submit(self._fill, list(ahead.values()), bits, ahead)

    def _fill(self, work: list[tuple[llg.LLMatcher, int]], bits: np.ndarray, ahead: dict) -> tuple[dict, np.ndarray]:
        lln.fill_next_token_bitmask_par(self._executor, work, bits)
        return ahead, bits
