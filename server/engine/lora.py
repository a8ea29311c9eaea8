"""LoRA adapters by name in the agents' slots (serving_config.max_loras). Any number of adapters is
served: lora_modules' and those loaded at run time (vLLM's /v1/load_lora_adapter). The agents hold
`max_loras` of them at once: a request whose adapter is not in a slot waits (parked, in arrival
order) until the least recently used adapter that no running request uses is swapped out for it,
between steps. Every registration has its own key, which starts its prefix-cache chains: its KV is
never served to another adapter, whatever slot either held.

The engine thread changes the tables; any thread resolves a name (a dict read)."""
from __future__ import annotations

import itertools
import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Iterable

from common.config import ServingConfig
from server.request import Request, Status
from server.sampling_params import LoraRef

log = logging.getLogger("llm_serving.engine")


@dataclass(frozen=True)
class Held:
    """An adapter registration: what a slot holds."""
    name: str
    key: int  # this registration's own (SamplingParams.adapter_key)
    path: str


@dataclass(frozen=True)
class Load:
    """A run-time load (`path`) or unload (None) of adapter `name`, answered through `done`; or
    (`done` None) a swap of `name` into a slot, that a parked request waits for."""
    name: str
    path: str | None
    done: Future | None = None


class AdapterSlots:
    """Which adapter each slot holds, by name and key, and the requests parked for theirs; the loads and
    swaps themselves are LoRA's turns between steps (server/engine/lora_turns.py)."""

    def __init__(self, cfg: ServingConfig):
        self.enabled, self.max_loras, self.base = cfg.lora_enabled, cfg.max_loras, {cfg.model_name, *cfg.model_aliases}
        self.keys = itertools.count(1)  # registrations, in order
        self.by_name: dict[str, Held] = {name: Held(name, next(self.keys), path) for name, path in cfg.lora_modules.items()}
        held = list(self.by_name.values())[:self.max_loras] if self.enabled else []
        self.boot: list[Held | None] = held + [None] * (self.max_loras - len(held))  # what an agent loads itself
        self.held = list(self.boot)  # what every agent holds, slot by slot
        self.used: dict[int, int] = {}  # key -> its last placement (a counter): the least recently used goes first
        self._clock = itertools.count(1)
        self.pending: deque[Load] = deque()
        self.parked: deque[Request] = deque()  # waiting for their adapter to be in a slot, oldest first
        self.broken: dict[int, str] = {}  # key -> why its swap-in failed (its parked requests fail with it)

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    def slot_of(self, key: int) -> int:
        return next((s for s, h in enumerate(self.held) if h is not None and h.key == key), -1)

    def resolve(self, name: str) -> LoraRef | None:
        """The adapter a request naming `name` runs with (None: no adapter has that name); its
        slot is the one it holds now (-1: none yet), fixed when the request is placed."""
        a = self.by_name.get(name)
        return LoraRef(name, self.slot_of(a.key), a.key) if a is not None else None

    # ------------------------------------------------------------ engine thread
    def registered(self, key: int) -> bool:
        return any(h.key == key for h in self.by_name.values())

    def place(self, req: Request) -> bool:
        """Whether `req` may be scheduled now: no adapter, or its adapter in a slot and nobody parked
        before it (its slot then fixed), or its adapter unloaded since it was named (slot -1: the
        engine refuses it). Else it is parked (`ready` gives it back)."""
        lora = req.params.lora
        if lora is None:
            return True
        slot = self.slot_of(lora.key)
        if (slot < 0 and self.registered(lora.key)) or (slot >= 0 and self.parked):
            self.parked.append(req)
            return False
        req.params.lora = replace(lora, slot=slot)
        self.used[lora.key] = next(self._clock)
        return True

    def ready(self, live_keys: Iterable[int]) -> list[Request]:
        """Parked requests that may be scheduled now, in order; for the first whose adapter is not in
        a slot, a swap (once an adapter no placed request uses can make room)."""
        out: list[Request] = []
        live = set(live_keys)
        while self.parked:
            req = self.parked[0]
            if req.status is Status.DONE:  # cancelled while parked
                self.parked.popleft()
                continue
            key = req.params.lora.key
            if key in self.broken:  # its parked requests fail; a later request tries its swap again
                self.parked, failed = fail_parked(self.parked, key, self.broken.pop(key))
                out += failed
                continue
            slot = self.slot_of(key)
            if slot < 0 and self.registered(key):
                if not any(op.done is None for op in self.pending):
                    self._swap_in(req.params.lora.name, live)
                return out
            self.parked.popleft()  # in a slot now (or unloaded meanwhile: slot -1, refused)
            req.params.lora = replace(req.params.lora, slot=slot)
            self.used[key] = next(self._clock)
            live.add(key)  # placed: its adapter is no longer one to swap out
            out.append(req)
        return out

    def victim(self, live: set[int]) -> int:
        """An empty slot, else one whose adapter no placed request uses: an unloaded one first, then
        the least recently used (-1: every slot's adapter is in use)."""
        free = [s for s, h in enumerate(self.held) if h is None or h.key not in live]
        return min(free, key=lambda s: (0, 0) if self.held[s] is None else (
            1 + self.registered(self.held[s].key), self.used.get(self.held[s].key, 0)), default=-1)

    def _swap_in(self, name: str, live: set[int]) -> None:
        if self.victim(live) >= 0:
            self.pending.append(Load(name, self.by_name[name].path))

def fail_parked(parked: deque[Request], key: int, why: str) -> tuple[deque[Request], list[Request]]:
    """The parked requests of adapter `key` taken out, each with `why` (the engine ends them), and the
    others, in order. The adapter stays registered: its folder may be back for a later request."""
    failed = [r for r in parked if r.params.lora.key == key]
    for req in failed:
        req.params.lora = replace(req.params.lora, slot=-1, error=why)
    return deque(r for r in parked if r.params.lora.key != key), failed
