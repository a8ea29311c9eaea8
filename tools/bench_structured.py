"""Structured output, measured two ways.

`python -m tools.bench_structured --base-url http://127.0.0.1:8835 --model smollm2`: 20 prompts
through the official `openai` client and TGI's route: `chat.completions.parse` with a pydantic
model, `json_object`, a TGI regex and `tools` with `tool_choice="required"` (streamed and not),
each counted valid against its schema; and the same prompts asking for JSON without a constraint.

`python -m tools.bench_structured --step --rows 64`: what constrained rows cost a decode step on
the agent (SmolLM2, in process): the step with every row under a JSON schema against the same step
with none, alternating; printed per row as a share of an unconstrained row's time.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from typing import Literal

import numpy as np

SUBJECTS = ["a cat", "Paris", "a violin", "the moon", "a bakery", "rain", "a chess club", "Mars", "a lighthouse",
            "coffee", "a marathon", "a library", "winter", "a robot", "a river", "tea", "a museum", "jazz", "a bridge",
            "a garden"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "score", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "score": {"type": "integer", "minimum": 0,
                         "maximum": 10}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                  "maxItems": 3}}}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "look a subject up", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["subject", "detail"],
    "properties": {"subject": {"type": "string", "maxLength": 40}, "detail": {"enum": ["short", "long"]}}}}}


def _valid(text: str | None) -> bool:
    try:
        obj = json.loads(text or "")
    except ValueError:
        return False
    return (isinstance(obj, dict) and set(obj) == {"name", "score", "tags"} and isinstance(obj["name"], str)
            and isinstance(obj["score"], int) and isinstance(obj["tags"], list))


def serving(base_url: str, model: str, max_tokens: int) -> None:
    import httpx
    import openai
    import pydantic

    class Review(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=40)
        score: int = pydantic.Field(ge=0, le=10)
        tags: list[str] = pydantic.Field(max_length=3)
        mood: Literal["good", "bad"]

    c = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=300)
    counts = {"free text asked for JSON: valid": 0, "parse (pydantic)": 0, "json_object: JSON": 0,
              "TGI regex: full match": 0, "tools required: valid calls": 0, "streamed = not streamed": 0}
    for s in SUBJECTS:
        ask = [{"role": "user", "content": f"Review {s} as JSON with keys name, score (0-10) and tags."}]
        free = c.chat.completions.create(model=model, messages=ask, max_tokens=max_tokens, temperature=0)
        counts["free text asked for JSON: valid"] += _valid(free.choices[0].message.content)
        try:
            parsed = c.chat.completions.parse(model=model, messages=ask, response_format=Review, max_tokens=max_tokens)
            counts["parse (pydantic)"] += isinstance(parsed.choices[0].message.parsed, Review)
        except openai.LengthFinishReasonError:  # valid so far, cut by max_tokens: counted as a failure
            pass
        obj = c.chat.completions.create(model=model, messages=ask, max_tokens=max_tokens,
                                        response_format={"type": "json_object"})
        try:
            counts["json_object: JSON"] += isinstance(json.loads(obj.choices[0].message.content), dict)
        except ValueError:
            pass
        body = {"inputs": f"The phone number of {s} is", "parameters": {
            "max_new_tokens": 20, "grammar": {"type": "regex", "value": r" \(\d{3}\) \d{3}-\d{4}"}}}
        out = httpx.post(base_url + "/generate", json=body, timeout=300).json()["generated_text"]
        counts["TGI regex: full match"] += bool(re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", out))
        args = dict(model=model, messages=[{"role": "user", "content": f"Look up {s}."}], tools=[TOOL],
                    tool_choice="required", max_tokens=max_tokens, temperature=0)
        calls = c.chat.completions.create(**args).choices[0].message.tool_calls or []
        ok = len(calls) == 1 and set(json.loads(calls[0].function.arguments)) == {"subject", "detail"}
        counts["tools required: valid calls"] += ok
        streamed = [d for ch in c.chat.completions.create(**args, stream=True) for d in (ch.choices[0].delta.tool_calls or [])]
        counts["streamed = not streamed"] += ok and [(d.function.name, d.function.arguments) for d in streamed] == \
            [(calls[0].function.name, calls[0].function.arguments)]
    for what, n in counts.items():
        print(f"{what}: {n}/{len(SUBJECTS)}")


def step_cost(rows: int, context: int, steps: int, rounds: int) -> None:
    from agent.graph_call import setup_mindspore
    from agent.grammar import Grammars
    from agent.runner import ModelRunner
    from agent.runner_config import RunnerConfig
    from agent.weights.load import load_model
    from common import grammar
    from common.cpu import describe
    from common.model_files import resolve_model
    from common.tokenizer import load_tokenizer
    from server.sampling_params import SamplingParams
    from shm.arena import Arena, ArenaSpec
    from shm.step import RowInput

    files = resolve_model("smollm2")
    cfg, weights = load_model(files, max_position=2 * context)
    setup_mindspore(".cache/mindspore", key=f"bench-structured|{rows}|{context}")
    bs, per_seq = 16, 2 * context // 16
    rc = RunnerConfig(num_blocks=1 + per_seq * rows, block_size=bs, max_model_len=2 * context,
                      token_buckets=[rows], max_running=rows, model_dtype="int8")
    tok = load_tokenizer(files)
    runner = ModelRunner(cfg, weights, rc, calibration=tok.encode("calibration text for the int8 scales"))
    g = runner.seqs.grammars = Grammars(grammar.ll_tokenizer(tok, cfg.vocab_size), cfg.vocab_size, runner.lib)
    text = grammar.from_json_schema(SCHEMA)
    arena = Arena.private(ArenaSpec(rows, rows, per_seq))
    greedy = SamplingParams()
    inputs = [RowInput(i, np.asarray([90], np.int32), context, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)),
                       True, greedy, context, 0) for i in range(rows)]
    view = arena.step(arena.write_step(inputs, bs))
    times: dict[str, list[float]] = {"free": [], "constrained": []}
    for _ in range(rounds):
        for kind in times:
            g.matchers.clear()
            if kind == "constrained":  # fresh matchers: a round walks each through its first `steps` tokens
                for i in range(rows):
                    g.start(i, text, [])
            for _ in range(steps):
                t0 = time.perf_counter()
                runner.step(view, [])
                times[kind].append(time.perf_counter() - t0)
    free, constrained = statistics.median(times["free"]), statistics.median(times["constrained"])
    print(f"CPU: {describe()}")
    print(f"{rows}-row int8 decode step, SmolLM2, {context} keys: unconstrained {free * 1e3:.1f} ms, every row "
          f"constrained {constrained * 1e3:.1f} ms (medians of {rounds} x {steps} steps each)")
    print(f"a constrained row costs {(constrained - free) / rows * 1e6:.0f} us more: "
          f"{(constrained - free) / free:.1%} of an unconstrained row's share of the step")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running server: the 20-prompt validity counts")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--step", action="store_true", help="the step cost of constrained rows (in process)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.base_url:
        serving(args.base_url.rstrip("/"), args.model, args.max_tokens)
    if args.step:
        step_cost(args.rows, args.context, args.steps, args.rounds)
    return 0 if args.base_url or args.step else 2


if __name__ == "__main__":
    raise SystemExit(main())
