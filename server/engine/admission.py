"""A new request on the engine thread: its detokenizer and sequence, its LoRA adapter's slot (it may
wait parked for one), then a lane (server/engine/supervisor.py routes it), or an answer saying why not."""
from __future__ import annotations

import time

from common.tokenizer import TextTokenizer
from server.detok import IncrementalDetokenizer
from server.engine.lora_turns import LoraTurns
from server.engine.metrics import Metrics
from server.engine.requests import Requests
from server.engine.supervisor import Supervisor
from server.request import Request
from server.sched.sequence import Sequence


class Admission:
    def __init__(self, tok: TextTokenizer, requests: Requests, supervisor: Supervisor, metrics: Metrics):
        self.tok, self.requests, self.supervisor, self.metrics = tok, requests, supervisor, metrics
        self.lora: LoraTurns | None = None  # set once LoRA's turns exist (they assign the requests they parked)

    def add(self, req: Request) -> None:
        req.detok = IncrementalDetokenizer(self.tok, req.params.stop)
        req.seq = Sequence(req.prompt, req.params, req.arrival, request=req)
        self.requests.add(req)
        if req.params.lora is None or self.lora.admit(req):
            self.assign(req)

    def assign(self, req: Request) -> None:
        lora = req.params.lora
        if lora is not None and lora.slot < 0:
            self.requests.end(req, "error", lora.error or f"The model `{lora.name}` was unloaded",
                              503 if lora.error else 404)
            return
        lanes = self.supervisor.open_lanes()
        if not lanes:
            self.requests.end(req, "error", f"no live agent: {self.supervisor.health(time.monotonic())[1]}", 503)
            return
        if not lanes[0].sched.fits(req.seq):  # the API caps lengths; this guards the liveness invariant
            self.requests.end(req, "error", "request does not fit the KV cache")
            return
        self.metrics.prompt_tokens.inc(len(req.prompt))
        self.supervisor.assign(req, lanes)
