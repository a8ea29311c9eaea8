"""SentencePiece vocabularies (a `tokenizer.model` file, read with the sentencepiece package, or a
GGUF "llama" vocabulary) as a `tokenizers` Tokenizer: one fast, GIL-releasing tokenizer for both.
The conversion follows transformers' LlamaConverter (BPE: merges recovered from piece scores, byte
fallback) and its Unigram counterpart."""
from __future__ import annotations

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


def read_model_file(data: bytes) -> SpmVocab:
    """A `tokenizer.model` (sentencepiece_model.proto's ModelProto) read with the sentencepiece
    package: pieces, scores and types, the model type, and the two normaliser flags that matter. The
    precompiled normalisation map is not applied: Llama-family models use the identity rule."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError
        raise ValueError(f"not a SentencePiece model: {exc}") from None
    if not proto.pieces:
        raise ValueError("not a SentencePiece model: no pieces")
    return SpmVocab([p.piece for p in proto.pieces], [p.score for p in proto.pieces], [p.type for p in proto.pieces],
                    proto.trainer_spec.model_type, proto.normalizer_spec.add_dummy_prefix,
                    proto.normalizer_spec.remove_extra_whitespaces)


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
