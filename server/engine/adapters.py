"""LoRA adapters by name in the agents' slots (serving_config.max_loras): lora_modules' in slots 0..
at start (the agents load them themselves), others loaded and unloaded at run time (vLLM's
/v1/load_lora_adapter). Every load has its own key, which starts its prefix-cache chains: a slot
reused by another adapter never serves the KV its former adapter computed.

The engine thread changes the table; any thread resolves a name (a dict read)."""
from __future__ import annotations

import itertools
import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterable

from common.config import ServingConfig
from server.sampling_params import LoraRef
from shm import protocol as P

log = logging.getLogger("llm_serving.engine")


@dataclass(frozen=True)
class Loaded:
    slot: int
    key: int  # this load's own (SamplingParams.adapter_key)
    path: str


@dataclass(frozen=True)
class Load:
    """A run-time load (`path`) or unload (None) of adapter `name`, answered through `done`."""
    name: str
    path: str | None
    done: Future


class AdapterError(ValueError):
    """A load or unload that cannot be done: the message says why (HTTP 400 or 404)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class AdapterSlots:
    def __init__(self, cfg: ServingConfig):
        self.enabled, self.max_loras, self.base = cfg.lora_enabled, cfg.max_loras, {cfg.model_name, *cfg.model_aliases}
        self._keys = itertools.count(1)
        self.by_name: dict[str, Loaded] = {name: Loaded(slot, next(self._keys), path)
                                           for slot, (name, path) in enumerate(cfg.lora_modules.items())}
        self.runtime: dict[int, tuple[str, str]] = {}  # slot -> (name, path) loaded at run time: replayed on a restart
        self._gone: dict[int, int] = {}  # key -> slot of unloaded adapters whose requests may still run
        self.pending: deque[Load] = deque()

    def resolve(self, name: str) -> LoraRef | None:
        """The adapter a request naming `name` runs with (None: no adapter has that name)."""
        a = self.by_name.get(name)
        return LoraRef(name, a.slot, a.key) if a is not None else None

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    # ------------------------------------------------------------ engine thread
    @property
    def holds_steps(self) -> bool:
        """A load is next: no step may be sent until it is in (it waits for the steps in flight)."""
        return bool(self.pending) and self.pending[0].path is not None

    def apply(self, lanes: list[Any], live_keys: Iterable[int]) -> None:
        """The pending unloads and loads, in order; a load only once no lane has a step in flight."""
        live = set(live_keys)
        while self.pending:
            if self.holds_steps and any(lane.busy for lane in lanes):
                return
            op = self.pending.popleft()
            try:
                op.done.set_result(self._load(op, lanes, live) if op.path is not None else self._unload(op.name))
            except AdapterError as exc:
                op.done.set_exception(exc)

    def _load(self, op: Load, lanes: list[Any], live: set[int]) -> str:
        if not self.enabled:
            raise AdapterError("LoRA is off on this server: start it with serving_config.enable_lora (--enable-lora) "
                               "or lora_modules")
        if op.name in self.by_name or op.name in self.base:
            raise AdapterError(f"The model `{op.name}` is already served")
        held = {a.slot for a in self.by_name.values()}
        busy = {a.slot for a in self._unloaded(live)}
        free = [s for s in range(self.max_loras) if s not in held and s not in busy]
        if not free:
            raise AdapterError(f"every one of the max_loras {self.max_loras} LoRA slots holds an adapter (or one "
                               "unloaded whose requests still run): unload one first")
        for lane in lanes:
            if lane.live:
                try:
                    lane.client.call(P.LOAD_ADAPTER, {"slot": free[0], "name": op.name, "path": op.path}, 120.0)
                except Exception as exc:  # the agent refused the folder (or died): nothing changes
                    raise AdapterError(f"LoRA adapter {op.name}: {exc}") from None
        self.by_name[op.name] = Loaded(free[0], next(self._keys), op.path)
        self.runtime[free[0]] = (op.name, op.path)
        log.info("LoRA adapter %s loaded into slot %d from %s", op.name, free[0], op.path)
        return f"Success: LoRA adapter '{op.name}' added successfully."

    def _unload(self, name: str) -> str:
        loaded = self.by_name.pop(name, None)
        if loaded is None:
            raise AdapterError(f"The model `{name}` is not a LoRA adapter this server serves", 404)
        self._gone[loaded.key] = loaded.slot
        log.info("LoRA adapter %s unloaded (slot %d free once its requests end)", name, loaded.slot)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _unloaded(self, live: set[int]) -> list[Loaded]:
        """Unloaded adapters whose requests still run: their slots stay theirs until then."""
        self._gone = {k: s for k, s in self._gone.items() if k in live}
        return [Loaded(s, k, "") for k, s in self._gone.items()]

    def replay(self, client: Any) -> None:
        """A restarted agent loads lora_modules itself: the run-time loads again, into their slots."""
        for slot, (name, path) in sorted(self.runtime.items()):
            if self.by_name.get(name, Loaded(-1, 0, "")).slot == slot:
                client.call(P.LOAD_ADAPTER, {"slot": slot, "name": name, "path": path}, 120.0)
