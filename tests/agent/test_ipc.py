"""shm/ codec, arena and transport with real agent processes, ZeroMQ and POSIX shared memory."""
from __future__ import annotations

import os
import signal

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from llm_serving.agents import start_agents, stop_agents
from common.config import load_config
from llm_serving.boot import connect_agents
from server.sampling_params import SamplingParams
from shm import protocol as P
from shm.arena import Arena, ArenaSpec, Segment, clean_stale_segments, our_segments, segment_name
from shm.endpoint import agent_address
from shm.step import RowInput, StepDims
from shm.transport import AgentDead, AgentError
from tests.helpers import ServerProcess, tiny_config


def test_codec_round_trip():
    parts = P.encode(P.DECODE_STEP, {"n_tokens": 3, "n_rows": 3, "width": 2, "n_scored": 0, "n_drafts": 0, "slot": 1, "free": [7, 9],
                                     "id": 5}, [b"xy"])
    msg = P.decode(parts)
    assert msg.cmd == P.DECODE_STEP and msg.header["free"] == [7, 9] and msg.frames == [b"xy"]
    ok, body, _ = P.decode_reply(P.encode_reply(False, {"error": "boom", "id": 5}))
    assert not ok and body == {"error": "boom", "id": 5}


V = P.VERSION
HELLO = {"v": V, "arena": None, "spec": {"max_tokens": 8, "max_rows": 2, "max_blocks": 2, "slots": 2}, "server_pid": 1,
         "geometry": {"block_size": 4, "num_blocks": 8, "max_model_len": 8}, "model": {"name": "m", "digest": "d"}}
STEP = {"v": V, "n_tokens": 1, "n_rows": 1, "width": 1, "n_scored": 0, "n_drafts": 0, "slot": 0, "free": []}


@pytest.mark.parametrize("parts, why", [
    ([b""], "empty"), ([b"Z" + msgpack.packb({"v": V})], "unknown command"),
    ([b"*" + msgpack.packb({**STEP, "v": 99})], "version"),
    ([b"*" + msgpack.packb({**STEP, "v": 2})], "version 2"),
    ([b"*" + msgpack.packb({**STEP, "n_tokens": "1"})], "n_tokens"),
    ([b"a" + msgpack.packb({**STEP, "n_tokens": -1})], "negative"),
    ([b"a" + msgpack.packb({**STEP, "slot": -1})], "negative slot"),
    ([b"a" + msgpack.packb({k: v for k, v in STEP.items() if k != "slot"})], "slot"),
    ([b"a" + msgpack.packb({**STEP, "free": [True]})], "free"),
    ([b"*" + msgpack.packb({k: v for k, v in STEP.items() if k != "n_scored"})], "n_scored"),
    ([b"*" + msgpack.packb({**STEP, "handover": 5, "export": [[1, [2], [0]]]})], "handover"),
    ([b"*" + msgpack.packb({**STEP, "handover": "h", "import": [[1, [2]]]})], "import must list"),
    ([b"*" + msgpack.packb({**STEP, "handover": "h", "export": [[1, [2], ["0"]]]})], "export must list"),
    ([b"*" + msgpack.packb({**STEP, "histories": [[1, 2]]})], "histories must list"),
    ([b"a\xc1\xff"], "msgpack"), ([b"#" + msgpack.packb([1, 2])], "not a map"),
    ([b"#" + msgpack.packb({k: v for k, v in HELLO.items() if k != "geometry"})], "geometry"),
    ([b"#" + msgpack.packb({**HELLO, "geometry": {**HELLO["geometry"], "block_size": "4"}})], "geometry.block_size"),
    ([b"#" + msgpack.packb({**HELLO, "model": {"name": "m"}})], "model.digest"),
])
def test_codec_rejects_malformed(parts, why):
    with pytest.raises(P.ProtocolError, match=why):
        P.decode(parts)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=3))
def test_codec_fuzz_only_raises_protocol_error(parts):
    try:
        P.decode(parts)
    except P.ProtocolError:
        pass


_values = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=8) | st.binary(max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(P.COMMANDS)), st.dictionaries(st.sampled_from(sorted(HELLO) + ["n_tokens", "free", "x"]),
                                                            _values | st.dictionaries(st.text(max_size=12), _values)))
def test_codec_fuzz_of_typed_headers(cmd, header):
    """Well-formed msgpack with wrong or missing fields (the handshake's nested geometry/model
    included): decoded, or refused with ProtocolError; never another exception."""
    try:
        msg = P.decode([cmd + msgpack.packb({**header, "v": V})])
    except P.ProtocolError:
        return
    if cmd == P.HANDSHAKE:
        assert all(isinstance(msg.header["geometry"][k], int) for k in P.GEOMETRY_KEYS)


def test_arena_layout_is_identical_on_both_sides():
    spec = ArenaSpec(64, 8, 5, slots=2)
    a, b = Arena.slots(spec), Arena.slots(ArenaSpec.from_wire(spec.to_wire()))
    a[1].full.inputs.block_tables[2, :3] = [4, 5, 6]
    b[0].buf[:] = a[0].buf
    assert list(b[1].full.inputs.block_tables[2, :3]) == [4, 5, 6]
    assert not b[0].full.inputs.block_tables.any()  # the slots do not overlap
    assert a[0].full.sampling.temperature.dtype == np.float32  # never float16, unlike the original
    for bad in ({**spec.to_wire(), "slots": 0}, {**spec.to_wire(), "slots": 99}, {"max_tokens": 8}):
        with pytest.raises(ValueError, match="bad arena spec"):
            ArenaSpec.from_wire(bad)


def test_port_lock_names_its_holder_and_stale_files_are_cleaned(tmp_path, monkeypatch):
    from shm.endpoint import PortInUse, PortLock, clean_stale_endpoints, holder

    monkeypatch.setenv("LLM_SERVING_RUNTIME_DIR", str(tmp_path))
    lock = PortLock(5000)
    with pytest.raises(PortInUse, match=f"port 5000 in use by pid {os.getpid()}"):
        PortLock(5000)
    assert holder(5000) == os.getpid() and clean_stale_endpoints() == []
    lock.release()
    assert holder(5000) is None and list(tmp_path.iterdir()) == []
    # A SIGKILLed agent's files (nobody holds the lock), and an old socket without a lock file.
    (tmp_path / "llm-serving-agent-5001.lock").write_text("123")
    (tmp_path / "llm-serving-agent-5001.sock").touch()
    (tmp_path / "llm-serving-agent-5002.sock").touch()
    assert clean_stale_endpoints() == [5001, 5002] and list(tmp_path.iterdir()) == []


def _started(tmp_path, tiny_model_dir):
    path = tiny_config(tmp_path, tiny_model_dir)
    cfg = load_config(path)
    procs = start_agents(cfg, str(path), {})
    yield cfg, procs
    stop_agents(procs)


@pytest.fixture(scope="module")
def agent(tmp_path_factory, tiny_model_dir):
    """One agent for the tests that leave it serving (each checks it still does)."""
    yield from _started(tmp_path_factory.mktemp("agent"), tiny_model_dir)


@pytest.fixture()
def own_agent(tmp_path, tiny_model_dir):
    """An agent for a test that kills it."""
    yield from _started(tmp_path, tiny_model_dir)


def _decode_step(client, cfg):
    rows = [RowInput(1, np.asarray([5, 6, 7], np.int32), 0, [1], True, SamplingParams(), 3, 0)]
    client.send_step(client.arenas[0].write_step(rows, cfg.block_size), free=[], has_prefill=True)
    return client.poll_step(30)


def test_the_agent_reports_the_kv_layout_its_cache_has(agent):
    """What a server compares before moving KV between agents (dtype, block size, layers, heads, head
    bytes) is what the agent's cache holds: its bytes follow from the layout."""
    cfg, _ = agent
    [client] = connect_agents(cfg)
    try:
        kv = client.info.kv_layout
        assert sorted(kv) == sorted(P.KV_LAYOUT_KEYS) and kv["dtype"] == client.info.kv_cache_dtype
        assert kv["block_size"] == cfg.block_size
        block = 2 * kv["layers"] * kv["kv_heads"] * kv["head_bytes"] * kv["block_size"]
        assert block * client.info.geometry["num_blocks"] == client.info.kv_cache_bytes
    finally:
        client.close()


def test_agent_survives_garbage_and_keeps_serving(agent):
    cfg, _ = agent
    [client] = connect_agents(cfg)
    try:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(agent_address(cfg.agent_ports[0]))
        for junk in ([b"\x00garbage"], [b"*" + b"\xff" * 10], [b"a" + msgpack.packb({"v": 1})]):
            raw.send_multipart(junk)
            assert raw.poll(10_000), "agent did not answer garbage"
            ok, body, _ = P.decode_reply(raw.recv_multipart())
            assert not ok and body["error"].startswith("protocol")
        raw.close(0)
        # A well-formed step with out-of-range content is refused with a reason, not a crash.
        client.arenas[0].full.inputs.tokens[0] = 10**6
        client.send_step(StepDims(1, 1, 1), [], True)
        with pytest.raises(AgentError, match="tokens out of range"):
            client.poll_step(30)
        assert _decode_step(client, cfg) is not None
        assert 0 <= client.arenas[0].full.outputs.ids[0] < client.info.vocab_size
        assert client.call(P.HEARTBEAT)["attached"]
    finally:
        client.close()


def test_second_server_is_refused_while_first_is_attached(agent):
    cfg, _ = agent
    [first] = connect_agents(cfg)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    try:
        raw.connect(agent_address(cfg.agent_ports[0]))
        other_live_pid = os.getppid()
        raw.send_multipart(P.encode(P.HANDSHAKE, {"arena": None, "spec": first.spec.to_wire(),
                                                  "server_pid": other_live_pid, "geometry": cfg.geometry,
                                                  "model": first.info.model, "id": 1}))
        assert raw.poll(10_000)
        ok, body, _ = P.decode_reply(raw.recv_multipart())
        assert not ok and body["code"] == P.E_BUSY and f"server pid {os.getpid()}" in body["error"]
        assert _decode_step(first, cfg) is not None  # the first server is unaffected
    finally:
        raw.close(0)
        first.close()


def test_a_client_reconnecting_with_its_routing_id_takes_the_connection_over(agent):
    """A server's client that reconnects before the agent saw its old connection end (the old one
    is still open here) is answered: ZeroMQ's ROUTER would drop it and its handshake would hang."""
    cfg, _ = agent
    [first] = connect_agents(cfg)
    again = zmq.Context.instance().socket(zmq.DEALER)
    try:
        again.setsockopt(zmq.LINGER, 0)
        again.setsockopt(zmq.ROUTING_ID, first.sock.getsockopt(zmq.ROUTING_ID))
        again.connect(agent_address(cfg.agent_ports[0]))
        for mid, cmd in enumerate((P.HEARTBEAT, P.DETACH), 1):
            again.send_multipart(P.encode(cmd, {"id": mid}))
            assert again.poll(30_000), f"no answer to {cmd!r} on the reconnect"
            ok, body, _ = P.decode_reply(again.recv_multipart())
            assert ok and body["id"] == mid
    finally:
        again.close(0)
        first.close(detach=False)  # its connection went to `again`, which detached


def test_agent_sigkill_is_seen_before_any_timeout(own_agent):
    cfg, procs = own_agent
    [client] = connect_agents(cfg)
    try:
        _decode_step(client, cfg)
        os.kill(procs[0].pid, signal.SIGKILL)
        with pytest.raises(AgentDead):  # from the death, not the poll's timeout (that returns None)
            client.send(P.HEARTBEAT)
            client.poll(600)
    finally:
        client.close(detach=False)
    assert not [s for s in our_segments() if s.startswith(f"llmserving-{os.getpid()}-")]


def test_no_segment_left_after_sigkill_of_everything_and_restart(tmp_path, tiny_model_dir):
    cfg_path = tiny_config(tmp_path, tiny_model_dir)
    server = ServerProcess(cfg_path)
    pid = server.proc.pid
    assert any(s.startswith(f"llmserving-{pid}-") for s in our_segments())
    os.killpg(pid, signal.SIGKILL)  # the server and its agents, with no chance to clean up
    server.proc.wait(10)
    assert any(s.startswith(f"llmserving-{pid}-") for s in our_segments())  # leaked by the kill
    restarted = ServerProcess(cfg_path)
    assert not any(s.startswith(f"llmserving-{pid}-") for s in our_segments())  # cleaned at start
    new_pid = restarted.proc.pid
    assert restarted.stop() in (0, 128 + signal.SIGTERM)
    assert not any(s.startswith(f"llmserving-{new_pid}-") for s in our_segments())  # unlinked on SIGTERM
    assert clean_stale_segments() == []


def test_remote_agent_over_tcp_gets_tensors_as_frames(tmp_path, tiny_model_dir):
    """agent_ip other than localhost: tcp transport, no shared memory; same outputs as ipc."""
    results = {}
    for ip in ("127.0.0.1", "127.0.0.2"):
        path = tiny_config(tmp_path, tiny_model_dir, agent_ip=ip)
        cfg = load_config(path)
        procs = start_agents(cfg, str(path), {})
        try:
            [client] = connect_agents(cfg)
            try:
                assert client.local == (ip == "127.0.0.1") and (client.segment is None) == (ip != "127.0.0.1")
                _decode_step(client, cfg)
                results[ip] = int(client.arenas[0].full.outputs.ids[0])
            finally:
                client.close()
        finally:
            stop_agents(procs)
    assert results["127.0.0.1"] == results["127.0.0.2"]


def _prefill_rows(seq_base: int, block_base: int) -> list[RowInput]:
    return [RowInput(seq_base, np.asarray([5, 6, 7], np.int32), 0, [block_base], True, SamplingParams(), 3, 0),
            RowInput(seq_base + 1, np.asarray([8, 9], np.int32), 0, [block_base + 1], True, SamplingParams(), 2, 0)]


def test_pipelined_fed_decodes_match_decodes_that_carry_their_tokens(agent):
    """Protocol v3: `a` rows fed by the agent's own last samples, sent into the second arena slot
    before the first step's reply, give the tokens that decodes carrying those tokens give; a fed
    row of a sequence the agent never sampled fails alone (-1)."""
    cfg, _ = agent
    [client] = connect_agents(cfg)
    try:
        # Sequential: prefill, read the samples, send them back as tokens (`*`).
        client.send_step(client.arenas[0].write_step(_prefill_rows(1, 1), cfg.block_size), [], True)
        assert client.poll_step(30) is not None
        first = client.arenas[0].full.outputs.ids[:2].tolist()
        rows = [RowInput(1, np.asarray([first[0]], np.int32), 3, [1], True, SamplingParams(), 3, 1),
                RowInput(2, np.asarray([first[1]], np.int32), 2, [2], True, SamplingParams(), 2, 1)]
        client.send_step(client.arenas[0].write_step(rows, cfg.block_size), [], True)
        assert client.poll_step(30) is not None
        expected = client.arenas[0].full.outputs.ids[:2].tolist()
        # Pipelined: the decode is in flight before the prefill's reply, and names no token.
        client.send_step(client.arenas[0].write_step(_prefill_rows(3, 3), cfg.block_size), [1, 2], True, slot=0)
        fed = [RowInput(3, np.zeros(1, np.int32), 3, [3], True, SamplingParams(), 3, 1, feed=True),
               RowInput(99, np.zeros(1, np.int32), 0, [5], True, SamplingParams(), 0, 1, feed=True),
               RowInput(4, np.zeros(1, np.int32), 2, [4], True, SamplingParams(), 2, 1, feed=True)]
        client.send_step(client.arenas[1].write_step(fed, cfg.block_size), [], False, slot=1)
        assert client.in_flight == 2
        assert client.poll_step(30) is not None and client.poll_step(30) is not None
        assert client.arenas[0].full.outputs.ids[:2].tolist() == first
        assert client.arenas[1].full.outputs.ids[:3].tolist() == [expected[0], -1, expected[1]]
    finally:
        client.close()


@pytest.fixture()
def attached(agent):
    cfg, _ = agent
    [client] = connect_agents(cfg)
    yield cfg, client
    client.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 2), st.integers(0, 1), st.integers(-3, 3)),
                min_size=1, max_size=2),
       st.sampled_from([P.DECODE_STEP, P.FULL_STEP]), st.integers(-1, 3),
       st.lists(st.sampled_from([-2, -1, -1, 0, 7, 10**6]), min_size=4, max_size=4), st.integers(-1, 1))
def test_step_payload_fuzz_is_answered_and_the_agent_keeps_serving(attached, rows, cmd, slot, targets, miscount):
    """Any well-framed step (fed flags, query lengths, sample flags, sequence ids, slot, scored
    tokens and their count): an ok reply, or a `bad_step`/`protocol` error naming why; the next
    normal step still runs."""
    cfg, client = attached
    x = client.arenas[0].full.inputs
    qlens = [q for _, q, _, _ in rows]
    n = sum(qlens)
    x.tokens[:n], x.positions[:n], x.slots[:n] = 1, np.arange(n), np.arange(n) + cfg.block_size
    x.query_lens[:len(rows)] = qlens
    x.block_tables[:len(rows), :1] = 1
    x.feed[:len(rows)] = [f for f, _, _, _ in rows]
    x.sample[:len(rows)] = [s for _, _, s, _ in rows]
    x.seq_ids[:len(rows)] = [s for _, _, _, s in rows]
    x.targets[:n] = targets[:n]
    x.spec_len[:len(rows)] = 0
    n_scored = max(0, sum(t >= 0 for t in targets[:n]) + miscount)
    # `free` first drops what earlier examples sampled: a fed row here has no sample to take.
    client.send(cmd, {"n_tokens": n, "n_rows": len(rows), "width": 1, "slot": slot, "free": [-3, -2, -1, 0, 1, 2, 3],
                      "n_scored": n_scored, "n_drafts": 0}, dims=StepDims(n, len(rows), 1, n_scored))
    try:
        assert client.poll_step(30) is not None
        fed = [i for i, (f, _, s, _) in enumerate(rows) if f == 1 and s == 1]
        assert all(client.arenas[0].full.outputs.ids[i] == -1 for i in fed)
    except AgentError as exc:
        assert exc.code in (P.E_BAD_STEP, P.E_PROTOCOL), exc
    assert _decode_step(client, cfg) is not None


def _step_moving(client, cfg, seq: int, table: list[int], extra: dict, kv_frames: list | None = None):
    rows = [RowInput(seq, np.asarray([5, 6, 7], np.int32), 0, table, True, SamplingParams(), 3, 0)]
    client.send_step(client.arenas[0].write_step(rows, cfg.block_size), free=[], has_prefill=True, extra=extra,
                     kv_frames=kv_frames)
    return client.poll_step(30)


def test_a_hand_over_outside_the_pool_segment_or_frames_is_refused_before_the_step_runs(attached):
    cfg, client = attached
    slot = client.info.kv_cache_bytes // client.info.geometry["num_blocks"]
    seg = Segment(segment_name("test-handover"), 4 * slot, create=True)
    try:
        h, frame = seg.name, bytes(slot)
        for extra, frames in (({"handover": h, "export": [[1, [cfg.num_blocks], [0]]]}, None),  # past the pool
                              ({"handover": h, "import": [[1, [0], [0]]]}, None),  # block 0 is the padding's
                              ({"handover": h, "export": [[1, [1], [10**6]]]}, None),  # past the segment
                              ({"handover": h, "import": [[1, [1, 2], [0]]]}, None),  # one slot for two blocks
                              ({"handover": "llmserving-no-such-segment", "export": [[1, [1], [0]]]}, None),
                              ({"import": [[1, [1], [0]]]}, [b"xy"]),  # a frame that is not a slot
                              ({"import": [[1, [1], [1]]]}, [frame]),  # past the frames
                              ({"export": [[1, [1], [1]]]}, None),  # past the slots its reply carries
                              ({}, [frame]),  # frames and no hand-over
                              ({"handover": h, "import": [[1, [1], [0]]]}, [frame])):  # a segment and frames
            with pytest.raises(AgentError) as exc:
                _step_moving(client, cfg, 1, [1], extra, frames)
            assert exc.value.code == P.E_BAD_STEP, (extra, exc.value)
        assert _decode_step(client, cfg) is not None
    finally:
        seg.close()


def test_blocks_move_as_frames_as_they_do_through_a_segment(attached):
    """A tcp agent's hand-over: the same bytes in a reply's frames as in the segment, and frames
    imported into a block export again unchanged."""
    cfg, client = attached
    seg = Segment(segment_name("test-handover"), 2 * (client.info.kv_cache_bytes // cfg.num_blocks), create=True)
    try:
        [frame] = _step_moving(client, cfg, 1, [1], {"export": [[1, [1], [0]]]}).kv_frames
        assert _step_moving(client, cfg, 1, [1], {"handover": seg.name, "export": [[1, [1], [0]]]}).kv_frames == []
        assert bytes(seg.buf[:len(frame)]) == frame and any(frame)
        moved = _step_moving(client, cfg, 2, [3], {"import": [[2, [2], [0]]], "export": [[2, [2], [0]]]}, [frame])
        assert moved.kv_frames == [frame]
    finally:
        seg.close()
