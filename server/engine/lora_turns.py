"""LoRA's turns between steps (server/engine/hooks.py): run-time loads and unloads, the swaps parked
requests wait for, and a restarted agent's slots written again. The slot table is
server/engine/lora.py's; only here are the agents asked to load anything."""
from __future__ import annotations

import logging
import queue
from concurrent.futures import Future
from typing import Callable

from common.config_values import adapter_name_problem
from common.lora import AdapterError
from server.engine.lora import AdapterSlots, Held, Load
from server.engine.lane import AgentLane
from server.engine.messages import AgentBack, Message, Wake
from server.engine.requests import Requests
from server.request import Request
from shm import protocol as P

log = logging.getLogger("llm_serving.engine")


class LoraTurns:
    def __init__(self, slots: AdapterSlots, lanes: list[AgentLane], requests: Requests,
                 assign: Callable[[Request], None], inbox: "queue.Queue[Message]"):
        self.slots, self.lanes, self.requests, self.assign, self.inbox = slots, lanes, requests, assign, inbox

    def load(self, name: str, path: str | None) -> Future:
        """(any thread) A LoRA adapter into a free slot of every agent (`path` None: unload `name`), between
        steps: the Future's result is a line saying so, or its exception (AdapterError) why not."""
        done: Future = Future()
        if not self.slots.enabled:  # no turns run: answered here
            done.set_exception(AdapterError(self._refusal(Load(name, path), set())))
            return done
        self.slots.pending.append(Load(name, path, done))
        self.inbox.put(Wake())
        return done

    def admit(self, req: Request) -> bool:
        """Whether `req` (naming an adapter) may be assigned now; else it is parked for its adapter."""
        return self.slots.place(req)

    @property
    def armed(self) -> bool:
        return bool(self.slots.pending or self.slots.parked)

    def holds_steps(self) -> bool:
        """A load is next: no step may be sent until it is in (it waits for the steps in flight)."""
        return bool(self.slots.pending) and self.slots.pending[0].path is not None

    def turn(self) -> None:
        """Parked requests whose adapters are in slots go to the lanes; swaps for the others, and
        run-time loads, once no step is in flight."""
        for req in self.slots.ready(self._placed_keys()):
            self.assign(req)
        self.apply(set(self._placed_keys()))
        for req in self.slots.ready(self._placed_keys()):
            self.assign(req)

    def agent_back(self, msg: AgentBack) -> None:
        """A restarted agent holds lora_modules only: the run-time loads again before it serves; one
        it refuses now is not served wrong, the agent is killed and restarted again."""
        if msg.client is None:
            return
        try:
            for slot, (now, boot) in enumerate(zip(self.slots.held, self.slots.boot)):
                if now != boot:
                    msg.client.call(P.LOAD_ADAPTER, {"slot": slot, "name": now.name if now else "",
                                                     "path": now.path if now else None}, 120.0)
        except Exception as exc:
            log.error("agent %d: LoRA adapters not loaded again after its restart (%s); restarting it", msg.index, exc)
            msg.client.kill()

    def _placed_keys(self) -> list[int]:
        """The adapter keys of the live requests that are not parked (their adapters stay in their slots)."""
        parked = {id(r) for r in self.slots.parked}
        return [r.params.adapter_key for r in self.requests.live.values() if id(r) not in parked]

    def apply(self, live: set[int]) -> None:
        """The pending unloads, loads and swaps, in order; a load only once no lane has a step in flight."""
        s = self.slots
        while s.pending:
            op = s.pending[0]
            why = self._refusal(op, live) if op.done is not None and op.path is not None else None
            if why is not None:  # at once: what refuses a load does not wait for the steps in flight
                s.pending.popleft().done.set_exception(AdapterError(why))
                continue
            if self.holds_steps() and any(lane.busy for lane in self.lanes):
                return
            s.pending.popleft()
            try:
                if op.done is None:
                    slot = s.victim(live)
                    if op.name in s.by_name and slot >= 0:  # else `ready` asks again
                        self._put(slot, s.by_name[op.name])
                    continue
                op.done.set_result(self._load(op, live) if op.path is not None else self._unload(op.name))
            except AdapterError as exc:
                if op.done is None and op.name in s.by_name:  # refused now (its folder gone?): its requests fail
                    log.error("LoRA adapter %s could not be swapped in: %s", op.name, exc)
                    s.broken[s.by_name[op.name].key] = f"LoRA adapter `{op.name}` could not be loaded into a slot: {exc}"
                else:
                    op.done.set_exception(exc)

    def _put(self, slot: int, adapter: Held) -> None:
        """`adapter` into `slot` of every live agent (AdapterError: an agent refused it; nothing changes)."""
        for lane in self.lanes:
            if lane.live:
                try:
                    lane.client.call(P.LOAD_ADAPTER, {"slot": slot, "name": adapter.name, "path": adapter.path}, 120.0)
                except Exception as exc:  # the agent refused the folder (or died)
                    raise AdapterError(f"LoRA adapter {adapter.name}: {exc}") from None
        held = self.slots.held
        log.info("LoRA adapter %s into slot %d (%s)", adapter.name, slot, f"out: {held[slot].name}" if held[slot] else "was empty")
        held[slot] = adapter

    def _refusal(self, op: Load, live: set[int]) -> str | None:
        s = self.slots
        if not s.enabled:
            return "LoRA is off on this server: start it with serving_config.enable_lora (--enable-lora) or lora_modules"
        if why := adapter_name_problem(op.name):
            return f"lora_name {op.name[:64]!r}: {why}"
        if op.name in s.by_name or op.name in s.base:
            return f"The model `{op.name}` is already served"
        if s.victim(live) < 0:
            return (f"every one of the max_loras {s.max_loras} LoRA slots holds an adapter that running requests "
                    "use: load it again once they end")
        return None

    def _load(self, op: Load, live: set[int]) -> str:
        """A run-time registration, loaded into the least recently used slot no placed request uses
        (the agents check the folder there and then)."""
        why = self._refusal(op, live)
        if why is not None:
            raise AdapterError(why)
        adapter = Held(op.name, next(self.slots.keys), op.path)
        self._put(self.slots.victim(live), adapter)
        self.slots.by_name[op.name] = adapter
        return f"Success: LoRA adapter '{op.name}' added successfully."

    def _unload(self, name: str) -> str:
        """Unregistered now; its slot stays held until no running request uses it (then it is the
        first to be swapped out)."""
        if self.slots.by_name.pop(name, None) is None:
            raise AdapterError(f"The model `{name}` is not a LoRA adapter this server serves", 404)
        log.info("LoRA adapter %s unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

