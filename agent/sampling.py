"""Per-row sampling on the agent: greedy, temperature, top-k, top-p, min-p, penalties, seeds, logprobs.

Greedy rows and chosen-token logprobs are vectorised. Sampled rows never sort the full vocabulary:
candidates come from ``argpartition``; top-p widens the candidate set only when its mass falls short.
"""
from __future__ import annotations

import numpy as np

from shm.step import SamplingColumns, ScoreOutputs, StepInputs, StepOutputs

TOP_P_CANDIDATES = 256
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM): 1/T would overflow
LOGIT_BOUND = 1e30  # penalised logits are clipped here, so no accepted penalty makes inf or NaN


def _greedy(logits: np.ndarray, lse: np.ndarray) -> StepOutputs:
    """Every row greedy, no penalties, no logprobs: a handful of array calls instead of ~20, each
    cache-cold after the model's weights went through (docs/perf-notes.md)."""
    rows = logits.shape[0]
    ids = logits.argmax(axis=-1).astype(np.int32)
    chosen = logits[np.arange(rows), ids]
    ids[~np.isfinite(chosen)] = -1
    return StepOutputs(ids, (chosen - lse).astype(np.float32), np.zeros((rows, 0), np.int32),
                        np.zeros((rows, 0), np.float32))


def _top(logits: np.ndarray, lse: np.ndarray, n_top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The n_top[r] most likely tokens of each row, most likely first, and their log-probabilities."""
    rows, max_n = logits.shape[0], int(n_top.max(initial=0))
    top_ids = np.zeros((rows, max_n), np.int32)
    top_lps = np.zeros((rows, max_n), np.float32)
    for r in np.nonzero(n_top)[0]:
        n = int(n_top[r])
        best = np.argpartition(-logits[r], n - 1)[:n]
        best = best[np.argsort(-logits[r, best], kind="stable")]
        top_ids[r, :n] = best
        top_lps[r, :n] = logits[r, best] - lse[r]
    return top_ids, top_lps


def score(x: StepInputs, params: SamplingColumns, starts: np.ndarray, where: np.ndarray, logits: np.ndarray,
          lse: np.ndarray, out: ScoreOutputs) -> None:
    """Prompt logprobs: for each scored token (targets >= 0), in token order, its target's raw
    log-probability and its row's top alternatives. `where`: the token index of each logits row."""
    scored = np.nonzero(x.targets >= 0)[0]
    order = np.argsort(where, kind="stable")
    idx = order[np.searchsorted(where[order], scored)]
    n_top = params.n_prompt_logprobs[np.searchsorted(starts, scored, side="right") - 1]
    out.score_logprobs[:] = logits[idx, x.targets[scored]] - lse[idx]
    top_ids, top_lps = _top(logits[idx], lse[idx], n_top)
    out.score_top_ids[:, :top_ids.shape[1]] = top_ids
    out.score_top_logprobs[:, :top_ids.shape[1]] = top_lps


def needs_penalty(p: SamplingColumns) -> np.ndarray:
    return (p.repetition_penalty != 1.0) | (p.presence_penalty != 0.0) | (p.frequency_penalty != 0.0)


def apply_penalties(row: np.ndarray, history: np.ndarray, prompt_len: int, rep: float, pres: float,
                    freq: float) -> None:
    """In place. Repetition penalty over prompt+output (as in HF/vLLM); presence/frequency over output."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if rep != 1.0 and history.size:
            seen = np.unique(history)
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / rep, vals * rep)
        out = history[prompt_len:]
        if out.size and (pres or freq):
            ids, counts = np.unique(out, return_counts=True)
            row[ids] -= pres + freq * counts
    np.clip(row, -LOGIT_BOUND, LOGIT_BOUND, out=row)


def _nucleus(probs: np.ndarray, cand: np.ndarray, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Candidates sorted by probability, cut by min-p and top-p; returns (ids, renormalised probs)."""
    p = probs[cand]
    order = np.argsort(-p, kind="stable")
    cand, p = cand[order], p[order]
    keep = np.ones(p.size, bool)
    if min_p > 0:
        keep &= p >= min_p * p[0]
    if top_p < 1.0:
        keep &= (np.cumsum(p) - p) < top_p  # keeps the token that crosses top_p
    keep[0] = True  # the most likely token always survives (no setting may leave nothing to sample)
    cand, p = cand[keep], p[keep]
    return cand, p / p.sum()


def _sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
                rng: np.random.Generator) -> int:
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    probs = np.exp(z)
    probs /= probs.sum()
    if not np.isfinite(probs).all():
        raise FloatingPointError("logits are not finite")
    vocab = probs.size
    if 0 < top_k < vocab:
        cand = np.argpartition(-probs, top_k - 1)[:top_k]
    elif (top_p < 1.0 or min_p > 0) and vocab <= TOP_P_CANDIDATES:
        cand = np.arange(vocab)
    elif top_p < 1.0 or min_p > 0:
        cand = np.argpartition(-probs, TOP_P_CANDIDATES - 1)[:TOP_P_CANDIDATES]
        if probs[cand].sum() < top_p:  # rare: flat distribution, fall back to the exact full set
            cand = np.arange(vocab)
    else:
        return int(rng.choice(vocab, p=probs))
    ids, p = _nucleus(probs, cand, top_p, min_p)
    return int(ids[rng.choice(ids.size, p=p)])


def sample(logits: np.ndarray, lse: np.ndarray, params: SamplingColumns, histories: list[np.ndarray | None],
           rng: np.random.Generator) -> StepOutputs:
    """logits [R, V] float32 (modified in place by penalties), lse [R] its log-sum-exp per row.

    Reported logprobs are the model's raw log-probabilities (before penalties and temperature),
    as vLLM reports by default."""
    rows = logits.shape[0]
    penalised = needs_penalty(params)
    if not (params.n_logprobs.any() or penalised.any() or (params.temperature >= SAMPLING_EPS).any()):
        return _greedy(logits, lse)
    top_ids, top_lps = _top(logits, lse, params.n_logprobs)
    raw = logits.copy() if penalised.any() else logits

    failed = np.zeros(rows, bool)
    for r in np.nonzero(penalised)[0]:
        hist = histories[r]
        if hist is not None:
            apply_penalties(logits[r], hist, int(params.prompt_len[r]), float(params.repetition_penalty[r]),
                            float(params.presence_penalty[r]), float(params.frequency_penalty[r]))
    ids = np.argmax(logits, axis=-1).astype(np.int32)
    for r in np.nonzero(params.temperature >= SAMPLING_EPS)[0]:
        seed = int(params.seed[r])
        # Stateless per-step stream: reproducible across preemption and agent changes.
        row_rng = np.random.default_rng([seed, int(params.output_len[r])]) if seed >= 0 else rng
        try:
            ids[r] = _sample_row(logits[r], float(params.temperature[r]), int(params.top_k[r]),
                                 float(params.top_p[r]), float(params.min_p[r]), row_rng)
        except (ValueError, FloatingPointError):  # this row fails alone; its neighbours go on
            failed[r] = True
    failed |= ~np.isfinite(raw[np.arange(rows), ids])
    ids[failed] = -1
    logprobs = (raw[np.arange(rows), np.maximum(ids, 0)] - lse).astype(np.float32)
    return StepOutputs(ids, logprobs, top_ids, top_lps)


def write_samples(out: StepOutputs, rows: slice | np.ndarray, res: StepOutputs) -> None:
    """The sampled tokens, their logprobs and top alternatives into the arena's outputs."""
    out.ids[rows] = res.ids
    out.logprobs[rows] = res.logprobs
    n = res.top_ids.shape[1]
    out.top_ids[rows, :n] = res.top_ids
    out.top_logprobs[rows, :n] = res.top_logprobs
