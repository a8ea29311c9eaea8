"""Drains on the engine thread (server/engine/drain.py) with stand-in lanes: a second drain of one
agent shares the first's answer, a resume ends a drain under way saying so, an agent that is not
live is not drained, and one whose agent goes down mid-drain says that."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from common.config import ServingConfig
from common.config_values import Role
from server.engine.drain import DrainError, Drains
from server.engine.lane import LaneState
from server.engine.messages import Drain


def _lane(index: int) -> SimpleNamespace:
    sched = SimpleNamespace(moves=SimpleNamespace(draining=False, moved=0), load=0, role=Role.BOTH, evicted=lambda: [])
    lane = SimpleNamespace(index=index, state=LaneState.LIVE, why="", sched=sched, busy=False)
    lane.live = True
    return lane


def _drains() -> tuple[Drains, list[SimpleNamespace]]:
    cfg = ServingConfig(num_blocks=9, block_size=4, max_model_len=32, prefill_buckets=[8], decode_buckets=[1, 4],
                        max_prefill_rows=2, agent_ports=[7001, 7002]).validate()
    lanes = [_lane(0), _lane(1)]
    return Drains(cfg, lanes, SimpleNamespace(recompute=lambda req: None), None), lanes


def _ask(drains: Drains, port: int, resume: bool = False) -> Future:
    done: Future = Future()
    drains.start(Drain(port, resume, done))
    return done


def test_two_drains_of_one_agent_share_one_answer():
    drains, lanes = _drains()
    lanes[0].sched.load = 3
    first, second = _ask(drains, 7001), _ask(drains, 7001)
    drains.turn()
    assert not first.done() and not second.done()
    lanes[0].sched.load, lanes[0].sched.moves.moved = 0, 3
    drains.turn()
    assert first.result(0) == second.result(0) == {"port": 7001, "draining": True, "state": "live", "moved": 3}


def test_a_resume_ends_a_drain_under_way_and_says_so():
    drains, lanes = _drains()
    lanes[0].sched.load = 3
    drain = _ask(drains, 7001)
    assert _ask(drains, 7001, resume=True).result(0) == {"port": 7001, "draining": False}
    answer = drain.result(0)
    assert not answer["draining"] and "resumed" in answer["note"] and "went down" not in answer["note"]
    assert drains.draining() == []


def test_an_agent_going_down_mid_drain_is_said_and_one_down_is_not_drained():
    drains, lanes = _drains()
    lanes[0].sched.load = 3
    drain = _ask(drains, 7001)
    assert drains.draining() == [7001]
    lanes[0].state, lanes[0].live, lanes[0].why = LaneState.RECOVERING, False, "killed"
    drains.turn()
    assert "went down during the drain (killed)" in drain.result(0)["note"]
    with pytest.raises(DrainError, match="is recovering .* takes work again when it is back"):
        _ask(drains, 7001).result(0)
