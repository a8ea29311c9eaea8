"""SentencePiece vocabularies (a `tokenizer.model` file, or a GGUF "llama" vocabulary) as a
`tokenizers` Tokenizer, without the sentencepiece or protobuf packages: the model file is a small
protobuf we read by hand, and the conversion follows transformers' LlamaConverter (BPE: merges
recovered from piece scores, byte fallback) and its Unigram counterpart."""
from __future__ import annotations

import struct
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, decoders, models, normalizers

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # SentencePiece.Type
UNIGRAM, BPE = 1, 2  # TrainerSpec.ModelType


@dataclass
class SpmVocab:
    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: int = BPE
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = False

    @property
    def byte_fallback(self) -> bool:
        return BYTE in self.types

    def ids_of(self, kind: int) -> list[int]:
        return [i for i, t in enumerate(self.types) if t == kind]


def _fields(buf: bytes):
    """(field number, wire type, value) of one protobuf message; length-delimited values as bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _varint(buf, i)
        elif wire == 1:
            val, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            val, i = buf[i:i + n], i + n
        elif wire == 5:
            val, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield num, wire, val


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        if b < 0x80:
            return out, i
        shift += 7


def read_model_file(data: bytes) -> SpmVocab:
    """Parse sentencepiece_model.proto's ModelProto: pieces (1), trainer_spec.model_type (2.3),
    normalizer_spec.add_dummy_prefix and remove_extra_whitespaces (3.3, 3.4). The precompiled
    normalisation map (3.2) is not applied: Llama-family models use the identity rule."""
    vocab = SpmVocab([], [], [])
    for num, _, val in _fields(data):
        if num == 1:
            piece, score, kind = "", 0.0, NORMAL
            for f, _, v in _fields(val):
                if f == 1:
                    piece = v.decode("utf-8")
                elif f == 2:
                    score = struct.unpack("<f", v)[0]
                elif f == 3:
                    kind = v
            vocab.pieces.append(piece)
            vocab.scores.append(score)
            vocab.types.append(kind)
        elif num == 2:
            vocab.model_type = next((v for f, _, v in _fields(val) if f == 3), UNIGRAM)
        elif num == 3:
            spec = {f: v for f, _, v in _fields(val)}
            vocab.add_dummy_prefix = bool(spec.get(3, 1))
            vocab.remove_extra_whitespaces = bool(spec.get(4, 1))
    if not vocab.pieces:
        raise ValueError("not a SentencePiece model: no pieces")
    return vocab


def _merges(vocab: SpmVocab) -> list[tuple[str, str]]:
    """BPE merges from scores: every split of a piece into two pieces, the best-scored merged piece
    first (transformers' SentencePieceExtractor)."""
    ids = {p: i for i, p in enumerate(vocab.pieces)}
    found = []
    for piece, score in zip(vocab.pieces, vocab.scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in ids and piece[k:] in ids]
        found += sorted(local, key=lambda m: (ids[m[0]], ids[m[1]]))
    found.sort(key=lambda m: m[2], reverse=True)
    return [(a, b) for a, b, _ in found]


def spm_tokenizer(vocab: SpmVocab) -> Tokenizer:
    unk = vocab.ids_of(UNKNOWN)
    if vocab.model_type == BPE:
        table = {p: i for i, p in enumerate(vocab.pieces)}
        model = models.BPE(table, _merges(vocab), unk_token=vocab.pieces[unk[0]] if unk else None,
                           fuse_unk=True, byte_fallback=vocab.byte_fallback)
    elif vocab.model_type == UNIGRAM:
        model = models.Unigram(list(zip(vocab.pieces, vocab.scores)), unk[0] if unk else None,
                               vocab.byte_fallback)
    else:
        raise ValueError(f"unsupported SentencePiece model type {vocab.model_type} (only BPE and Unigram)")
    tok = Tokenizer(model)
    # SentencePiece normalises the whole text, then marks spaces (and a dummy prefix) with U+2581.
    norm = [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")] if vocab.remove_extra_whitespaces else []
    norm += [normalizers.Prepend("▁")] if vocab.add_dummy_prefix else []
    tok.normalizer = normalizers.Sequence(norm + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if vocab.add_dummy_prefix else []))
    tok.add_special_tokens([vocab.pieces[i] for i in vocab.ids_of(CONTROL) + unk])
    user = [vocab.pieces[i] for i in vocab.ids_of(USER_DEFINED)]
    if user:
        tok.add_tokens(user)
    return tok
