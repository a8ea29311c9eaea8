"""The agent's grammar masks: the native kernel and the NumPy fallback mask the same logits exactly,
masks computed ahead (while the next graph runs) equal masks computed on the spot, and a sequence
re-admitted with its outputs continues where its matcher left off."""
from __future__ import annotations

import numpy as np
import pytest

from agent import kernels
from agent.grammar import Grammars
from common import grammar
from common.model_files import resolve_model
from common.tokenizer import load_tokenizer

VOCAB = 300


@pytest.fixture(scope="module")
def ll_tok(tiny_model_dir):
    return grammar.ll_tokenizer(load_tokenizer(resolve_model(str(tiny_model_dir))), VOCAB)


def _walk(g: Grammars, seqs: list[int], steps: int, seed: int) -> list[np.ndarray]:
    """Masked logits of `steps` steps over rows `seqs`, each sampling its masked argmax."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        logits = rng.standard_normal((len(seqs), VOCAB)).astype(np.float32)
        rows = g.constrained(np.array(seqs))
        failed = g.mask(logits, rows)
        assert not failed.any()
        out.append(logits.copy())
        g.consume(rows, logits.argmax(axis=1).astype(np.int32))
    return out


def test_native_and_numpy_masks_are_equal_and_exact(ll_tok):
    lib = kernels.library()
    if lib is None:
        pytest.skip("no native kernels here")
    text = grammar.from_regex("[a-c]{2,5}-[0-9]{1,3}")
    walks = []
    for use in (lib, None):
        g = Grammars(ll_tok, VOCAB, use)
        for s in (1, 2, 3):
            g.start(s, text, [])
        walks.append(_walk(g, [1, 2, 3], 6, seed=5))
    for a, b in zip(*walks):
        assert np.array_equal(a, b)  # -inf in the same places, every other value untouched
        allowed = np.isfinite(a)
        assert allowed.any(axis=1).all() and (~allowed).any(axis=1).all()


def test_masks_ahead_equal_masks_now_and_readmission_resumes(ll_tok):
    text = grammar.from_json_schema({"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"]})
    ahead = Grammars(ll_tok, VOCAB, kernels.library())
    ahead.start(7, text, [])
    first = _walk(ahead, [7], 3, seed=1)
    fresh = Grammars(ll_tok, VOCAB, kernels.library())  # every step's mask on the spot
    fresh.start(7, text, [])
    rng = np.random.default_rng(1)
    outputs = []
    for want in first:
        logits = rng.standard_normal((1, VOCAB)).astype(np.float32)
        fresh._next = None
        fresh.mask(logits, fresh.constrained(np.array([7])))
        assert np.array_equal(logits, want)
        outputs.append(int(logits.argmax()))
        fresh.matchers[7].consume_token(outputs[-1])
    again = Grammars(ll_tok, VOCAB, kernels.library())  # re-admitted elsewhere with its outputs so far
    again.start(7, text, outputs)
    logits = np.zeros((1, VOCAB), np.float32)
    again.mask(logits, again.constrained(np.array([7])))
    ref = np.zeros((1, VOCAB), np.float32)
    fresh._next = None
    fresh.mask(ref, fresh.constrained(np.array([7])))
    assert np.array_equal(logits, ref)
