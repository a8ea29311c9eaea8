"""KV hand-over between agents (agent/handover.py): a prompt's blocks computed by one runner, copied
out into hand-over slots and into other blocks of another runner, decode there exactly as where
they were computed, for every cache layout (stack op, plain MindSpore, int8 KV) and across layouts."""
from __future__ import annotations

import numpy as np
import pytest

from agent.handover import KvPages
from server.sampling_params import SamplingParams
from shm.arena import Arena, ArenaSpec
from shm.step import RowInput
from tests.agent.drivers import LOGIT_TOL, make_runner
from tests.conftest import tiny_model_config
from tests.reference import reference_logits

PROMPT = [5, 17, 99, 3, 200, 41, 7, 250, 1, 2, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]  # 21 tokens: 2 blocks of 16


def _step(runner, seq: int, tokens: list[int], start: int, table: list[int], prompt_len: int) -> tuple[int, np.ndarray]:
    """One row through runner.step: its sample and its logits."""
    arena = Arena.private(ArenaSpec(64, 4, 8))
    rows = [RowInput(seq, np.asarray(tokens, np.int32), start, table, True, SamplingParams(), prompt_len,
                     start + len(tokens) - prompt_len)]
    v = arena.step(arena.write_step(rows, runner.rc.block_size))
    logits, _ = runner.forward(v.inputs)
    runner.step(v, [])
    return int(v.outputs.ids[0]), logits[0].copy()


def _handed_decode(src, dst, src_table: list[int], dst_table: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """PROMPT prefilled on `src`, its blocks handed to other blocks of `dst`, the first decode on each:
    (the decode's logits on src, on dst, the first token)."""
    first, _ = _step(src, 1, PROMPT, 0, src_table, len(PROMPT))
    out, into = KvPages(src.model, src.rc.block_size), KvPages(dst.model, dst.rc.block_size)
    assert out.slot_bytes == into.slot_bytes
    buf = bytearray(out.slot_bytes * 8)
    at = [5, 2]  # slots in any order
    out.export(src_table, out.slots(buf, 8), at)
    into.load(dst_table, into.slots(buf, 8), at)
    dst.seqs.start_histories([[2, PROMPT]])
    _, on_src = _step(src, 1, [first], len(PROMPT), src_table, len(PROMPT))
    _, on_dst = _step(dst, 2, [first], len(PROMPT), dst_table, len(PROMPT))
    return on_src, on_dst, first


@pytest.fixture(scope="module")
def stacked(tiny_weights):
    return make_runner(tiny_weights, 16)


def test_blocks_handed_to_other_blocks_decode_as_where_they_were_computed(stacked, tiny_weights):
    on_src, on_dst, first = _handed_decode(stacked, stacked, [3, 4], [9, 1])  # one runner as both agents
    assert np.array_equal(on_src, on_dst)  # the same bytes, the same path: the same logits
    ref = reference_logits(tiny_model_config(), tiny_weights, PROMPT + [first])[-1]
    assert np.abs(on_dst - ref).max() <= LOGIT_TOL


def test_int8_kv_blocks_carry_their_scales(tiny_weights):
    runner = make_runner(tiny_weights, 16, kv_dtype="int8")
    assert KvPages(runner.model, 16).dtype == np.int8
    on_src, on_dst, _ = _handed_decode(runner, runner, [3, 4], [7, 8])
    assert np.array_equal(on_src, on_dst)


def test_a_stack_op_agent_hands_to_a_plain_mindspore_agent(stacked, tiny_weights):
    plain = make_runner(tiny_weights, 16, native=False)
    assert not KvPages(plain.model, 16).stacked and KvPages(plain.model, 16).head_major
    on_src, on_dst, first = _handed_decode(stacked, plain, [5, 6], [2, 3])
    ref = reference_logits(tiny_model_config(), tiny_weights, PROMPT + [first])[-1]
    assert np.abs(on_dst - ref).max() <= LOGIT_TOL and np.abs(on_src - on_dst).max() <= LOGIT_TOL
