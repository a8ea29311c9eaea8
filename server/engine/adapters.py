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
from typing import Any, Iterable

from common.config import ServingConfig
from common.config_values import adapter_name_problem
from server.request import Request, Status
from server.sampling_params import LoraRef
from shm import protocol as P

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


class AdapterError(ValueError):
    """A load or unload that cannot be done: the message says why (HTTP 400 or 404)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class AdapterSlots:
    def __init__(self, cfg: ServingConfig):
        self.enabled, self.max_loras, self.base = cfg.lora_enabled, cfg.max_loras, {cfg.model_name, *cfg.model_aliases}
        self._keys = itertools.count(1)
        self.by_name: dict[str, Held] = {name: Held(name, next(self._keys), path) for name, path in cfg.lora_modules.items()}
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
    def _registered(self, key: int) -> bool:
        return any(h.key == key for h in self.by_name.values())

    def place(self, req: Request) -> bool:
        """Whether `req` may be scheduled now: no adapter, or its adapter in a slot and nobody parked
        before it (its slot then fixed), or its adapter unloaded since it was named (slot -1: the
        engine refuses it). Else it is parked (`ready` gives it back)."""
        lora = req.params.lora
        if lora is None:
            return True
        slot = self.slot_of(lora.key)
        if (slot < 0 and self._registered(lora.key)) or (slot >= 0 and self.parked):
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
            if slot < 0 and self._registered(key):
                if not any(op.done is None for op in self.pending):
                    self._swap_in(req.params.lora.name, live)
                return out
            self.parked.popleft()  # in a slot now (or unloaded meanwhile: slot -1, refused)
            req.params.lora = replace(req.params.lora, slot=slot)
            self.used[key] = next(self._clock)
            live.add(key)  # placed: its adapter is no longer one to swap out
            out.append(req)
        return out

    def _victim(self, live: set[int]) -> int:
        """An empty slot, else one whose adapter no placed request uses: an unloaded one first, then
        the least recently used (-1: every slot's adapter is in use)."""
        free = [s for s, h in enumerate(self.held) if h is None or h.key not in live]
        return min(free, key=lambda s: (0, 0) if self.held[s] is None else (
            1 + self._registered(self.held[s].key), self.used.get(self.held[s].key, 0)), default=-1)

    def _swap_in(self, name: str, live: set[int]) -> None:
        if self._victim(live) >= 0:
            self.pending.append(Load(name, self.by_name[name].path))

    @property
    def holds_steps(self) -> bool:
        """A load is next: no step may be sent until it is in (it waits for the steps in flight)."""
        return bool(self.pending) and self.pending[0].path is not None

    def apply(self, lanes: list[Any], live_keys: Iterable[int]) -> None:
        """The pending unloads, loads and swaps, in order; a load only once no lane has a step in flight."""
        live = set(live_keys)
        while self.pending:
            op = self.pending[0]
            why = self._refusal(op, live) if op.done is not None and op.path is not None else None
            if why is not None:  # at once: what refuses a load does not wait for the steps in flight
                self.pending.popleft().done.set_exception(AdapterError(why))
                continue
            if self.holds_steps and any(lane.busy for lane in lanes):
                return
            self.pending.popleft()
            try:
                if op.done is None:
                    slot = self._victim(live)
                    if op.name in self.by_name and slot >= 0:  # else `ready` asks again
                        self._put(slot, self.by_name[op.name], lanes)
                    continue
                op.done.set_result(self._load(op, lanes, live) if op.path is not None else self._unload(op.name))
            except AdapterError as exc:
                if op.done is None and op.name in self.by_name:  # refused now (its folder gone?): its requests fail
                    log.error("LoRA adapter %s could not be swapped in: %s", op.name, exc)
                    self.broken[self.by_name[op.name].key] = f"LoRA adapter `{op.name}` could not be loaded into a slot: {exc}"
                else:
                    op.done.set_exception(exc)

    def _put(self, slot: int, adapter: Held, lanes: list[Any]) -> None:
        """`adapter` into `slot` of every live agent (AdapterError: an agent refused it; nothing changes)."""
        for lane in lanes:
            if lane.live:
                try:
                    lane.client.call(P.LOAD_ADAPTER, {"slot": slot, "name": adapter.name, "path": adapter.path}, 120.0)
                except Exception as exc:  # the agent refused the folder (or died)
                    raise AdapterError(f"LoRA adapter {adapter.name}: {exc}") from None
        log.info("LoRA adapter %s into slot %d (%s)", adapter.name, slot,
                 f"out: {self.held[slot].name}" if self.held[slot] else "was empty")
        self.held[slot] = adapter

    def _refusal(self, op: Load, live: set[int]) -> str | None:
        if not self.enabled:
            return "LoRA is off on this server: start it with serving_config.enable_lora (--enable-lora) or lora_modules"
        if why := adapter_name_problem(op.name):
            return f"lora_name {op.name[:64]!r}: {why}"
        if op.name in self.by_name or op.name in self.base:
            return f"The model `{op.name}` is already served"
        if self._victim(live) < 0:
            return (f"every one of the max_loras {self.max_loras} LoRA slots holds an adapter that running requests "
                    "use: load it again once they end")
        return None

    def _load(self, op: Load, lanes: list[Any], live: set[int]) -> str:
        """A run-time registration, loaded into the least recently used slot no placed request uses
        (the agents check the folder there and then)."""
        why = self._refusal(op, live)
        if why is not None:
            raise AdapterError(why)
        adapter = Held(op.name, next(self._keys), op.path)
        self._put(self._victim(live), adapter, lanes)
        self.by_name[op.name] = adapter
        return f"Success: LoRA adapter '{op.name}' added successfully."

    def _unload(self, name: str) -> str:
        """Unregistered now; its slot stays held until no running request uses it (then it is the
        first to be swapped out)."""
        if self.by_name.pop(name, None) is None:
            raise AdapterError(f"The model `{name}` is not a LoRA adapter this server serves", 404)
        log.info("LoRA adapter %s unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def replay(self, client: Any) -> None:
        """A restarted agent loads lora_modules itself: what the slots held since is loaded again."""
        for slot, (now, boot) in enumerate(zip(self.held, self.boot)):
            if now != boot:
                client.call(P.LOAD_ADAPTER, {"slot": slot, "name": now.name if now else "",
                                             "path": now.path if now else None}, 120.0)


def fail_parked(parked: deque[Request], key: int, why: str) -> tuple[deque[Request], list[Request]]:
    """The parked requests of adapter `key` taken out, each with `why` (the engine ends them), and the
    others, in order. The adapter stays registered: its folder may be back for a later request."""
    failed = [r for r in parked if r.params.lora.key == key]
    for req in failed:
        req.params.lora = replace(req.params.lora, slot=-1, error=why)
    return deque(r for r in parked if r.params.lora.key != key), failed
