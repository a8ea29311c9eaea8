"""Routing a new request among agents (server/engine/routing.py) over real block managers: `prefix`
sends it to the agent whose prefix cache holds the longest part of its prompt, unless that agent is
overloaded or short of blocks; without a cached prefix, and under `least_load`, the least loaded
agent takes it. A prefix cached under another adapter is no prefix."""
from __future__ import annotations

from types import SimpleNamespace

from common.config import ServingConfig
from server.sched.block_manager import BlockManager
from server.engine.metrics import Metrics
from server.engine.routing import ROUTERS, SLACK
from server.sampling_params import LoraRef, SamplingParams
from server.sched.sequence import Sequence

BS = 4


def _lane(index: int, load: int = 0, blocks: int = 64) -> SimpleNamespace:
    sched = SimpleNamespace(load=load, blocks=BlockManager(blocks, BS, True, "salt"))
    return SimpleNamespace(index=index, sched=sched)


def _cache(lane: SimpleNamespace, tokens: list[int], adapter: int = 0) -> None:
    """`tokens` computed on `lane` and its sequence ended: its full blocks stay cached."""
    blocks, table = lane.sched.blocks, []
    assert blocks.grow(table, len(tokens))
    blocks.register_full(table, tokens, len(tokens), [], adapter)
    blocks.release(table)


def _seq(tokens: list[int], lora: LoraRef | None = None) -> Sequence:
    return Sequence(tokens, SamplingParams(lora=lora), 0.0)


def _router(routing: str = "prefix", **cfg):
    metrics = Metrics()
    return ROUTERS[routing](ServingConfig(block_size=BS, routing=routing, **cfg).validate(), metrics), metrics


CONVERSATION = list(range(100, 124))  # 6 blocks: a system prompt and a first turn


def test_the_next_turn_goes_where_its_conversation_is_cached():
    router, metrics = _router()
    lanes = [_lane(0), _lane(1, load=3)]
    _cache(lanes[1], CONVERSATION)
    assert router.choose(_seq(CONVERSATION + [7, 8, 9]), lanes) is lanes[1]
    assert metrics.routed_by_prefix._value.get() == 1 and metrics.routed_prefix_tokens._value.get() == 24
    assert router.choose(_seq([1, 2, 3] + CONVERSATION), lanes) is lanes[0]  # no cached prefix: the least loaded


def test_an_overloaded_or_full_agent_gives_way_to_the_least_loaded():
    router, metrics = _router()
    lanes = [_lane(0, load=2), _lane(1, load=2 + SLACK)]
    _cache(lanes[1], CONVERSATION)
    assert router.choose(_seq(CONVERSATION + [7]), lanes) is lanes[1]  # SLACK more: still its
    assert metrics.routed_past_prefix._value.get() == 0
    lanes[1].sched.load += 1
    assert router.choose(_seq(CONVERSATION + [7]), lanes) is lanes[0]
    # counted: what copying the prefix's KV instead of computing it again would save
    assert metrics.routed_past_prefix._value.get() == 1 and metrics.routed_past_prefix_tokens._value.get() == 24
    lanes[0].sched.load = 40  # 1.5 x 40 = 60 > 40 + SLACK: the prefix's agent is within the ratio again
    lanes[1].sched.load = 60
    assert router.choose(_seq(CONVERSATION + [7]), lanes) is lanes[1]
    small = [_lane(0, load=0), _lane(1, load=1, blocks=8)]
    _cache(small[1], CONVERSATION)
    assert router.choose(_seq(CONVERSATION + list(range(40))), small) is small[0]  # its free blocks cannot hold the rest


def test_least_load_and_another_adapter_ignore_the_cache():
    lanes = [_lane(0), _lane(1, load=1)]
    _cache(lanes[1], CONVERSATION)
    router, _ = _router("least_load")
    assert router.choose(_seq(CONVERSATION + [7]), lanes) is lanes[0]
    router, _ = _router()
    assert router.choose(_seq(CONVERSATION + [7], LoraRef("ft", 0, 5)), lanes) is lanes[0]
    _cache(lanes[1], CONVERSATION, adapter=5)
    assert router.choose(_seq(CONVERSATION + [7], LoraRef("ft", 0, 5)), lanes) is lanes[1]
