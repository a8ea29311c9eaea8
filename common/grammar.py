"""Constrained decoding's grammars, with llguidance (the grammar engine vLLM, SGLang and llama.cpp
offer; xgrammar needs torch at import, which the product may not depend on). The server compiles a
request's JSON schema, regex or Lark grammar into llguidance's grammar text and checks it against
the tokenizer (`check`); the agent keeps one matcher per constrained sequence and masks each row's
logits before sampling (agent/grammar.py)."""
from __future__ import annotations

import json
from typing import Any

import llguidance as llg

from common.tokenizer import TextTokenizer

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused before compiling
# llguidance's parser limits (lexer fuel, items per step, grammar size): building a matcher or a mask
# past them is an error, never a stall.
LIMITS = llg.LLParserLimits()
# Compact JSON, as OpenAI's structured outputs write it. Whitespace allowed between tokens (a space,
# or a newline and an indent) did not help SmolLM2 end its replies: at temperature 1, 18/20 schema
# replies and 11/20 `json_object` ones closed within 300 tokens, against 20/20 and 12/20 compact.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot constrain decoding: the client's 400."""


def ll_tokenizer(tok: TextTokenizer, vocab_size: int | None = None) -> llg.LLTokenizer:
    """The tokenizer as llguidance reads it (~0.2 s for a 49k vocabulary: build once)."""
    return llg.LLTokenizer(tok.tok.to_str(), n_vocab=vocab_size or tok.vocab_size, eos_token=list(tok.eos_token_ids))


def _sized(text: str, what: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{what} is {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
    return text


def from_json_schema(schema: Any, what: str = "the JSON schema") -> str:
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object")
    _sized(json.dumps(schema), what)
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"{what}: {exc}") from None


def from_regex(regex: Any) -> str:
    if not isinstance(regex, str):
        raise GrammarError("a regex grammar must be a string")
    return llg.LLMatcher.grammar_from_regex(_sized(regex, "the regex"))


def any_json_object() -> str:
    """`json_object`: any JSON object."""
    return from_json_schema({"type": "object"})


def check(grammar: str, tok: llg.LLTokenizer) -> None:
    """Raises GrammarError naming what is wrong with `grammar` for this tokenizer."""
    error = llg.LLMatcher.validate_grammar(grammar, tok, limits=LIMITS)
    if error:
        raise GrammarError(error.splitlines()[0][:500])
