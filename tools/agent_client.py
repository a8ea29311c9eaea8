"""A standalone socket-level client of one agent, or of one tensor-parallel group: the protocol's
executable example (docs/protocol.md).

    python -m tools.agent_client --config configs/smollm2.yaml --prompt "The capital of France is" --max-tokens 16

Attaches (`#`) to a running agent (the YAML's first port by default), runs the prompt through `*`
steps (chunks of at most the agent's largest token bucket), then one `a` step per new token with
greedy sampling (its row is *fed*: the agent takes the token it sampled last), prints the text, the token ids and each step's timings, and detaches (`e`), leaving
the agent free for the next server. Uses shm/ for the protocol and common/ for the YAML; of the
server only its tokenizer. KV blocks are this client's to assign: it takes 1, 2, ... (block 0 is
reserved for padding writes). With `serving_config.tensor_parallel_size` n > 1 it talks to the n
ranks whose rank 0 is `--port` (by the YAML's agent_ports) as one model (shm/group.py): the same commands to each, rank 0's replies.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


from common.config import load_config
from common.model_files import model_identity, resolve_model
from common.tokenizer import load_tokenizer
from shm import protocol as P
from shm.arena import ArenaSpec
from shm.endpoint import agent_address, holder, is_local
from shm.step import RowInput, SamplingColumns, read_row
from shm.group import GroupClient
from shm.transport import AgentClient, AgentError

SEQ_ID = 1


def generate(client: AgentClient | GroupClient, prompt: list[int], max_tokens: int, chunk: int, block_size: int,
             stop_ids: set[int]) -> tuple[list[int], list[dict]]:
    """Greedy generation on an attached agent; returns the new token ids and per-step timings."""
    blocks = list(range(1, 1 + -(-(len(prompt) + max_tokens) // block_size)))
    greedy = SamplingColumns.greedy()
    out: list[int] = []
    steps: list[dict] = []
    fed = 0
    while len(out) < max_tokens:
        if fed < len(prompt):  # `*`: prompt tokens, the last chunk samples
            toks, cmd = prompt[fed:fed + chunk], "*"
        else:  # `a`: one decode token, which the agent takes from its own last sample (0 is a placeholder)
            toks, cmd = [0], "a"
        last = fed + len(toks) >= len(prompt)
        row = RowInput(SEQ_ID, np.asarray(toks, np.int32), fed, blocks, last, greedy, len(prompt), len(out),
                       feed=cmd == "a")
        t0 = time.perf_counter()
        client.send_step(client.arenas[0].write_step([row], block_size), free=[], has_prefill=cmd == "*")
        body = client.poll_step(600)
        if body is None:
            raise TimeoutError("no reply within 600 s")
        steps.append({"cmd": cmd, "n_tokens": len(toks), "wall_ms": round((time.perf_counter() - t0) * 1e3, 2),
                      "model_ms": round(body.model_s * 1e3, 2)})
        fed += len(toks)
        if last:
            token = read_row(client.arenas[0].full.outputs, 0, 0).token
            out.append(token)
            if token in stop_ids:
                break
    return out, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agent_client", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the YAML the agent was started with")
    ap.add_argument("--port", type=int, help="agent port (default: the YAML's first agent_ports entry)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--reset", action="store_true", help="send r first: take the agent from a stuck server")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    port = args.port or cfg.agent_ports[0]
    files = resolve_model(cfg.model_path, cfg.model_cfg_path)
    tok = load_tokenizer(files, cfg.tokenizer_path)
    prompt = tok.encode(args.prompt)
    if len(prompt) + args.max_tokens > cfg.max_model_len:
        ap.error(f"prompt ({len(prompt)} tokens) + max tokens exceed decode_seq_length {cfg.max_model_len}")
    tp = cfg.tensor_parallel_size  # the group whose rank 0 is --port, by the YAML's agent_ports
    ports = cfg.agent_ports[cfg.agent_ports.index(port):][:tp] if tp > 1 and port in cfg.agent_ports else [port]
    pids = [holder(p) if is_local(cfg.agent_ip) else None for p in ports]
    if is_local(cfg.agent_ip) and None in pids:
        print(f"no agent on port {ports[pids.index(None)]}", file=sys.stderr)
        return 1
    chunk = cfg.token_buckets[-1]
    ranks: list[AgentClient] = []
    for r, (p, pid) in enumerate(zip(ports, pids)):  # ranks > 0 read rank 0's arena
        ranks.append(AgentClient(agent_address(p, cfg.agent_ip), ArenaSpec(chunk, 1, cfg.max_blocks_per_seq),
                                 f"client{r}", pid, lead=ranks[0] if ranks else None))
    client = ranks[0] if len(ranks) == 1 else GroupClient(ranks)
    try:
        if args.reset:
            client.call(P.RESET)
        info = [r.handshake(cfg.geometry, model_identity(cfg.model_name, files, cfg.lora_modules), timeout_s=600) for r in ranks][0]
        stop = set() if args.ignore_eos else set(info.eos_token_ids)
        ids, steps = generate(client, prompt, args.max_tokens, chunk, cfg.block_size, stop)
    except (AgentError, TimeoutError) as exc:
        print(f"agent on port {port}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close(detach=True)
    text = tok.decode(ids)
    if args.json:
        print(json.dumps({"text": text, "token_ids": ids, "steps": steps}))
        return 0
    print(f"agent pid {info.pid} on port {port}, model {info.model['name']}\n{args.prompt}{text}")
    print(f"tokens: {ids}")
    for i, s in enumerate(steps):
        print(f"step {i:3d} {s['cmd']} {s['n_tokens']:4d} tokens  wall {s['wall_ms']:8.2f} ms  model {s['model_ms']:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
