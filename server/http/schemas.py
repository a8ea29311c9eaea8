"""Request bodies of every API as pydantic models, parsed once: FastAPI validates them (a bad field is
a 400 naming it), `/openapi.json` (and `/docs`) describe them, and each dialect's model turns itself
into SamplingParams (`to_sampling_params`). Lax as the original's clients need (booleans and numbers
may arrive as strings: "True", "0.7"; null means absent), never a boolean where a number belongs.
A field no model declares is a 400 naming it (nothing a client sends is ignored silently), but for
the few in IGNORED that ask for no action here. The sampling knobs every dialect shares are declared
once (`SamplingFields`); structured output and tools are server/http/structured.py's."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, field_validator, model_validator

from server.http.structured import (ResponseFormat, TgiGrammar, Tool, ToolChoice, call_grammar, chosen_tools,
                                    compile_format, compile_tgi, tools_system_prompt)
from server.sampling_params import InvalidRequest, SamplingParams


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("must be a number, not a boolean")
    return v


# Token-id prompts longer than this are refused before their items are validated (a Python validator
# per item took seconds on a megabytes-long list); the context length is checked after, in prompts.py.
MAX_PROMPT_IDS = 1 << 20


def _bounded_ids(v: Any) -> Any:
    if isinstance(v, list) and len(v) > MAX_PROMPT_IDS:
        raise ValueError(f"a token-id prompt has at most {MAX_PROMPT_IDS} ids")
    return v


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]
Stop = Union[str, list[str]]
TokenIds = Annotated[list[StrictInt], BeforeValidator(_bounded_ids)]  # strict: validated in Rust, no booleans
Prompt = Union[str, TokenIds]


MAX_CHOICES = 16  # OpenAI's `n`: choices of one request, each a sequence of its own

# Fields clients send that need no action here (OpenAI's end-user id, tags, storage and tier hints).
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})


class Lax(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None and k not in IGNORED} if isinstance(data, dict) else data


class SamplingFields(Lax):
    """The sampling knobs every dialect shares, with their defaults (top_k -1 is vLLM's "off")."""
    temperature: Float = Field(1.0, description="0 = greedy (TGI and the original: do_sample false)")
    top_k: Int = Field(0, description="0 or -1 = off")
    top_p: Float = Field(1.0, description="nucleus mass in (0, 1]")
    min_p: Float = Field(0.0, description="drop tokens below min_p x the top probability")
    repetition_penalty: Float = Field(1.0, description="> 0; 1 = off (over prompt and output, as in HF)")
    presence_penalty: Float = Field(0.0, description="in [-2, 2]: once for each token already in the output")
    frequency_penalty: Float = Field(0.0, description="in [-2, 2]: per occurrence in the output")
    seed: Int | None = Field(None, description="the same seed and prompt give the same tokens")
    stop: Stop = Field([], description="strings that end the output (not included)")
    ignore_eos: bool = Field(False, description="generate past EOS until max tokens")
    priority: Int = Field(0, description="lower runs first with schedule_policy priority")

    def sampling_params(self, max_new_tokens: int | None, logprobs: int, top_k: int | None = None,
                        **extra: Any) -> SamplingParams:
        """SamplingParams of these fields (validated); `top_k`: the dialect's default when unset."""
        k = self.top_k if top_k is None or "top_k" in self.model_fields_set else top_k
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=0 if k == -1 else k,
            top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop), ignore_eos=self.ignore_eos,
            logprobs=logprobs, priority=self.priority, **extra).validate()


class GenerationParameters(SamplingFields):
    """`parameters` of the original llm-serving and TGI APIs (output options default per dialect)."""
    do_sample: bool = False
    max_new_tokens: Int | None = None
    return_full_text: bool | None = None
    details: bool | None = None
    top_n_tokens: Int = 0
    return_protocol: str = "sse"  # original only: "sse" or anything else for `data:` lines
    grammar: TgiGrammar | None = None
    # TGI's, honoured at their defaults only (a 400 otherwise, never silence)
    typical_p: Float | None = None
    truncate: Int | None = None
    watermark: bool = False
    best_of: Int | None = None
    decoder_input_details: bool = False
    adapter_id: str | None = None  # a LoRA adapter by name (TGI's; the original API's `adapter` too)
    adapter: str | None = None

    def adapter_name(self) -> str | None:
        if self.adapter_id is not None and self.adapter is not None and self.adapter_id != self.adapter:
            raise InvalidRequest("parameters.adapter_id and parameters.adapter name different adapters")
        return self.adapter_id if self.adapter_id is not None else self.adapter

    def to_sampling_params(self, top_k: int = 0, prompt_details: bool = False) -> SamplingParams:
        """`prompt_details`: the route returns the prompt's logprobs (TGI's /generate)."""
        unsupported = {"typical_p": self.typical_p not in (None, 1.0), "truncate": self.truncate is not None,
                       "watermark": self.watermark, "best_of": self.best_of not in (None, 1)}
        for name, asked in unsupported.items():
            if asked:
                raise InvalidRequest(f"parameters.{name} is not supported by this server")
        if self.decoder_input_details and not prompt_details:
            raise InvalidRequest("parameters.decoder_input_details is supported only by TGI's /generate (not streamed)")
        sp = self.sampling_params(self.max_new_tokens, self.top_n_tokens, top_k, grammar=compile_tgi(self.grammar))
        if not self.do_sample:  # greedy; the sampling knobs were still checked (a bad one is a 400 either way)
            sp.temperature, sp.top_k, sp.top_p, sp.min_p = 0.0, 0, 1.0, 0.0
        if self.decoder_input_details:
            sp.prompt_logprobs = 0
        return sp


class GenerateRequest(Lax):
    """Original llm-serving and TGI: `inputs` is text or token ids."""
    inputs: Prompt
    parameters: GenerationParameters = GenerationParameters()
    stream: bool = False


class ContentPart(Lax):
    type: str
    text: str | None = None
    image_url: Any = None  # refused with its part type below
    input_audio: Any = None


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionCall(Lax):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Lax):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lax):
    role: str
    content: Union[str, list[ContentPart]] = ""  # an assistant turn that only calls tools has none
    name: str | None = None
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown message role {role!r} (one of {', '.join(CHAT_ROLES)})")
        return role

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: str | list[ContentPart]) -> str:
        """Text parts (`[{"type": "text", "text": ...}]`) are joined; other part types are refused."""
        if isinstance(content, str):
            return content
        if not all(c.type == "text" and c.text is not None for c in content):
            raise ValueError('content parts must be {"type": "text", "text": ...}; other part types are not supported')
        return "".join(c.text for c in content)


class StreamOptions(Lax):
    include_usage: bool = False


class _OpenAI(SamplingFields):
    model: str | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    stop_token_ids: list[Int] = []
    n: Int = 1
    best_of: Int | None = None
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    logit_bias: dict[str, Float] | None = None  # refused unless empty
    echo: bool = False  # /v1/completions: the prompt before the completion
    response_format: ResponseFormat | None = None

    def _openai_params(self, logprobs: int, grammar: str | None = None) -> SamplingParams:
        """OpenAI fields this server cannot honour get a 400, never silence."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}]")
        if self.best_of not in (None, self.n):
            raise InvalidRequest("best_of is supported only equal to n (every choice is returned)")
        if self.logit_bias:  # {} and null change nothing
            raise InvalidRequest("logit_bias is not supported")
        most = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        if most is not None and most < 1:  # named as the client sent it
            raise InvalidRequest(f"{'max_tokens' if self.max_completion_tokens is None else 'max_completion_tokens'} "
                                 "must be >= 1")
        if not 0 <= self.temperature <= 2:
            raise InvalidRequest("temperature must be in [0, 2]")
        fmt = compile_format(self.response_format)
        if fmt and grammar:
            raise InvalidRequest("response_format cannot be combined with a required tool call")
        return self.sampling_params(most, logprobs, stop_token_ids=list(self.stop_token_ids), grammar=fmt or grammar)


class CompletionRequest(_OpenAI):
    prompt: Union[str, list[str], TokenIds]
    logprobs: Int = 0

    def to_sampling_params(self) -> SamplingParams:
        sp = self._openai_params(self.logprobs)
        if self.echo and self.logprobs:  # the prompt's logprobs too (vLLM's and OpenAI's legacy echo)
            sp.prompt_logprobs = self.logprobs
        return sp


class ChatRequest(_OpenAI):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Int = 0
    tools: list[Tool] = []
    tool_choice: ToolChoice | None = None  # "auto" when there are tools
    parallel_tool_calls: bool = True  # one call is what a required choice produces; auto parses any

    @property
    def callable_tools(self) -> list[Tool]:
        return chosen_tools(self.tools, self.tool_choice)[0]

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise InvalidRequest("echo is supported only by /v1/completions")
        tools, must_call = chosen_tools(self.tools, self.tool_choice)
        return self._openai_params((self.top_logprobs or 1) if self.logprobs else 0,
                                   call_grammar(tools) if must_call else None)

    def chat(self, template_has_tools: bool = False) -> list[dict[str, Any]]:
        """The messages for the chat template: calls and tool results in the fields HF templates
        read where the template knows tools, else as text (and the tools in a system turn)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
            if template_has_tools:
                msg: dict[str, Any] = {"role": m.role, "content": m.content}
                if calls:
                    msg["tool_calls"] = [{"type": "function", "function": c} for c in calls]
                out.append({**msg, **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})})
            else:
                text = "\n".join(f'{{"name": "{c["name"]}", "arguments": {c["arguments"]}}}' for c in calls)
                out.append({"role": m.role, "content": m.content + text})
        tools = self.callable_tools
        if tools and not template_has_tools:
            if out[0]["role"] == "system":
                out[0]["content"] = tools_system_prompt(tools) + "\n\n" + out[0]["content"]
            else:
                out.insert(0, {"role": "system", "content": tools_system_prompt(tools)})
        return out


class TokenizeRequest(Lax):
    inputs: str
