"""More LoRA adapters than the agents' slots (server/engine/lora.py): a request whose adapter is in
no slot waits, in arrival order, until the least recently used adapter that no placed request uses
is swapped out for it, between steps; one in a slot runs at once. The agents' side of a swap (their
`l` command) is tests/e2e/test_lora_serving.py's; here a lane records what it was told to load, and
LoRA's turns between steps (server/engine/lora_turns.py) run by hand."""
from __future__ import annotations

from types import SimpleNamespace

from common.config import ServingConfig
from server.engine.lora import AdapterSlots
from server.engine.lora_turns import LoraTurns
from server.engine.messages import AgentBack
from server.request import Request
from server.sampling_params import SamplingParams


class Lane:
    def __init__(self) -> None:
        self.live, self.busy, self.loads = True, False, []
        self.client = SimpleNamespace(call=lambda cmd, header, timeout: self.loads.append((header["slot"], header["name"])))


def _request(slots: AdapterSlots, name: str) -> Request:
    return Request(name, [1], SamplingParams(lora=slots.resolve(name)), sink=None)


def _turns(slots: AdapterSlots, lane: Lane) -> LoraTurns:
    return LoraTurns(slots, [lane], requests=None, assign=None, inbox=None)


def _live(reqs: list[Request]) -> list[int]:
    return [r.params.adapter_key for r in reqs]


def test_adapters_beyond_the_slots_are_swapped_in_least_recently_used_first():
    cfg = ServingConfig(lora_modules={"a": "/a", "b": "/b", "c": "/c"}, max_loras=2)
    slots, lane = AdapterSlots(cfg), Lane()
    assert [h.name for h in slots.boot] == ["a", "b"] and slots.resolve("c").slot == -1
    a, b = _request(slots, "a"), _request(slots, "b")
    assert slots.place(a) and slots.place(b) and (a.params.lora.slot, b.params.lora.slot) == (0, 1)
    c, a2 = _request(slots, "c"), _request(slots, "a")
    assert not slots.place(c) and not slots.place(a2)  # a2 waits behind c: arrival order
    assert slots.ready(_live([a, b])) == [] and not slots.pending  # every slot's adapter runs: no swap yet
    assert slots.ready(_live([a])) == [] and _turns(slots, lane).holds_steps()  # b ended: c goes into b's slot
    lane.busy = True
    _turns(slots, lane).apply(set(_live([a])))
    assert lane.loads == []  # not while a step is in flight
    lane.busy = False
    _turns(slots, lane).apply(set(_live([a])))
    assert lane.loads == [(1, "c")] and [r.request_id for r in slots.ready(_live([a]))] == ["c", "a"]
    assert (c.params.lora.slot, a2.params.lora.slot) == (1, 0)
    b2 = _request(slots, "b")  # b now waits for the least recently used adapter nothing runs on
    assert not slots.place(b2) and slots.ready(_live([c])) == []
    _turns(slots, lane).apply(set(_live([c])))
    assert lane.loads[-1] == (0, "b") and slots.ready(_live([c])) == [b2]


def test_an_agent_restarted_gets_what_the_slots_hold_since_its_start():
    slots, lane = AdapterSlots(ServingConfig(lora_modules={"a": "/a", "b": "/b"}, max_loras=1)), Lane()
    b = _request(slots, "b")
    assert not slots.place(b)
    slots.ready([])
    _turns(slots, lane).apply(set([]))
    _turns(slots, lane).agent_back(AgentBack(0, lane.client, None))
    assert lane.loads == [(0, "b"), (0, "b")]  # the swap, then again into the restarted agent


def test_a_swap_the_agents_refuse_fails_its_requests_saying_why_and_a_later_one_tries_again():
    """An adapter whose folder went away after it was swapped out: its waiting requests fail naming
    the agents' refusal (not "unloaded"), it stays registered, and a request after tries again."""
    slots, lane = AdapterSlots(ServingConfig(lora_modules={"a": "/a", "b": "/b"}, max_loras=1)), Lane()
    refuse = True

    def call(cmd, header, timeout):
        if refuse:
            raise RuntimeError(f"no adapter_config.json in {header['path']}")
        lane.loads.append((header["slot"], header["name"]))

    lane.client = SimpleNamespace(call=call)
    b1, b2 = _request(slots, "b"), _request(slots, "b")
    assert not slots.place(b1) and not slots.place(b2)
    slots.ready([])
    _turns(slots, lane).apply(set([]))
    failed = slots.ready([])
    assert failed == [b1, b2] and all(r.params.lora.slot == -1 for r in failed)
    assert "`b` could not be loaded into a slot" in b1.params.lora.error and "/b" in b1.params.lora.error
    assert "b" in slots.names and not slots.parked
    refuse = False
    b3 = _request(slots, "b")
    assert not slots.place(b3)
    slots.ready([])
    _turns(slots, lane).apply(set([]))
    assert slots.ready([]) == [b3] and b3.params.lora.slot == 0 and not b3.params.lora.error
