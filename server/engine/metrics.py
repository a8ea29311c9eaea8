"""Prometheus metrics (own registry, so several engines in one process do not clash)."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge("llm_serving_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.running = Gauge("llm_serving_requests_running", "Requests being generated", registry=r)
        self.kv_usage = Gauge("llm_serving_kv_cache_usage", "Fraction of KV blocks in use", ["agent"], registry=r)
        self.agents_alive = Gauge("llm_serving_agents_alive", "Live agents", registry=r)
        self.agent_rss = Gauge("llm_serving_agent_resident_bytes", "An agent process's resident memory (RSS)",
                               ["agent"], registry=r)
        self.agent_planned = Gauge("llm_serving_agent_planned_bytes", "An agent's memory plan (0: none)",
                                   ["agent"], registry=r)
        self.ttft = Histogram("llm_serving_time_to_first_token_seconds", "TTFT", buckets=_LAT, registry=r)
        self.tpot = Histogram("llm_serving_time_per_output_token_seconds", "TPOT", buckets=_LAT, registry=r)
        self.loop_lag = Histogram("llm_serving_event_loop_lag_seconds", "How late the HTTP event loop wakes a "
                                  "10 ms timer (what every stream and request waits on it)",
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=r)
        self.e2e = Histogram("llm_serving_e2e_request_latency_seconds", "End-to-end latency", buckets=_LAT,
                             registry=r)
        # A request's life cycle: arrival -> first scheduled -> first step sent -> last reply -> end.
        self.waiting_time = Histogram("llm_serving_request_waiting_seconds", "Arrival to first scheduled",
                                      buckets=_LAT, registry=r)
        self.sched_to_inference = Histogram("llm_serving_request_scheduling_to_inference_seconds",
                                            "First scheduled to its first step sent to an agent", buckets=_LAT,
                                            registry=r)
        self.inference_time = Histogram("llm_serving_request_inference_seconds",
                                         "First step sent to the reply to its last step", buckets=_LAT, registry=r)
        self.step_time = Histogram("llm_serving_step_seconds", "Agent step time", ["kind"], buckets=_LAT,
                                   registry=r)
        self.finished = Counter("llm_serving_requests_finished", "Finished requests", ["reason"], registry=r)
        self.prompt_tokens = Counter("llm_serving_prompt_tokens", "Prompt tokens", registry=r)
        self.prefill_tokens = Counter("llm_serving_prefill_tokens_computed", "Prompt tokens the agents computed "
                                      "(prompt tokens minus prefix-cache hits, plus recomputation)", registry=r)
        self.generation_tokens = Counter("llm_serving_generation_tokens", "Generated tokens", registry=r)
        self.preemptions = Counter("llm_serving_preemptions", "Sequences preempted", registry=r)
        self.recomputed = Counter("llm_serving_kv_tokens_discarded", "KV tokens thrown away, to be computed again: "
                                  "preemption, a failed agent (a KV hand-over keeps them)", registry=r)
        self.agent_restarts = Counter("llm_serving_agent_restarts", "Agents restarted after a crash or a stuck step",
                                      registry=r)
        self.graph_compiles = Counter("llm_serving_graph_compiles", "Model graphs built by the agents (warm-up "
                                      "included; none after ready)", registry=r)
        self.agent_requests = Counter("llm_serving_agent_requests", "Requests (and recomputations) sent to each "
                                      "agent (its first port)", ["agent"], registry=r)
        self.routed_by_prefix = Counter("llm_serving_routed_by_prefix", "Requests sent to the agent holding their "
                                        "prompt's prefix rather than the least loaded (serving_config.routing)", registry=r)
        self.routed_prefix_tokens = Counter("llm_serving_routed_prefix_tokens", "Prompt tokens those requests found "
                                            "cached beyond what the least loaded agent held", registry=r)
        self.routed_past_prefix = Counter("llm_serving_routed_past_prefix", "Requests sent to the least loaded agent "
                                          "although another held more of their prompt (it was loaded past the bound)",
                                          registry=r)
        self.routed_past_prefix_tokens = Counter("llm_serving_routed_past_prefix_tokens", "Prompt tokens those requests "
                                                 "computed again that another agent held", registry=r)
        self.rejected = Counter("llm_serving_requests_rejected", "Requests refused (queue full)", registry=r)
        self._speculative_metrics(r)
        self._lora_metrics(r)
        self._handover_metrics(r)

    def _speculative_metrics(self, r: CollectorRegistry) -> None:
        """Speculative decoding (speculative_config): drafts the agents proposed and kept, and what a
        drafting decode row emitted (its kept drafts and its own sample)."""
        self.spec_drafted = Counter("llm_serving_spec_draft_tokens", "Draft tokens the agents proposed", registry=r)
        self.spec_accepted = Counter("llm_serving_spec_accepted_tokens", "Draft tokens verified and kept", registry=r)
        self.spec_acceptance = Gauge("llm_serving_spec_acceptance_rate", "Kept / proposed draft tokens so far",
                                     registry=r)
        self.spec_emitted = Histogram("llm_serving_spec_tokens_per_step", "Tokens a drafting decode row emitted "
                                      "(1 + its kept drafts)", buckets=tuple(range(1, 18)), registry=r)
        self._drafts = [0, 0]  # proposed, kept

    def _lora_metrics(self, r: CollectorRegistry) -> None:
        """LoRA adapters (serving_config.lora_modules, /v1/load_lora_adapter), by name."""
        self.lora_finished = Counter("llm_serving_lora_requests_finished", "Finished requests per LoRA adapter",
                                     ["adapter", "reason"], registry=r)
        self.lora_tokens = Counter("llm_serving_lora_generation_tokens", "Generated tokens per LoRA adapter",
                                   ["adapter"], registry=r)

    def _handover_metrics(self, r: CollectorRegistry) -> None:
        """KV moved between agents: prefill/decode disaggregation (serving_config.agent_roles), drains."""
        self.kv_handovers = Counter("llm_serving_kv_handovers", "Sequences whose KV moved to another agent",
                                    registry=r)
        self.kv_handover_bytes = Counter("llm_serving_kv_handover_bytes", "KV bytes moved between agents", registry=r)
        self.kv_handover_copy = Counter("llm_serving_kv_handover_copy_seconds", "The agents' KV copies into and out "
                                        "of the hand-over segment", registry=r)
        self.kv_handover_time = Histogram("llm_serving_kv_handover_seconds", "A hand-over: from the reply that "
                                          "exported the KV to the reply of the step that imported it", buckets=_LAT,
                                          registry=r)

    def drafts_verified(self, drafted: int, kept: int) -> None:
        """A drafting decode row's reply: `drafted` proposed, `kept` of them accepted."""
        self.spec_drafted.inc(drafted)
        self.spec_accepted.inc(kept)
        self.spec_emitted.observe(kept + 1)
        self._drafts[0] += drafted
        self._drafts[1] += kept
        self.spec_acceptance.set(self._drafts[1] / self._drafts[0] if self._drafts[0] else 0.0)

    def observe_lanes(self, lanes: list[Any]) -> None:
        """The gauges, from the agent lanes (server.engine.lane.AgentLane) as they are now."""
        self.running.set(sum(lane.sched.active for lane in lanes))
        self.waiting.set(sum(len(lane.sched.waiting) for lane in lanes))
        self.agents_alive.set(sum(lane.live for lane in lanes))
        for lane in lanes:
            self.kv_usage.labels(str(lane.index)).set(lane.sched.blocks.usage())
            self.agent_rss.labels(str(lane.index)).set(lane.memory.rss_bytes)
            self.agent_planned.labels(str(lane.index)).set(lane.client.info.planned_bytes)
