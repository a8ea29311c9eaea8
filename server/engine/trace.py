"""Recent step timeline of every agent, both sides: what /debug/trace shows (Chrome trace format).

Per step: the server's `prepare` (plan, arena write, send) and `outputs` (tokens -> text, stop
checks) on the server's track; the step's wall time on its agent's track (from when the agent could
start it, i.e. its send or the previous step's reply, whichever is later, to its reply) with the
agent's own model time nested in it. With overlap on, `prepare` of step N+1 runs inside step N.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

KEEP = 2000  # steps kept


@dataclass(slots=True)  # KEEP of them live: no per-record __dict__
class StepRecord:
    agent: int
    kind: str  # "prefill" (some row carries prompt tokens) or "decode"
    rows: int
    n_tokens: int
    sent: float  # monotonic s: when the server sent it
    start: float  # when the agent could start it: max(sent, the previous step's reply)
    end: float  # its reply
    prepare_s: float  # server: plan + encode + send
    outputs_s: float  # server: processing the reply
    model_s: float  # agent: the model's graph call
    agent_s: float  # agent: handling the command, model and sampling included
    graph_tokens: int  # agent: the token bucket (graph) that ran it, n_tokens padded


class StepTrace:
    def __init__(self) -> None:
        self.steps: list[StepRecord] = []

    def record(self, step: StepRecord) -> None:
        self.steps.append(step)
        del self.steps[:-KEEP]

    def chrome(self) -> dict[str, Any]:
        """chrome://tracing / Perfetto JSON. Agent k's steps are on pid 1 tid k, the server's work
        for agent k on pid 2 tid k; every step event's args carry its raw fields (seconds)."""
        t0 = min((s.sent - s.prepare_s for s in self.steps), default=0.0)

        def event(name: str, pid: int, tid: int, start: float, dur: float, args: dict | None = None) -> dict:
            return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": (start - t0) * 1e6, "dur": dur * 1e6,
                    "args": args or {}}

        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "agents"}},
            {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "server"}}]
        for s in self.steps:
            events.append(event(f"{s.kind} r={s.rows} t={s.n_tokens}/{s.graph_tokens}", 1, s.agent, s.start, s.end - s.start,
                                {**asdict(s), "model_ms": round(s.model_s * 1e3, 3)}))
            events.append(event("model", 1, s.agent, s.end - s.agent_s, s.model_s))
            events.append(event("prepare", 2, s.agent, s.sent - s.prepare_s, s.prepare_s))
            events.append(event("outputs", 2, s.agent, s.end, s.outputs_s))
        return {"traceEvents": events}
