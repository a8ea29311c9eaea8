"""Tokenizer from a GGUF vocabulary or a Hugging Face tokenizer.json (via `tokenizers`), plus the
model's chat template."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from common.model_files import ModelFiles
from common.gguf_file import GgufFile
from common.sentencepiece import BPE, CONTROL, SpmVocab, read_model_file, spm_tokenizer

# GGUF `tokenizer.ggml.pre` -> digit handling in front of the GPT-2 byte-level split.
_INDIVIDUAL_DIGITS = {"smollm"}


@dataclass
class TextTokenizer:
    tok: Tokenizer
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    special_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not): a 5 MB prompt tokenised in a worker thread
        # no longer stalls the HTTP event loop for seconds.
        ids = self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def spans(self, text: str) -> list[tuple[int, int, int]]:
        """(id, start, end) of each token of `text` (character offsets), no special tokens added."""
        enc = self.tok.encode_batch([text], add_special_tokens=False)[0]
        return [(i, a, b) for i, (a, b) in zip(enc.ids, enc.offsets)]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    @property
    def _special_ids(self) -> set[int]:
        return set(self.special_tokens.values())

    def id_to_token(self, token_id: int) -> str:
        return self.tok.id_to_token(token_id) or ""

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template renders `tools` and tool calls itself (HF's convention)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if not self.chat_template:
            # Plain fallback so chat still works on models without a template.
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        special = {k: v for k, v in self.special_tokens.items()}
        bos = next((k for k, v in special.items() if v == self.bos_token_id), "")
        eos = next((k for k, v in special.items() if v in self.eos_token_ids), "")
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos,
            tools=tools)


def load_tokenizer(files: ModelFiles, tokenizer_path: str | None = None,
                   chat_template: str | None = None) -> TextTokenizer:
    """`tokenizer_path` (the original config's `vocab_file`) may name a tokenizer.json or a
    SentencePiece tokenizer.model; otherwise the model's own vocabulary is used. `chat_template`: a
    Jinja template or a file holding one, instead of the model's own."""
    tok = _load(files, tokenizer_path)
    if chat_template:
        path = Path(chat_template).expanduser()
        tok.chat_template = path.read_text() if "{" not in chat_template and path.is_file() else chat_template
    return tok


def _load(files: ModelFiles, tokenizer_path: str | None) -> TextTokenizer:
    if tokenizer_path:
        return _from_file(Path(tokenizer_path), Path(tokenizer_path).parent)
    if files.kind == "gguf":
        return _from_gguf(files.path)
    folder = files.path if files.path.is_dir() else files.path.parent
    if not (folder / "tokenizer.json").exists() and (folder / "tokenizer.model").exists():
        return _from_file(folder / "tokenizer.model", folder)
    return _from_file(folder / "tokenizer.json", folder)


def _from_file(path: Path, folder: Path) -> TextTokenizer:
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer file at {path}")
    spm = path.suffix == ".model"
    if spm:
        tok = spm_tokenizer(read_model_file(path.read_bytes()))
    else:
        tok = Tokenizer.from_file(str(path))
    cfg: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").exists():
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    model_cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}

    def token_id(v: Any) -> int | None:
        name = v.get("content") if isinstance(v, dict) else v
        return tok.token_to_id(name) if name else None

    # SentencePiece models follow Llama's conventions unless the configs say otherwise.
    eos = model_cfg.get("eos_token_id", token_id(cfg.get("eos_token", "</s>" if spm else None)))
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    bos = model_cfg.get("bos_token_id", token_id(cfg.get("bos_token", "<s>" if spm else None)))
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return TextTokenizer(tok, eos_ids, bos, bool(cfg.get("add_bos_token", spm)), cfg.get("chat_template"), special)


def _from_gguf(path: Path) -> TextTokenizer:
    f = GgufFile(path).meta
    kind = f["tokenizer.ggml.model"]
    tokens = f["tokenizer.ggml.tokens"]
    types = f["tokenizer.ggml.token_type"]
    if kind == "llama":  # SentencePiece (Llama 1/2, Mistral...): llama.cpp adds BOS by default
        flag = lambda key, default: bool(f[key]) if key in f else default  # noqa: E731
        tok = spm_tokenizer(SpmVocab(tokens, list(f["tokenizer.ggml.scores"]), list(types), BPE,
                                     flag("tokenizer.ggml.add_space_prefix", True),
                                     flag("tokenizer.ggml.remove_extra_whitespaces", False)))
    elif kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in f["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        pre = f.get("tokenizer.ggml.pre")
        if pre is not None and pre in _INDIVIDUAL_DIGITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([t for i, t in enumerate(tokens) if types[i] == CONTROL])
    else:
        raise ValueError(f"unsupported GGUF vocabulary {kind!r} (gpt2 byte-level BPE and llama SentencePiece)")
    special = {t: i for i, t in enumerate(tokens) if types[i] == CONTROL}
    bos = f.get("tokenizer.ggml.bos_token_id")
    add_bos = f.get("tokenizer.ggml.add_bos_token")
    tmpl = f.get("tokenizer.chat_template")
    return TextTokenizer(tok, [int(f["tokenizer.ggml.eos_token_id"])], int(bos) if bos is not None else None,
                         bool(add_bos) if add_bos is not None else kind == "llama", tmpl, special)
