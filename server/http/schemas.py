"""Request bodies of every API as pydantic models: FastAPI validates them and `/openapi.json` (and
`/docs`) describe them. Lax as the original's clients need (booleans and numbers may arrive as
strings: "True", "0.7"), never a boolean where a number belongs; unknown fields are kept and
ignored. The meaning of each field (defaults, do_sample, -1 = off, ...) is applied in params.py."""
from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, StrictInt


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("must be a number, not a boolean")
    return v


# Token-id prompts longer than this are refused before their items are validated (a 5 MB id list
# took 2.3 s with a Python validator per item); the context length is checked after, in prompts.py.
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


class Lax(BaseModel):
    model_config = ConfigDict(extra="allow")


class GenerationParameters(Lax):
    """`parameters` of the original llm-serving and TGI APIs."""
    do_sample: bool | None = None
    max_new_tokens: Int | None = None
    temperature: Float | None = None
    top_k: Int | None = None
    top_p: Float | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    seed: Int | None = None
    stop: Stop | None = None
    ignore_eos: bool | None = None
    return_full_text: bool | None = None
    details: bool | None = None
    top_n_tokens: Int | None = None
    priority: Int | None = None
    return_protocol: str | None = None  # original only: "sse" (default) or anything else for `data:` lines


class GenerateRequest(Lax):
    """Original llm-serving and TGI: `inputs` is text or token ids."""
    inputs: Prompt
    parameters: GenerationParameters | None = None
    stream: bool | None = None


class ContentPart(Lax):
    type: str
    text: str | None = None


class ChatMessage(Lax):
    role: str
    content: Union[str, list[ContentPart], None] = None


class StreamOptions(Lax):
    include_usage: bool | None = None


class _OpenAI(Lax):
    model: str | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    temperature: Float | None = None
    top_k: Int | None = None
    top_p: Float | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    seed: Int | None = None
    stop: Stop | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool | None = None
    n: Int | None = None
    best_of: Int | None = None
    priority: Int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Float] | None = None  # refused unless empty
    echo: bool | None = None  # /v1/completions: the prompt before the completion


class CompletionRequest(_OpenAI):
    prompt: Union[str, list[str], TokenIds]
    logprobs: Int | None = None


class ChatRequest(_OpenAI):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: Int | None = None


class TokenizeRequest(Lax):
    inputs: str


def as_dict(body: BaseModel) -> dict[str, Any]:
    """The fields the client sent (coerced), nested models as dicts: what params.py reads."""
    return body.model_dump(exclude_unset=True)
