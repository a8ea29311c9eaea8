"""The scheduler's agent roles (serving_config.agent_roles): a prefill agent's finished prompts leave
with their KV through hand-over slots, a decode agent takes them in and never runs a prompt."""
from __future__ import annotations

from common.config import ServingConfig
from common.config_values import Role
from server.sched.handover import HandoverSlots
from server.sampling_params import SamplingParams
from server.sched.scheduler import Scheduler
from server.sched.sequence import Sequence
from tests.helpers import results


def _cfg() -> ServingConfig:
    return ServingConfig(num_blocks=9, block_size=4, max_model_len=32, prefill_buckets=[8], decode_buckets=[1, 4],
                         max_prefill_rows=2).validate()


def _prefilled(slots: HandoverSlots) -> tuple[Scheduler, Sequence]:
    """A 10-token prompt run to its first token on a prefill scheduler (in two steps of 8)."""
    s = Scheduler(_cfg(), role=Role.PREFILL, handover=slots)
    a = Sequence(list(range(10)), SamplingParams(), 0.0)
    s.add(a)
    plan = s.schedule()
    assert [(p.n_tokens, p.sample, p.export) for p in plan.rows] == [(8, False, False)]
    s.update(plan, results([None]))
    return s, a


def test_a_prefill_agent_exports_a_finished_prompt_and_never_decodes_it():
    slots = HandoverSlots(8)
    s, a = _prefilled(slots)
    plan = s.schedule()
    assert [(p.n_tokens, p.sample, p.export) for p in plan.rows] == [(2, True, True)]
    assert len(a.handover) == 3 and slots.num_free == 5  # its 10 tokens' 3 blocks
    assert s.moves.exporting == [a] and s.running == []
    assert not s.schedule()  # nothing to decode here, even with the overlap
    s.update(plan, results([42]))
    table = list(a.table)
    s.handed(a)
    assert a.output == [42] and a.table == [] and s.moves.exporting == [] and s.freed == [a.seq_id]
    assert s.blocks.num_free == 8 and all(s.blocks.refs[b] == 0 for b in table)  # released (still cached)


def test_without_free_slots_a_prompt_stops_one_token_short():
    s, a = _prefilled(HandoverSlots(2))  # 3 needed
    plan = s.schedule()
    assert [(p.n_tokens, p.sample, p.export) for p in plan.rows] == [(1, False, False)]
    assert s.running == [a] and a.handover == []


def test_a_decode_agent_imports_in_order_and_never_admits_a_prompt():
    slots = HandoverSlots(16)
    d = Scheduler(_cfg(), role=Role.DECODE, handover=slots)
    d.add(Sequence([1, 2, 3], SamplingParams(), 0.0))  # a prompt here would never run
    moved = []
    for n in (10, 30):
        seq = Sequence(list(range(n)), SamplingParams(), 0.0, output=[7])
        seq.computed, seq.handover = n, slots.take(-(-n // 4))
        d.moves.incoming.append(seq)
        moved.append(seq)
    plan = d.schedule()
    # the first joins with its first decode; the second's 31 tokens need 8 blocks, 5 are left
    assert [(p.seq, p.n_tokens, p.sample, p.feed, p.imported, p.admitted) for p in plan.rows] == [
        (moved[0], 1, True, False, True, True)]
    assert d.running == [moved[0]] and d.moves.incoming == [moved[1]] and len(d.waiting) == 1
    d.remove(moved[1])  # ended while it waited: its slots are free again
    assert moved[1].handover == [] and slots.num_free == 16 - 3


def test_a_decode_agent_gives_back_what_it_preempted():
    d = Scheduler(_cfg(), role=Role.DECODE, handover=HandoverSlots(8))
    seq = Sequence(list(range(10)), SamplingParams(), 0.0, output=[7])
    seq.computed = 10
    d.moves.incoming.append(seq)
    d.update(d.schedule(), results([8]))
    d._preempt(seq)
    assert d.evicted() == [seq] and d.waiting == [] and seq.seq_id in d.freed and seq.computed == 0


def test_agents_whose_kv_cannot_move_are_named_why():
    """The engine's check before it makes a hand-over segment: one agent, tensor-parallel ranks, or
    KV caches laid out otherwise are refused in words naming the field; tcp agents are not. float16
    and bfloat16 caches have blocks of the same bytes: a decode agent read one as the other."""
    from types import SimpleNamespace

    from server.engine.engine import _why_kv_cannot_move
    from shm.messages import AgentInfo

    def agent(dtype: str = "float32", local: bool = True, **layout: int) -> SimpleNamespace:
        geometry = {"block_size": 4, "num_blocks": 8, "max_model_len": 32}
        kv = {"dtype": dtype, "block_size": 4, "layers": 2, "kv_heads": 2, "head_dim": 8,
              "head_bytes": {"float32": 32, "int8": 12}.get(dtype, 16), **layout}
        return SimpleNamespace(local=local, info=AgentInfo(272, [2], geometry, {}, kv_layout=kv))

    cfg = ServingConfig(num_blocks=9, block_size=4, max_model_len=32, prefill_buckets=[8], decode_buckets=[1, 4],
                        max_prefill_rows=2, agent_ports=[1, 2]).validate()
    assert _why_kv_cannot_move(cfg, [agent(), agent(local=False)]) is None
    assert "one agent" in _why_kv_cannot_move(_cfg(), [agent()])
    assert "differ in dtype (port 1: float16, port 2: bfloat16)" in _why_kv_cannot_move(cfg, [agent("float16"), agent("bfloat16")])
    assert "differ in dtype" in _why_kv_cannot_move(cfg, [agent("float32"), agent("int8")])
    assert "differ in kv_heads" in _why_kv_cannot_move(cfg, [agent(), agent(kv_heads=1)])
    assert "older version" in _why_kv_cannot_move(cfg, [agent(), SimpleNamespace(local=True, info=AgentInfo(272, [2], {}, {}))])
    tp = ServingConfig(num_blocks=9, block_size=4, max_model_len=32, prefill_buckets=[8], decode_buckets=[1, 4],
                       max_prefill_rows=2, agent_ports=[1, 2], tensor_parallel_size=2).validate()
    assert "tensor-parallel" in _why_kv_cannot_move(tp, [agent(), agent()])
