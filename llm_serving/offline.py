"""Offline batch generation: the same agents, scheduler, sampler and detokenizer as the HTTP server,
driven from Python (vLLM's `LLM(...).generate(prompts, params)`).

    from llm_serving import LLM, SamplingParams
    with LLM("configs/smollm2.yaml") as llm:
        for out in llm.generate(["The capital of France is"], SamplingParams(max_new_tokens=16)):
            print(out.text)
"""
from __future__ import annotations

import asyncio
import copy
import uuid
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from common.config import load_config
from llm_serving.agents import stop_agents
from llm_serving.boot import start_engine
from server.engine.engine import QueueFull
from server.prompts import encode_prompt
from server.request import Request, Sink
from server.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class Completion:
    prompt: Prompt
    text: str
    token_ids: list[int]
    logprobs: list[float]  # of each generated token
    finish_reason: str  # stop | length


class LLM:
    """Starts the agents of a serving YAML (or attaches to running ones) and runs prompts through them."""

    def __init__(self, config: str | None = None, *, attach: bool = False, **overrides: Any):
        self.cfg = load_config(config, **overrides)
        self.engine, self.tok, self._procs = start_engine(self.cfg, config, overrides, attach)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None,
                 progress: bool = True, lora: str | None = None) -> list[Completion]:
        """Completions in the order of `prompts` (one prompt: a list of one). Greedy by default; a
        request that fails raises RuntimeError with its reason. `lora`: a LoRA adapter's name
        (serving_config.lora_modules; None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = copy.copy(params or SamplingParams(max_new_tokens=None))
        if lora is not None:
            params.lora = self.engine.adapters.resolve(lora)
            if params.lora is None:
                raise ValueError(f"lora {lora!r}: not a LoRA adapter of this server {self.engine.adapters.names}")
        return asyncio.run(self._run(list(prompts), params, progress))

    async def _run(self, prompts: list[Prompt], params: SamplingParams, progress: bool) -> list[Completion]:
        bar = tqdm(total=len(prompts), desc="generating", unit="req", disable=not progress)
        try:
            return list(await asyncio.gather(*(self._one(p, copy.deepcopy(params), bar) for p in prompts)))
        finally:
            bar.close()

    async def _one(self, prompt: Prompt, params: SamplingParams, bar: tqdm) -> Completion:
        ids = encode_prompt(self.tok, self.cfg, prompt, params.validate())
        queue: asyncio.Queue = asyncio.Queue()
        req = Request(uuid.uuid4().hex, ids, params, sink=Sink(asyncio.get_running_loop(), queue))
        while True:  # the engine's queue is bounded: wait for room instead of failing
            try:
                self.engine.submit(req)
                break
            except QueueFull:
                await asyncio.sleep(0.05)
        text, token_ids, logprobs = "", [], []
        while True:
            d = await queue.get()
            text += d.text
            if d.token_id is not None:
                token_ids.append(d.token_id)
                logprobs.append(d.logprob)
            if d.finish_reason:
                if d.error or d.finish_reason not in ("eos", "stop", "length"):
                    raise RuntimeError(f"request ended: {d.finish_reason}: {d.error}")
                bar.update(1)  # vLLM's reasons: the end of sequence is a "stop" too
                return Completion(prompt, text, token_ids, logprobs, "length" if d.finish_reason == "length" else "stop")

    def close(self) -> None:
        self.engine.shutdown()
        stop_agents(self._procs)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()
