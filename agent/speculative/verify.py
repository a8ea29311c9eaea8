"""Verification of a step's drafts against the target model's logits of the same step.

The drafts of a deterministic proposer are point masses, and rejection sampling (Leviathan et al.
2023; Chen et al. 2023) with a point mass q = [d] accepts d with probability p(d) and otherwise
samples from p without d, renormalised: exactly "sample x ~ p and accept d iff x == d, else emit
x". So every position is sampled as plain decoding samples it (penalties over the tokens before
it, the grammar's mask, top-k/top-p/min-p, and for a seeded row the same random stream: seed and
output index), and a row's drafts are kept while they equal those samples. Greedy and seeded rows
emit token for token what plain decoding emits; unseeded rows follow its distribution."""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable

import numpy as np

from shm.step import DraftOutputs, StepInputs, StepOutputs

# (logits [n, V], log-sum-exp [n], the step rows [n], pass j) -> the rows' samples at their j-th
# position (grammar matchers and last samples advanced by the caller's runner)
SamplePass = Callable[[np.ndarray, np.ndarray, np.ndarray, int], StepOutputs]
Kept = Callable[[np.ndarray, np.ndarray], None]  # (step rows, their drafts just accepted): fed tokens now


def without_unfilled(x: StepInputs, tokens: np.ndarray, starts: np.ndarray,
                     drafted: np.ndarray) -> tuple[StepInputs, np.ndarray]:
    """The step without the draft slots its proposer left empty (at the end of their rows): never
    accepted, they would cost a token's compute each. Its rows stay as they are."""
    unfilled = x.spec_len - drafted
    if not unfilled.any():
        return x, tokens
    keep = np.ones(tokens.size, bool)
    for r in np.nonzero(unfilled)[0]:
        end = starts[r] + x.query_lens[r]
        keep[end - unfilled[r]:end] = False
    per_token = {f.name: getattr(x, f.name)[keep] for f in fields(StepInputs) if f.metadata["dims"][:1] == ("T",)}
    return replace(x, **per_token, query_lens=x.query_lens - unfilled, spec_len=drafted), tokens[keep]


def heads(where: np.ndarray, n_tokens: int, last: np.ndarray, spec: np.ndarray) -> np.ndarray:
    """[rows, 1 + max spec]: the logits row of each row's j-th verified position (-1: none). A row
    with spec drafts is verified at its last 1 + spec tokens (the fed one and its drafts)."""
    at = np.full(n_tokens, -1, np.int64)
    at[where] = np.arange(where.size)
    j = np.arange(int(spec.max(initial=0)) + 1)
    pos = last[:, None] - spec[:, None] + j[None, :]
    return np.where(j[None, :] <= spec[:, None], at[np.minimum(pos, n_tokens - 1)], -1)


def verify(sample_pass: SamplePass, kept_fn: Kept, logits: np.ndarray, lse: np.ndarray, rows: np.ndarray,
           head: np.ndarray, drafts: np.ndarray, drafted: np.ndarray,
           n_top: int) -> tuple[StepOutputs, np.ndarray, StepOutputs]:
    """Sample the sampled `rows` position by position while their drafts hold. Returns each row's
    last emitted token (its correction, or its bonus token when every draft held), its accepted
    drafts, and the accepted drafts' outputs as [rows, max spec] (only the first accepted[r] mean
    anything). `drafts` [rows, max spec], `drafted`: how many of them the proposer filled."""
    n, width = rows.size, drafts.shape[1]
    final = _outputs(n, n_top)
    kept = _outputs(n * width, n_top)
    accepted = np.zeros(n, np.int32)
    active = np.arange(n)
    for j in range(width + 1):
        res = sample_pass(logits[head[active, j]], lse[head[active, j]], rows[active], j)
        go = np.zeros(active.size, bool)
        if j < width:
            go = (j < drafted[active]) & (res.ids == drafts[active, j]) & (res.ids >= 0)
        _put(kept, active[go] * width + j, res, go)
        _put(final, active[~go], res, ~go)
        accepted[active[go]] += 1
        if go.any():
            kept_fn(rows[active[go]], res.ids[go])
        active = active[go]
        if not active.size:
            break
    return final, accepted, StepOutputs(kept.ids.reshape(n, width), kept.logprobs.reshape(n, width),
                                        kept.top_ids.reshape(n, width, n_top), kept.top_logprobs.reshape(n, width, n_top))


def write_drafts(out: DraftOutputs, first: np.ndarray, accepted: np.ndarray, kept: StepOutputs) -> None:
    """Each row's accepted drafts into its draft slots from `first[r]`."""
    for r in np.nonzero(accepted)[0]:
        a, k = int(accepted[r]), slice(int(first[r]), int(first[r] + accepted[r]))
        out.draft_ids[k] = kept.ids[r, :a]
        out.draft_logprobs[k] = kept.logprobs[r, :a]
        n = kept.top_ids.shape[2]
        out.draft_top_ids[k, :n] = kept.top_ids[r, :a]
        out.draft_top_logprobs[k, :n] = kept.top_logprobs[r, :a]


def _outputs(n: int, n_top: int) -> StepOutputs:
    return StepOutputs(np.full(n, -1, np.int32), np.zeros(n, np.float32), np.zeros((n, n_top), np.int32),
                       np.zeros((n, n_top), np.float32))


def _put(dst: StepOutputs, at: np.ndarray, res: StepOutputs, pick: np.ndarray) -> None:
    dst.ids[at] = res.ids[pick]
    dst.logprobs[at] = res.logprobs[pick]
    w = res.top_ids.shape[1]
    dst.top_ids[at, :w] = res.top_ids[pick]
    dst.top_logprobs[at, :w] = res.top_logprobs[pick]
