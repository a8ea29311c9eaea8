"""Server parts in isolation: detokenizer, block manager, scheduler."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

from server.block_manager import BlockManager
from common.config import ServingConfig
from server.detok import IncrementalDetokenizer
from common.model_files import ModelFiles
from server.sampling_params import SamplingParams
from server.scheduler import Scheduler, Sequence
from common.tokenizer import load_tokenizer
from tests.helpers import ROOT


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(ModelFiles("hf", tiny_model_dir))


def test_detok_never_emits_broken_utf8_and_flushes_last_token(tok):
    text = "héllo 😀!"
    d = IncrementalDetokenizer(tok, [])
    pieces = [d.add(t) for t in tok.encode(text)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + d.finish() == text
    assert pieces[-1] == "!"  # the last token's text is emitted with it


def _byte_token(tok, b: int) -> int:
    """Id of the byte-level token of one raw byte (GPT-2's bytes_to_unicode mapping)."""
    shown = [*range(33, 127), *range(161, 173), *range(174, 256)]
    char = chr(b) if b in shown else chr(256 + sorted(set(range(256)) - set(shown)).index(b))
    return tok.tok.token_to_id(char)


def test_detok_invalid_bytes_are_released_not_held_to_the_end(tok):
    """A model may emit bytes that never form UTF-8 (random weights do): they stream as U+FFFD
    at most MAX_PENDING tokens late, and a valid character right after them is not broken."""
    bad = [_byte_token(tok, 0xFF)] * 6
    good = [_byte_token(tok, b) for b in "中!".encode()]
    d = IncrementalDetokenizer(tok, [])
    pieces = [d.add(t) for t in bad + good]
    assert "".join(pieces[:6]) == "\ufffd" * 3  # the first bad bytes already streamed
    assert "".join(pieces) + d.finish() == "\ufffd" * 6 + "中!"
    assert pieces[-1].endswith("!")


def test_detok_stop_string_is_cut_and_never_streamed(tok):
    d = IncrementalDetokenizer(tok, ["END"])
    out = ""
    for t in tok.encode("abc ENDxyz"):
        out += d.add(t)
        if d.stop_hit():
            break
    out += d.finish()
    assert out == "abc "


def test_block_manager_prefix_cache_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    t1 = bm.match_prefix(prompt)
    assert t1 == [] and bm.grow(t1, 5) and 0 not in t1
    bm.register_full(t1, prompt, 5, [])
    t2 = bm.match_prefix(prompt)
    assert t2 == t1[:2]  # two full blocks shared
    assert bm.refs[t1[0]] == 2
    bm.release(t1)
    bm.release(t2)
    assert bm.num_free == 5  # cached blocks count as free (evictable)
    t3: list[int] = []
    assert bm.grow(t3, 10) and len(t3) == 5  # evicts the cached blocks, oldest first
    assert bm.match_prefix(prompt) == []
    assert not bm.grow(t3, 12)  # out of blocks: refused, table unchanged
    assert len(t3) == 5


def test_match_prefix_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4]
    t = bm.match_prefix(prompt)
    bm.grow(t, 4)
    bm.register_full(t, prompt, 4, [])
    assert len(bm.match_prefix(prompt)) == 1  # not both blocks: the last token must run for its logits


def test_incremental_block_hashes_equal_a_fresh_chain():
    """A sequence's hash cache grows block by block as decode proceeds; the chain must equal the
    one computed from scratch, or prefix hits would silently stop (or, worse, match wrong blocks)."""
    bm = BlockManager(num_blocks=16, block_size=3)
    tokens = list(range(100, 120))
    cache: list[bytes] = []
    table: list[int] = []
    for n in range(1, len(tokens) + 1):
        assert bm.grow(table, n)
        bm.register_full(table, tokens[:n], n, cache)
        assert cache == bm.chain_hashes(tokens[:n])
    assert bm.match_prefix(tokens + [7]) == table[:len(tokens) // 3]


def _registered(bm: BlockManager, tokens: list[int]) -> list[int]:
    table: list[int] = []
    assert bm.grow(table, len(tokens))
    bm.register_full(table, tokens, len(tokens), [])
    return table


def test_a_colliding_prefix_key_never_reuses_another_texts_block():
    """Keys forced to collide (a stub key function): a hit is checked against the block's own tokens
    and its parent's key, so KV computed for other text is never served."""
    everything_collides = BlockManager(num_blocks=16, block_size=2, key=lambda parent, tokens: b"same")
    _registered(everything_collides, [1, 2, 3, 4])
    assert everything_collides.match_prefix([9, 8, 3, 4, 5]) == []
    assert len(everything_collides.match_prefix([1, 2, 3, 4, 5])) == 1  # the same first block is reused

    # a key blind to the parent: [3, 4] after [5, 6] shares its key with [3, 4] after [1, 2]
    parentless = BlockManager(num_blocks=16, block_size=2, key=lambda parent, tokens: bytes(tokens))
    a = _registered(parentless, [5, 6, 3, 4])
    b = _registered(parentless, [1, 2, 7, 7])
    assert parentless.match_prefix([1, 2, 3, 4, 9]) == [b[0]]  # not a[1]: its KV saw 5, 6
    assert parentless.match_prefix([5, 6, 3, 4, 9]) == a


def test_prefix_keys_are_sha256_chained_from_a_salt():
    one, other = BlockManager(8, 2, salt="model-a|float32"), BlockManager(8, 2, salt="model-a|int8")
    keys = one.chain_hashes([1, 2, 3, 4])
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)  # SHA-256 digests
    assert keys != other.chain_hashes([1, 2, 3, 4])  # what changes the KV changes the keys


def _cfg(**kw) -> ServingConfig:
    c = ServingConfig(num_blocks=9, block_size=4, max_model_len=32, prefill_buckets=[8],
                      decode_buckets=[1, 4], max_prefill_rows=2, **kw)
    return c.validate()


def test_scheduler_chunks_long_prompts_and_puts_decodes_first():
    s = Scheduler(_cfg(max_num_batched_tokens=10))
    a = Sequence(list(range(16)), SamplingParams(), 0.0)
    s.add(a)
    plan = s.schedule()
    assert [(p.seq, p.n_tokens, p.sample) for p in plan.rows] == [(a, 10, False)]  # chunk = the budget
    s.update(plan, [None])
    b = Sequence([1, 2, 3], SamplingParams(), 1.0)
    s.add(b)
    plan = s.schedule()
    assert [(p.seq, p.n_tokens, p.sample) for p in plan.rows] == [(a, 6, True), (b, 3, True)]  # packed together
    s.update(plan, [7, 9])
    assert a.output == [7] and b.output == [9] and a.pending == b.pending == 0
    c = Sequence(list(range(100, 120)), SamplingParams(), 2.0)
    s.add(c)
    plan = s.schedule()
    assert [(p.seq, p.n_tokens, p.sample) for p in plan.rows] == [(a, 1, True), (b, 1, True), (c, 8, False)]


def test_scheduler_uses_the_prefill_only_budget_while_nothing_decodes():
    s = Scheduler(ServingConfig(num_blocks=20, block_size=4, max_model_len=32, decode_buckets=[1, 4],
                                max_num_batched_tokens=10, prefill_only_tokens=20).validate())
    a = Sequence(list(range(30)), SamplingParams(), 0.0)
    s.add(a)
    plan = s.schedule()
    assert [(p.n_tokens, p.sample) for p in plan.rows] == [(20, False)]
    s.update(plan, [None])
    plan = s.schedule()
    assert [(p.n_tokens, p.sample) for p in plan.rows] == [(10, True)]
    s.update(plan, [5])
    b = Sequence(list(range(100, 130)), SamplingParams(), 1.0)
    s.add(b)
    plan = s.schedule()  # a decodes now: the mixed budget
    assert [(p.seq, p.n_tokens) for p in plan.rows] == [(a, 1), (b, 9)]


def test_scheduler_ends_a_step_at_a_bucket_rather_than_pad_most_of_the_next():
    cfg = ServingConfig(num_blocks=64, block_size=16, max_model_len=512, prefill_buckets=[128, 256],
                        decode_buckets=[1, 4]).validate()
    assert cfg.token_buckets == [1, 4, 16, 64, 128, 256]
    s = Scheduler(cfg)
    a = Sequence(list(range(141)), SamplingParams(), 0.0)
    s.add(a)
    plan = s.schedule()  # 141 would pad to 256: 128 now, the 13 left next
    assert [(p.n_tokens, p.sample) for p in plan.rows] == [(128, False)]
    s.update(plan, [None])
    plan = s.schedule()
    assert [(p.n_tokens, p.sample) for p in plan.rows] == [(13, True)]
    s.update(plan, [5])
    assert a.output == [5] and a.computed == 141
    for n in (200, 70):  # with a's decode: cutting 73 would save 55; cutting 7 saves 57, less than a step costs
        b = Sequence(list(range(100 * n, 101 * n)), SamplingParams(max_new_tokens=1), 1.0)
        s.add(b)
        plan = s.schedule()
        assert [(p.seq, p.n_tokens, p.sample) for p in plan.rows] == [(a, 1, True), (b, n, True)]
        s.update(plan, [6, 7])
        s.remove(b)


def test_scheduler_keeps_a_prompt_whole_where_the_agent_skips_padding():
    cfg = ServingConfig(num_blocks=64, block_size=16, max_model_len=512, prefill_buckets=[128, 256],
                        decode_buckets=[1, 4]).validate()
    s = Scheduler(cfg, pads_cost=False)
    a = Sequence(list(range(141)), SamplingParams(), 0.0)
    s.add(a)
    plan = s.schedule()  # padding to 256 is free here: the whole prompt, sampled in this step
    assert [(p.n_tokens, p.sample) for p in plan.rows] == [(141, True)]


def test_scheduler_preempts_newest_when_blocks_run_out():
    s = Scheduler(_cfg())  # 8 usable blocks of 4 tokens
    seqs = [Sequence(list(range(i * 10, i * 10 + 8)), SamplingParams(), float(i)) for i in range(3)]
    for q in seqs:
        s.add(q)
    for _ in range(3):  # the 8-token budget admits one prompt per step
        s.update(s.schedule(), [None])
    assert len(s.running) == 3 and s.blocks.num_free == 2
    for q in seqs:
        q.output.append(1)  # each now needs a third block for its next token
    plan = s.schedule()
    assert s.preempted == 1 and plan.preempted == 1 and seqs[2] in s.waiting and seqs[2].computed == 0
    assert [p.seq for p in plan.rows] == seqs[:2]


def test_sjf_policy_orders_by_max_new_tokens():
    s = Scheduler(_cfg(schedule_policy="sjf"))
    long_, short = (Sequence([1, 2], SamplingParams(max_new_tokens=n), float(i)) for i, n in enumerate((50, 5)))
    s.add(long_)
    s.add(short)
    assert s.schedule().rows[0].seq is short


def test_write_step_lays_out_rows_and_slots():
    """Mixed prefill chunk (crossing blocks), decodes and sampling params land where the agent reads."""
    from shm.arena import Arena, ArenaSpec
    from shm.step import RowInput, StepDims

    arena = Arena.private(ArenaSpec(16, 4, 8))
    hot = SamplingParams(temperature=0.7, top_k=5, seed=11, logprobs=2)
    rows = [RowInput(7, np.array([5, 6, 7, 8, 9], np.int32), 2, [3, 9], True, hot, 7, 0),
            RowInput(8, np.array([4], np.int32), 9, [1, 2, 6], True, SamplingParams(), 3, 7),
            RowInput(9, np.array([1, 2], np.int32), 0, [5], False, SamplingParams(), 4, 0)]
    assert arena.write_step(rows, 4) == StepDims(8, 3, 3)
    x, c = arena.full.inputs, arena.full.sampling
    assert x.tokens[:8].tolist() == [5, 6, 7, 8, 9, 4, 1, 2]
    assert x.positions[:8].tolist() == [2, 3, 4, 5, 6, 9, 0, 1]
    # slot = table[pos // 4] * 4 + pos % 4
    assert x.slots[:8].tolist() == [14, 15, 36, 37, 38, 25, 20, 21]
    assert x.query_lens[:3].tolist() == [5, 1, 2]
    assert x.block_tables[:3, :3].tolist() == [[3, 9, 0], [1, 2, 6], [5, 0, 0]]
    assert x.seq_ids[:3].tolist() == [7, 8, 9] and x.sample[:3].tolist() == [1, 1, 0]
    assert c.output_len[:3].tolist() == [0, 7, 0] and c.seed[:3].tolist() == [11, -1, -1]
    assert np.allclose(c.temperature[:2], [0.7, SamplingParams().temperature])
    assert c.top_k[0] == 5 and c.n_logprobs[0] == 2


def test_bench_arrival_bound_caps_output_throughput_at_a_finite_rate():
    from tools.bench_serving import RequestResult, summarize

    # Sent at 0, 1 and 4 s, 100 tokens each, the last answered at 5 s: no server could have ended
    # before 4 s, so 300 tokens / 4 s is the most any could reach.
    res = [RequestResult(ok=True, ttft=0.1, latency=1.0, output_tokens=100, start=10.0 + t) for t in (0, 1, 4)]
    s = summarize(res, duration=5.0)
    assert s["output_throughput"] == 60.0 and s["arrival_bound_throughput"] == 75.0
    burst = [RequestResult(ok=True, latency=1.0, output_tokens=100, start=10.0) for _ in range(3)]
    assert "arrival_bound_throughput" not in summarize(burst, duration=5.0)  # all at once: no bound


def test_bench_random_range_ratio_draws_lengths_in_range():
    from tools.bench_serving import random_dataset

    reqs = random_dataset(200, 200, 128, seed=3, range_ratio=0.9)
    ins, outs = [r.prompt_len for r in reqs], [r.max_tokens for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 380 and min(outs) >= 12 and max(outs) <= 243
    assert max(ins) - min(ins) > 250 and max(outs) - min(outs) > 150  # really spread
    assert all(len(r.prompt.split()) == r.prompt_len for r in reqs)
    fixed = random_dataset(5, 128, 128, seed=1)
    assert {(r.prompt_len, r.max_tokens) for r in fixed} == {(128, 128)}


def test_vocab_checks_allow_padding_and_refuse_another_model():
    from llm_serving.boot import vocab_mismatch

    cfg = ServingConfig()
    assert vocab_mismatch(cfg, 151665, 151936) is None  # Qwen2: embedding padded past the tokenizer
    assert vocab_mismatch(cfg, 260, 272) is None
    assert "the tokenizer has 32000 ids, the model 49152" in vocab_mismatch(cfg, 32000, 49152)  # llama2 on SmolLM2
    cfg.vocab_size = 32000
    assert "model_config.vocab_size is 32000, the model has 49152" in vocab_mismatch(cfg, 49152, 49152)


def test_prefill_batch_window_holds_an_idle_lane_briefly():
    from server.scheduler import Scheduler, Sequence

    cfg = ServingConfig(prefill_batch_waiting_time=0.05, max_prefill_rows=2)
    s = Scheduler(cfg)
    assert s.batch_hold(0.0) == 0.0  # nothing waits
    s.add(Sequence([1, 2, 3], SamplingParams(max_new_tokens=4), arrival=10.0))
    assert s.batch_hold(10.01) == pytest.approx(0.04)  # a lone prompt waits for a companion...
    assert s.batch_hold(10.06) == 0.0  # ...never past the window
    s.add(Sequence([4, 5], SamplingParams(max_new_tokens=4), arrival=10.02))
    assert s.batch_hold(10.03) == 0.0  # a full prefill batch goes at once
    assert ServingConfig().prefill_batch_waiting_time == 0.0  # off by default


def test_unknown_and_unhonoured_config_keys_are_named(tmp_path):
    from common.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("model_config:\n  batching_strategy: static\n  model_dtype: float8\n  mystery: 1\n"
                    "serving_config:\n  decode_batch_waiting_time: 0.5\nextra_section: {}\n")
    notes = load_config(path).notices
    assert any("unknown key model_config.mystery" in n for n in notes)
    assert any("unknown section 'extra_section'" in n for n in notes)
    assert any("batching_strategy 'static'" in n for n in notes)
    assert any("model_dtype 'float8'" in n for n in notes)
    assert any("decode steps never wait" in n for n in notes)
    assert load_config(path).model_dtype == "float32"


@pytest.mark.parametrize("value,dtype", [("DataType.INT8", "int8"), ("int8", "int8"), ("w8a8", "int8"),
                                         ("DataType.FLOAT32", "float32"), ("float8", "float32"),
                                         ("DataType.BFLOAT16", "bfloat16"), ("bf16", "bfloat16"),
                                         ("DataType.FLOAT16", "float16")])
def test_model_dtype_spellings(tmp_path, value, dtype):
    from common.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text(f"model_config:\n  model_dtype: {value}\n")
    cfg = load_config(path)
    assert cfg.model_dtype == dtype
    assert any("model_dtype" in n for n in cfg.notices) == (value == "float8")
    with pytest.raises(ValueError, match="quant_group_size"):
        load_config(path, quant_group_size=2)


def test_config_doc_is_the_config_table():
    """docs/config.md's key tables are generated from common/config_keys.py (python -m tools.config_doc)."""
    from common.config_keys import IGNORED_SECTIONS, KEYS
    from tools.config_doc import DOC, render

    doc = DOC.read_text()
    assert render(doc) == doc, "docs/config.md is stale: run python -m tools.config_doc"
    assert all(f"| `{k.key}` |" in doc for k in KEYS) and all(f"`{s}`" in doc for s in IGNORED_SECTIONS)


def test_a_config_key_is_one_row_of_the_table(tmp_path):
    """Loading, the range check and the notices all follow the table: a row's reader, check and
    ignored reason are what a YAML gets."""
    from common.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("model_config:\n  zactivate_len: [512]\n  seq_length: 64\npa_config:\n  decode_seq_length: 64\n"
                    "serving_config:\n  kv_cache_memory: 1GiB\n  warmup: 'False'\n")
    cfg = load_config(path)
    assert (cfg.prefill_buckets, cfg.max_model_len, cfg.kv_cache_memory, cfg.num_blocks, cfg.warmup) == \
        ([64], 64, 1 << 30, 0, False)
    assert any(n.startswith("model_config.zactivate_len: ignored") for n in cfg.notices)
    path.write_text("serving_config:\n  agent_hosts: localhost\n")
    with pytest.raises(ConfigError, match="agent_hosts = 'localhost': must be a list of hosts"):
        load_config(path)


def test_an_original_ge_yaml_is_served_as_its_ranks_or_refused(tmp_path):
    """The GE backend's `model_path` section (MindIR graphs per rank, one per port) maps to that many
    tensor-parallel ranks of the model's weights; without weights it is refused, never another model."""
    from common.config import ConfigError, load_config

    ge = {"model_path": {"prefill_model": [f"/g/prefill_rank{r}.mindir" for r in range(4)],
                         "decode_model": [f"/g/decode_rank{r}.mindir" for r in range(4)]},
          "serving_config": {"agent_ports": [61166, 61167, 61168, 61169]}}
    path = tmp_path / "ge.yaml"
    path.write_text(yaml.safe_dump({**ge, "model_config": {"model_cfg_path": "/m/predict_llama2_70b.yaml"}}))
    cfg = load_config(path)
    assert cfg.groups == [[0, 1, 2, 3]] and not any("unknown section" in n for n in cfg.notices)
    path.write_text(yaml.safe_dump({**ge, "model_config": {"model_name": "llama_70b"}}))
    with pytest.raises(ConfigError, match="MindIR graphs cannot be served here"):
        load_config(path)
    with pytest.raises(ConfigError, match="must divide the 3 agent_ports"):
        load_config(None, agent_ports=[1, 2, 3], tensor_parallel_size=2)


def test_shipped_configs_need_no_warning():
    from pathlib import Path

    from common.config import load_config

    assert load_config(ROOT / "configs/smollm2.yaml").notices == []


def test_retry_after_follows_the_queue_and_recent_throughput():
    from server.engine.requests import RETRY_AFTER_MAX_S, drain_eta_s

    assert drain_eta_s(50, []) == 1  # nothing finished yet: unknown
    assert drain_eta_s(50, [0.0, 1.0, 2.0, 3.0, 4.0]) == 50  # one request a second
    assert drain_eta_s(50, [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]) == 5  # ten a second
    assert drain_eta_s(10**6, [0.0, 100.0]) == RETRY_AFTER_MAX_S


def test_step_pacer_sends_the_next_step_shortly_before_the_one_in_flight_is_due():
    from server.engine.pacing import EARLY, LEAD_S, StepPacer

    p = StepPacer([16, 64])
    assert p.wait_s(10, started=5.0, now=5.0) == 0.0  # a bucket never timed: send at once
    p.observe(10, 0.2)
    assert abs(p.wait_s(12, 5.0, 5.0) - (0.2 * (1 - EARLY) - LEAD_S)) < 1e-9  # same bucket (16)
    assert p.wait_s(12, 5.0, 5.2) == 0.0 and p.wait_s(40, 5.0, 5.0) == 0.0  # due now; bucket 64 untimed
    p.observe(16, 0.1)
    assert abs(p.took[16] - 0.175) < 1e-9  # a running mean, not the last step alone
