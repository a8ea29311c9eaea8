"""The serving YAML as one declarative table: every key of the original llm-serving's four sections
and ours, with the attribute it sets, how its value is read, its range, what the original meant and
what it does here. Loading (common/config.py), the start-up notices and docs/config.md's tables
(common/config_text.py) are derived from it; defaults are ServingConfig's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from common.config_values import (KV_CACHE_DTYPES, ROLES, as_adapters, as_blocks, as_bool, as_cores,
                                  as_float, as_group, as_hosts, as_names, as_int, as_most, as_ports, as_roles, as_sizes, lower, model_dtype,
                                  parse_bytes, port_ok)


SECTIONS = ("model_config", "serving_config", "pa_config", "tokenizer", "speculative_config")
ROUTINGS = ("prefix", "least_load")  # server/engine/routing.py's ROUTERS
# Whole sections accepted and not needed here, with why.
IGNORED_SECTIONS = {name: "the agent builds its model inputs and warm-up shapes itself"
                    for name in ("basic_inputs", "extra_inputs", "warmup_inputs")}


@dataclass(frozen=True)
class Key:
    section: str
    key: str
    attr: str | None  # the ServingConfig attribute it sets; None: read only for a notice, or ignored
    read: Callable[[Any], Any] | None = None  # YAML value -> attribute value
    check: Callable[[Any], bool] | None = None  # of the attribute (of each item of a list), after overrides
    allowed: str = ""  # what `check` allows, for its error
    original: str = "—"  # what the original llm-serving meant ("—": ours)
    here: str = ""  # what this server does with it
    ignored: str | None = None  # why it is ignored here (a notice at start)

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"


M, S, P, T, X = "model_config", "serving_config", "pa_config", "tokenizer", "speculative_config"
SUPERVISION = "supervision (README, \"Failures\")"
KEYS: list[Key] = [
    # ---------------------------------------------------------------- model_config
    Key(M, "model_name", "model_name", str, original="model id", here="the id in replies (`model_id`, `/v1/models`)"),
    Key(S, "model_aliases", "model_aliases", as_names,
        here="ours: other names a request's `model` may use (listed by `/v1/models`); any other name gets 404 "
             "`model_not_found`, as OpenAI answers"),
    Key(M, "model_cfg_path", "model_cfg_path", str, original="MindFormers model yaml; its `load_checkpoint` names the weights",
        here="same: the checkpoint named by `load_checkpoint` (a `.ckpt`, or a folder with one) is loaded. A missing "
             "yaml, key or checkpoint stops the start with a line naming it, never another model"),
    Key(M, "model_path", "model_path", str,
        here="a `.gguf`, a Hugging Face folder, a MindFormers `.ckpt` (with `model_cfg_path`), or a packaged model (`smollm2`, `gemma3-270m`); when "
             "neither this nor `model_cfg_path` is set, SmolLM2-135M-Instruct"),
    Key(M, "max_generate_length", "max_generate_length", as_int, lambda v: v >= 2, ">= 2",
        "cap on prompt + output tokens", "same: a request ends with `length` there (and the context is "
        "`min(decode_seq_length, max_generate_length)`)"),
    Key(M, "end_token", "end_token", as_sizes, original="extra stop token ids", here="same, on top of the model's EOS"),
    Key(M, "seq_length", "prefill_buckets", as_sizes, lambda v: v >= 1, "a list of sizes >= 1",
        "prefill graph lengths (last = longest input)",
        "token buckets of a step (one static graph each); the last is the step's token budget unless "
        "`max_num_batched_tokens` is set; prompts longer than it are chunked, not refused"),
    Key(M, "decode_batch_size", "decode_buckets", as_sizes, lambda v: v >= 1, "a list of sizes >= 1",
        "decode graph batch sizes (last = most running)",
        "token buckets too; the last is the most sequences running per agent. Between these sizes (and below the "
        "smallest) powers of two are added wherever two buckets are more than 4x apart, and 1 is always one: small "
        "steps run small graphs (the contest's `[4096]` / `[128]` give 1, 4, 16, 64, 128, 512, 2048, 4096; a "
        "`config:` line says so when sizes are added). The graph set is logged at every start"),
    Key(M, "prefill_batch_size", "max_prefill_rows", as_most, lambda v: v >= 1, ">= 1", "prompts per prefill",
        "most prefill chunks in one step (the most of a list)"),
    Key(M, "vocab_size", "vocab_size", as_int, original="the model's vocabulary",
        here="checked: the model's must be equal, else the start fails naming both"),
    Key(M, "batch_waiting_time", "prefill_batch_waiting_time", as_float,
        original="wait for a fuller batch (the original read it only from serving_config)",
        here="same as `serving_config.prefill_batch_waiting_time` (which wins when both are set)"),
    Key(M, "decode_batch_waiting_time", None, original="read, never used by the original",
        here="accepted; a non-zero value is warned about: decode steps never wait"),
    Key(M, "batching_strategy", None, original="`continuous` or `static`", here="`continuous` only; `static` is warned about"),
    Key(M, "page_attention", None, original="paged KV cache on/off", here="always paged; `False` is warned about"),
    Key(M, "model_dtype", "model_dtype", model_dtype, original="weight dtype",
        here="`float32` (default), `bfloat16` (also `bf16`, `DataType.BFLOAT16`: projection and LM-head weights kept "
             "bf16, oneDNN bf16 matmul where the CPU has AVX512-BF16/AMX; README, \"bfloat16\"), `float16` (also "
             "`fp16`, `DataType.FLOAT16`: f16 weights, fp32 activations) or `int8` (also `DataType.INT8`, `w8a8`): "
             "projections and LM head as W8A8 in a native kernel (AVX2 `vpmaddubsw`, VNNI when the CPU has it), "
             "SmoothQuant-calibrated at load, norms/rope/attention/sampling in fp32, KV cache int8 (`auto`); GGUF `Q8_0` weights are "
             "used as stored (groups of 32); or `gguf`: a GGUF file's quantised matrices (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
             "Q4_K, Q5_K, Q6_K, as the file mixes them) kept as stored, embedding and LM head included (README, "
             "\"GGUF as stored\"). Needs the native kernels (a C++ compiler). Other values are warned about "
             "and run float32"),
    Key(M, "kv_cache_dtype", "kv_cache_dtype", lower, lambda v: v in KV_CACHE_DTYPES, "one of " + ", ".join(KV_CACHE_DTYPES),
        here="ours (vLLM's `--kv-cache-dtype`): `auto` (the weights' 16-bit dtype, i.e. `bfloat16` with bfloat16 "
             "weights; `int8` with int8 weights, since a many-row decode reads the whole cache and its time follows "
             "the bytes; else `float32`), `float32`, `bfloat16`, `float16` or `int8`; 16-bit caches halve the KV memory (the pool "
             "holds twice the tokens in the same bytes), int8 takes hd + 4 bytes a head (values rounded to max|x|/127 "
             "steps, then that scale: about half of float16's bytes; accuracy in docs/benchmarks.md); rope writes k/v rounded to it "
             "(float16 saturating at its largest value) and paged attention widens them to fp32 as it reads (needs "
             "the native kernels). `--kv-cache-dtype` on `llm-serving` and `launch_agents`"),
    Key(M, "quant_group_size", "quant_group_size", as_group, lambda v: v in ("auto", -1, 0) or (isinstance(v, int) and v >= 4),
        "auto, at least 4 inputs per int8 scale, 0 (8 scales per row) or -1 (one per output channel)",
        here="with `int8`: `auto` (the default) is `-1` on CPUs with AVX512-VNNI or AMX-INT8 and `72` on the "
             "others (common.config.int8_group); a number: at most this many inputs share one int8 scale, in weights and "
             "activations (>= 4; the agent picks the multiple of 4 that cuts a row into the fewest blocks of 8 groups "
             "padding it least: 72 for 576 inputs, 64 for 1536 or 8192); `0` = 8 scales per row (faster "
             "prefill, less accurate); `-1` = one scale per output channel and per token "
             "on oneDNN's int8 matmul (AMX-INT8 where the CPU has it, AVX512-VNNI or AVX-VNNI below; refused at load "
             "without VNNI, where its int16 sums saturate), the MLP's down projection keeping groups (the more "
             "accurate of the two on SmolLM2 and Gemma 3 270M: docs/benchmarks.md, \"Accuracy by dtype\")"),
    Key(M, "backend", None, original="`kbk` / `ge` MindFormers execution modes",
        here="warned about: the agent runs its own MindSpore graph-mode Llama"),
    Key(M, "zactivate_len", None, original="attention-width buckets",
        ignored="no graph depends on the context length: steps are token-packed"),
    Key(M, "model_type", None, original="`dyn`/`static` graph modes", ignored="one static graph per token bucket, all built before ready"),
    Key(M, "seq_type", None, original="`dyn`/`static` graph modes", ignored="one static graph per token bucket, all built before ready"),
    Key(M, "current_index", None, original="index input toggle", ignored="positions travel with every token"),
    Key(M, "pad_token_id", None, original="padding id", ignored="padding never reaches the model's outputs"),
    # ---------------------------------------------------------------- serving_config
    Key(S, "agent_ports", "agent_ports", as_ports, port_ok, "a non-empty list of ports in [1, 65535]", "one agent per port",
        "same; several ports = data-parallel replicas"),
    Key(S, "tensor_parallel_size", "tensor_parallel_size", as_int, lambda v: v >= 1, ">= 1 (and divide the number of agent_ports)",
        here="ours: consecutive `agent_ports` form groups of this many ranks of one model (the original's multi-port "
             "deployment): 4 ports at size 2 are 2 replicas of 2 ranks. Each rank holds its share of the heads, FFN "
             "columns, vocabulary and KV pool; every command goes to every rank; rank 0 replies. A rank that dies "
             "restarts its group"),
    Key(S, "agent_roles", "agent_roles", as_roles, allowed=f"one of {', '.join(ROLES)} per agent_ports entry",
        here="ours: prefill/decode disaggregation (`--agent-roles prefill,decode`): a `prefill` agent runs prompts "
             "only and hands each finished prompt's KV to a `decode` agent (over shared memory, or tcp frames to "
             "agents on other hosts); `both` (the default) does either. No tensor parallel; at least one agent "
             "takes prompts and one decodes"),
    Key(S, "agent_ip", "agent_ip", str, original="where agents listen", here="same: `127.0.0.1` = ipc + shared memory, else tcp"),
    Key(S, "start_device_id", "start_device_id", as_int, lambda v: v >= 0, ">= 0", "device of agent 0",
        "same: agent i calls `mindspore.set_device(device, start_device_id + i)` and reports the target and id "
        "MindSpore then says (`/stats` `devices`)"),
    Key(S, "device", "device", str, lambda v: v in ("CPU", "Ascend", "GPU"), "one of CPU, Ascend, GPU",
        here="ours: `CPU`, `Ascend` or `GPU` (`--device`, or `LLM_SERVING_DEVICE`); the native kernels are CPU "
             "kernels, other devices run the plain MindSpore model"),
    Key(S, "device_memory", "device_memory", parse_bytes, lambda v: v >= 0, "a byte count such as 32GiB",
        here="ours: the memory of each device (Ascend, GPU; `--device-memory`) the memory plan holds one agent's "
             "weights, KV cache, activations and runtime against: `num_blocks: auto` is sized from it and a config "
             "that does not fit stops before anything loads (`llm-serving --dry-run --device Ascend` prints the plan "
             "from any machine). 0: each agent reads its device's free memory from MindSpore at start"),
    Key(S, "kv_cache_memory", "kv_cache_memory", parse_bytes, lambda v: v >= 0, "a byte count such as 8GiB",
        here="ours: the KV pool per agent in bytes (`8GiB`, `512MiB`, `20G` = GiB, or an integer), vLLM's KV-space "
             "idea; implies `pa_config.num_blocks: auto` unless `num_blocks` is also set. Every start checks weights + "
             "KV + activations + runtime per agent, times the agents started on this host, against its available "
             "memory and stops before loading with what it needs and has (`llm-serving --dry-run` prints that plan)"),
    Key(S, "runtime_memory", "runtime_memory", parse_bytes, lambda v: v >= 0, "a byte count such as 600MiB",
        here="ours: what the memory plan counts per agent beside weights, KV cache and activations (MindSpore, its "
             "graphs, oneDNN's primitives; measured on CPU, docs/perf-notes.md): correct it for another build or "
             "device; `memory_margin` alarms against the plan"),
    Key(S, "server_ip", "server_ip", str, original="HTTP address", here="same"),
    Key(S, "server_port", "server_port", as_int, port_ok, "a port in [1, 65535]", "HTTP port", "same"),
    Key(S, "prefill_batch_waiting_time", "prefill_batch_waiting_time", as_float, lambda v: 0 <= v <= 10,
        "in [0, 10] seconds", "seconds to wait for companions before a prefill",
        "an idle agent holds a lone prompt up to this long (from its arrival) while fewer than `prefill_batch_size` "
        "wait; never delays a running batch"),
    Key(S, "decode_batch_waiting_time", None, original="see model_config", here="see model_config"),
    Key(S, "max_queue", "max_queue", as_int, lambda v: v >= 1, ">= 1 (0 would refuse every request)",
        here="waiting requests before 503 + `Retry-After`"),
    Key(S, "max_num_batched_tokens", "max_num_batched_tokens", as_int, lambda v: v >= 0, ">= 0 (0 = largest seq_length)",
        here="token budget of a step with decodes (0: the last `seq_length`; 512 in configs/smollm2.yaml)"),
    Key(S, "prefill_only_tokens", "prefill_only_tokens", as_int, lambda v: v >= 0, ">= 0 (0 = max_num_batched_tokens)",
        here="token budget while nothing decodes (0: the same)"),
    Key(S, "schedule_policy", "schedule_policy", str, lambda v: v in ("fcfs", "sjf", "priority"), "one of fcfs, sjf, priority",
        here="`fcfs`, `sjf` (shortest max_new_tokens first), `priority`"),
    Key(S, "routing", "routing", lower, lambda v: v in ROUTINGS, "one of " + ", ".join(ROUTINGS),
        here="ours: where a new request goes among data-parallel agents: `prefix` (the default) to the agent whose "
             "prefix cache holds the longest part of its prompt (a conversation's next turn, a shared system prompt) "
             "unless it is overloaded (`routing_max_load_ratio`), else the least loaded; `least_load` to the agent "
             "with the fewest sequences"),
    Key(S, "routing_max_load_ratio", "routing_max_load_ratio", as_float, lambda v: v >= 1, ">= 1",
        here="ours: `prefix` routing takes the agent holding the prefix while its sequences (running and waiting) "
             "are at most this times the least loaded agent's (or 16 more), and its free KV blocks hold the rest of "
             "the prompt"),
    Key(S, "step_timeout_s", "step_timeout_s", as_float, lambda v: v >= 1,
        ">= 1 second (a shorter one kills agents in the middle of healthy steps)",
        here="a step longer than this: the agent is stuck, killed and restarted; " + SUPERVISION),
    Key(S, "heartbeat_s", "heartbeat_s", as_float, lambda v: 0.1 <= v <= 25,
        "in [0.1, 25] seconds (a remote agent detaches a server after 30 s of silence)",
        here="idle agents are pinged this often; " + SUPERVISION),
    Key(S, "max_agent_restarts", "max_agent_restarts", as_int, lambda v: v >= 0, ">= 0",
        here="restarts in a row (no successful step between; for `launch_agents`, none alive 60 s) before giving up; "
             + SUPERVISION),
    Key(S, "recovery_deadline_s", "recovery_deadline_s", as_float, lambda v: v > 0, "> 0 seconds",
        here="a request waiting this long for a recovering agent fails; " + SUPERVISION),
    Key(S, "memory_margin", "memory_margin", as_float, lambda v: v >= 0, ">= 0 (a fraction of the plan)",
        here="an agent whose resident memory passes its memory plan's bytes by this fraction turns `/health` to "
             "`degraded` (still 200) naming it, and is logged once; nothing is killed; " + SUPERVISION),
    Key(S, "web_ui", "web_ui", as_bool, here="ours: a chat page at `/` (streaming chat, stop, sampling settings, "
        "JSON mode; `--no-web-ui`: off)"),
    Key(S, "responses_store_size", "responses_store_size", as_int, lambda v: v >= 0, ">= 0 (0 keeps none)",
        here="ours: `/v1/responses` kept in memory for `GET /v1/responses/{id}` and `previous_response_id` "
             "(the oldest go first; `store: false` keeps none)"),
    Key(S, "responses_ttl_s", "responses_ttl_s", as_float, lambda v: v > 0, "> 0 seconds",
        here="ours: how long a kept response stays"),
    Key(S, "max_body_bytes", "max_body_bytes", as_int, lambda v: v >= 1024, ">= 1024", here="larger HTTP bodies get 413"),
    Key(S, "max_header_bytes", "max_header_bytes", as_int, lambda v: v >= 1024, ">= 1024",
        here="larger request headers get 431 and the connection is closed"),
    Key(S, "http_header_timeout_s", "http_header_timeout_s", as_float, lambda v: v > 0, "> 0 seconds",
        here="a connection must send each request's headers within this many seconds of opening or of its previous "
             "response, else it is closed: idle and slow-header sockets cannot pile up"),
    Key(S, "http_keepalive_timeout_s", "http_keepalive_timeout_s", as_float, lambda v: v >= 1, ">= 1 second",
        here="an idle keep-alive connection is closed after this many seconds"),
    Key(S, "warmup", "warmup", as_bool, here="build every graph before ready"),
    Key(S, "enable_prefix_caching", "enable_prefix_caching", as_bool, here="reuse KV blocks of a prompt prefix computed before"),
    Key(S, "deterministic", "deterministic", as_bool,
        here="ours: batch-invariant kernels: a request's tokens and logprobs do not depend on what else its steps hold "
             "(float projections on one summation order at every row count, attention one token at a time); the cost "
             "by CPU: docs/benchmarks.md, \"Batch invariance\""),
    Key(S, "overlap_steps", "overlap_steps", as_bool,
        here="send step N+1 while the agent runs step N (shortly before N is due to end, from each bucket's recent "
             "step times, so that N+1 takes the prompts that arrived meanwhile), its decodes fed by the agent's own "
             "last samples (`false` or "
             "`llm-serving --no-overlap`: one step at a time, for debugging and A/B). Greedy output is the same either way"),
    Key(S, "request_log", "request_log", str,
        here="a JSON-lines file, one line per ended request: arrival, first scheduled, inference begin/end, first token, "
             "finish (Unix s) and the derived waiting / scheduling-to-inference / inference / TTFT / latency"),
    Key(S, "agent_cores", "agent_cores", as_cores, here="CPU cores per agent, e.g. `[[0], [1]]` (empty: spread over CPUs)"),
    Key(S, "agent_hosts", "agent_hosts", as_hosts,
        here="one host per `agent_ports` entry, for agents on several hosts (else `agent_ip` for all); "
             "`llm-serving --agents host:port,...` sets both"),
    Key(S, "curve_keys", "curve_keys", str,
        here="a CURVE key folder (`tools/curve_keys.py`): tcp agents accept only the servers it lists, frames "
             "encrypted (docs/protocol.md)"),
    Key(S, "compile_cache_dir", "compile_cache_dir", str, here="on-disk MindSpore compile cache"),
    # ---------------------------------------------------------------- pa_config
    Key(P, "num_blocks", "num_blocks", as_blocks, lambda v: v == 0 or v >= 2, ">= 2 (block 0 is reserved) or auto",
        "KV blocks per device",
        "same (block 0 is reserved); must hold one `decode_seq_length` sequence. `auto` (0): sized before the agents "
        "load (common/memory.py): `serving_config.kv_cache_memory` bytes of blocks when set, else 90% of the host "
        "memory left per agent after weights, activations and runtime, at most every running sequence at full "
        "length. `llm-serving --dry-run` prints the plan"),
    Key(P, "block_size", "block_size", as_int, lambda v: v >= 1, ">= 1", "tokens per block", "same"),
    Key(P, "decode_seq_length", "max_model_len", as_int, lambda v: v >= 2, ">= 2", "longest sequence",
        "same: the KV context per sequence"),
    # ---------------------------------------------------------------- tokenizer
    Key(T, "path", "tokenizer_path", str, here="ours: the same as `vocab_file` (which wins when both are set)"),
    Key(T, "vocab_file", "tokenizer_path", str, original="tokenizer file (`tokenizer.model`)",
        here="a SentencePiece `tokenizer.model` or a `tokenizer.json`; its vocabulary must fit the model's (a llama2 "
             "tokenizer in front of another model stops the start)"),
    Key(T, "type", None, original="tokenizer class", ignored="the tokenizer is read from vocab_file or the model's own files"),
    Key(T, "chat_template", "chat_template", str,
        here="ours: a Jinja chat template, or a file holding one, used instead of the model's own (as vLLM's "
             "`--chat-template`); a model without one (Gemma 3 270M's GGUF: configs/gemma3-270m.yaml) otherwise "
             "chats as `role: content` lines"),
    # ---------------------------------------------------------------- LoRA adapters (vLLM's names)
    Key(S, "lora_modules", "lora_modules", as_adapters,
        here="ours: LoRA adapters served beside the base, `{name: path}` (`--lora-modules name=path`): a PEFT "
             "folder or a llama.cpp LoRA GGUF (`.gguf`); a request picks one by `model` (OpenAI), `adapter_id` "
             "(TGI) or `adapter` (the original's API). All are checked at start, the first `max_loras` loaded "
             "into the slots of every agent"),
    Key(S, "enable_lora", "enable_lora", as_bool,
        here="ours (vLLM's `--enable-lora`): LoRA slots on the agents with no adapter at start; "
             "`POST /v1/load_lora_adapter` fills them (on whenever `lora_modules` is set)"),
    Key(S, "max_loras", "max_loras", as_int, lambda v: v >= 1, ">= 1",
        here="adapter slots per agent: a static shape of every graph (each slot costs its columns in every step). "
             "More adapters than slots are served: a request whose adapter is in no slot waits until the least "
             "recently used one that no running request uses is swapped out for it, between steps"),
    Key(S, "max_lora_rank", "max_lora_rank", as_int, lambda v: 1 <= v <= 256, "in [1, 256]",
        here="the largest adapter rank served; a larger one is refused at load"),
    # ---------------------------------------------------------------- speculative_config (vLLM's names)
    Key(X, "method", "spec_method", lower,
        here="ours: speculative decoding (`--speculative-config '{\"method\": \"ngram\"}'`), drafts verified in the "
             "same step, exactly (greedy and seeded output token for token as without, in every dtype with "
             "`deterministic`: docs/protocol.md): `ngram` "
             "drafts from the sequence's own prompt and output (prompt lookup); `self_int8` from the served weights "
             "quantised to int8 (a float model_dtype); `draft` from `draft_model_path`, a smaller model with the same "
             "tokenizer. Drafting runs on the agent. Unset: off. vLLM's other methods (`eagle`, `mtp`, ...) are "
             "refused by name"),
    Key(X, "draft_model_path", "spec_draft_model", str,
        here="`draft`'s model: a `.gguf`, a Hugging Face folder or a packaged model, run in model_dtype beside the "
             "target on each agent with a KV cache of the target's num_blocks (the memory plan counts both); a "
             "tokenizer other than the target's is refused at start"),
    Key(X, "num_speculative_tokens", "spec_tokens", as_int, lambda v: 1 <= v <= 16, "in [1, 16]",
        here="most drafts per decode (k); each sequence's own k adapts to its acceptance and falls to 0 where "
             "nothing is proposed or accepted"),
    Key(X, "prompt_lookup_min", "spec_lookup_min", as_int, lambda v: v >= 1, ">= 1",
        here="shortest suffix (tokens) the n-gram proposer looks up"),
    Key(X, "prompt_lookup_max", "spec_lookup_max", as_int, lambda v: v >= 1, ">= 1 (and >= prompt_lookup_min)",
        here="longest suffix it looks up first"),
    Key(X, "disable_by_batch_size", "spec_max_batch", as_int, lambda v: v >= 0, ">= 0",
        here="no drafts in a step with more running sequences than this (0: no limit): a large batch is bound by "
             "compute, where a rejected draft costs a token's work"),
]
