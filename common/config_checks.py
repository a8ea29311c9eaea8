"""What no one key's range says about a serving config (common/config.py): ports and hosts, groups,
the pool against one sequence, agent roles, LoRA and speculative decoding together, and the
environment's CPU cap; each refusal one line naming the key."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.config_keys import KEYS
from common.speculative import METHODS, method_of
from common.config_values import ROLES, adapter_name_problem
from common.cpu import isa_cap

if TYPE_CHECKING:
    from common.config import ServingConfig


class ConfigError(ValueError):
    """A config that cannot be served: one line naming the key, its value and what is allowed."""


def check_all(c: ServingConfig) -> ServingConfig:
    """Every key's range (its table row's check, on each item of a list), then `check_together`."""
    for k in KEYS:
        if k.check is None:
            continue
        value = getattr(c, k.attr)
        items = value if isinstance(value, list) else [value]
        if not items or not all(k.check(v) for v in items):
            raise ConfigError(f"{k.name} = {value!r}: must be {k.allowed}")
    check_together(c)
    return c


def check_together(c: ServingConfig) -> None:
    """What no one key's range says: ports and hosts, groups, the pool against one sequence; and the
    environment's CPU cap (LLM_SERVING_MAX_ISA), which every agent reads."""
    try:
        isa_cap()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if c.agent_hosts and len(c.agent_hosts) != len(c.agent_ports):
        raise ConfigError(f"serving_config.agent_hosts = {c.agent_hosts}: one host per agent_ports entry "
                          f"({len(c.agent_ports)})")
    if len(set(zip(c.agent_hosts or [c.agent_ip] * len(c.agent_ports), c.agent_ports))) != len(
            c.agent_ports):
        raise ConfigError(f"serving_config.agent_ports = {c.agent_ports}: each port once")
    if len(c.agent_ports) % c.tensor_parallel_size:
        raise ConfigError(f"serving_config.tensor_parallel_size = {c.tensor_parallel_size}: must divide the "
                          f"{len(c.agent_ports)} agent_ports (consecutive ports form a model's ranks)")
    if c.device != "CPU" and c.deterministic:
        raise ConfigError(f"serving_config.deterministic on {c.device}: the batch-invariant kernels are the native CPU "
                          "ones; the plain MindSpore path other devices run sums in an order that follows the row count")
    if c.device != "CPU" and c.model_dtype not in ("float32", "float16"):  # agent.model.backend.PLAIN_DTYPES
        raise ConfigError(f"model_dtype {c.model_dtype} on {c.device}: the plain MindSpore path other devices run "
                          "holds float32 or float16 weights")
    if c.model_dtype == "gguf" and c.lora_enabled:
        raise ConfigError("lora_config with model_dtype gguf: LoRA adapters run on float32, bfloat16, float16 or int8 "
                          "bases, not yet on gguf blocks")
    if c.tensor_parallel_size > 1 and c.model_dtype in ("int8", "gguf"):
        raise ConfigError(f"serving_config.tensor_parallel_size = {c.tensor_parallel_size} with model_dtype {c.model_dtype}: "
                          "tensor parallelism runs float32, bfloat16 or float16 weights")
    if c.spec_method is not None and c.spec_method not in METHODS:
        raise ConfigError(f"speculative_config.method = {c.spec_method!r}: this server drafts with "
                          f"{', '.join(METHODS)} (on the agent); {c.spec_method} is not served")
    _check_draft(c)
    if c.spec_lookup_min > c.spec_lookup_max:
        raise ConfigError(f"speculative_config.prompt_lookup_min = {c.spec_lookup_min}: must be <= prompt_lookup_max "
                          f"({c.spec_lookup_max})")
    for name in c.lora_modules:
        if why := adapter_name_problem(name):
            raise ConfigError(f"serving_config.lora_modules: {name[:64]!r}: {why}")
    clash = sorted(set(c.lora_modules) & {c.model_name, *c.model_aliases})
    if clash:
        raise ConfigError(f"serving_config.lora_modules: {clash} also name the base model")
    _check_roles(c)
    if c.num_blocks and (c.num_blocks - 1) * c.block_size < c.max_model_len:
        raise ConfigError(f"pa_config: {c.num_blocks - 1} usable blocks x block_size {c.block_size} hold "
                          f"{(c.num_blocks - 1) * c.block_size} tokens, less than one sequence of "
                          f"decode_seq_length {c.max_model_len} (block 0 is reserved); need num_blocks >= "
                          f"{-(-c.max_model_len // c.block_size) + 1}")


def _check_roles(c: ServingConfig) -> None:
    """A role set that can serve: one per port, someone takes prompts, someone decodes; disaggregated
    agents are local (the hand-over is a shared-memory segment) and not tensor-parallel."""
    if not c.agent_roles:
        return
    roles = c.agent_roles
    if not set(roles) <= set(ROLES):
        raise ConfigError(f"serving_config.agent_roles = {roles}: each one of {', '.join(ROLES)}")
    if len(roles) != len(c.agent_ports):
        raise ConfigError(f"serving_config.agent_roles = {roles}: one role per agent_ports entry ({len(c.agent_ports)})")
    if not c.disaggregated:
        return
    if "decode" not in roles and "both" not in roles:
        raise ConfigError(f"serving_config.agent_roles = {roles}: no agent decodes (give one `decode` or `both`)")
    if "prefill" not in roles and "both" not in roles:
        raise ConfigError(f"serving_config.agent_roles = {roles}: no agent takes prompts (give one `prefill` or `both`)")
    if c.tensor_parallel_size > 1:
        raise ConfigError(f"serving_config.agent_roles = {roles} with tensor_parallel_size {c.tensor_parallel_size}: "
                          "disaggregated agents are single ranks")


def _check_draft(c: ServingConfig) -> None:
    """The draft-model methods (common/speculative.py): a model to draft with, a float target, single ranks."""
    m = method_of(c)
    reads_path = m is not None and m.draft_model and not m.own_weights
    if reads_path and not c.spec_draft_model:
        raise ConfigError(f"speculative_config.method = {m.name}: needs draft_model_path (a smaller model with the "
                          "target's tokenizer)")
    if c.spec_draft_model and not reads_path:
        readers = [r.name for r in METHODS.values() if r.draft_model and not r.own_weights]
        raise ConfigError(f"speculative_config.draft_model_path is set: only method {', '.join(readers)} reads it "
                          f"(method is {c.spec_method})")
    if m is not None and m.own_weights and c.model_dtype == m.draft_dtype(c):
        raise ConfigError(f"speculative_config.method = {m.name} with model_dtype {c.model_dtype}: the draft would be "
                          "the target itself; use a float model_dtype, or ngram")
    if m is not None and not m.tensor_parallel and c.tensor_parallel_size > 1:
        raise ConfigError(f"speculative_config.method = {m.name} with tensor_parallel_size "
                          f"{c.tensor_parallel_size}: draft models run on single-rank agents (ngram drafts on ranks)")


def check_spec_method(c: ServingConfig, section: dict[str, Any], overrides: dict[str, Any]) -> None:
    """speculative_config keys without a method would be silently off: refused, as vLLM refuses them."""
    rows = [k for k in KEYS if k.section == "speculative_config"]  # what the YAML or the command line set
    given = {k.key for k in rows if section.get(k.key) is not None or overrides.get(k.attr) is not None}
    if c.spec_method is None and given:
        raise ConfigError(f"speculative_config sets {sorted(given)} without method: name one of "
                          f"{', '.join(METHODS)} (or leave the section out: no speculative decoding)")
