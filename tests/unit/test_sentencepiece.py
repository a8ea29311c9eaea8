"""Our SentencePiece tokenizer (the model file read with the sentencepiece package, converted to a
`tokenizers` Tokenizer) against the sentencepiece library's own encoder, on BPE and Unigram models
trained here: same ids, same text back."""
from __future__ import annotations

import json

import numpy as np
import pytest

from common.model_files import ModelFiles
from common.tokenizer import load_tokenizer

import sentencepiece as spm

CORPUS = [
    "The capital of France is Paris. The Eiffel Tower was finished in 1889.",
    "Large language models predict the next token; serving them fast needs batching.",
    "MindSpore compiles static graphs, and the KV cache lives in paged blocks of slots.",
    "Numbers like 3.14159 and 42, punctuation (!?), and  double  spaces appear too.",
] * 40
SAMPLES = ["The capital of France is", "  leading spaces and trailing ", "naïve café — 東京 🚀 unseen",
           "tokens\nwith\nnewlines", "Paris", "x", "MindSpore KV cache blocks"]


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def trained(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=500 if request.param == "bpe" else 340, model_type=request.param,
        byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        normalization_rule_name="identity", minloglevel=2)
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return folder, spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")), request.param


def test_tokenizer_model_matches_sentencepiece(trained):
    folder, ref, _ = trained
    ours = load_tokenizer(ModelFiles("hf", folder))  # no tokenizer.json: falls back to tokenizer.model
    assert ours.add_bos and ours.bos_token_id == 1 and ours.eos_token_ids == [2]
    assert ours.vocab_size == ref.get_piece_size()
    for text in SAMPLES:
        ids = ref.encode(text)
        assert ours.encode(text) == [1, *ids], text
        assert ours.decode(ids) == ref.decode(ids), text
    fallback = ours.encode("東京")[1:]
    assert all(ref.id_to_piece(i).startswith("<0x") for i in fallback if ref.id_to_piece(i) != "▁")


def test_gguf_llama_vocabulary_matches_sentencepiece(trained, tmp_path):
    """llama.cpp's "llama" GGUF vocabulary (pieces, scores, types) is the same SentencePiece model."""
    import gguf

    _, ref, kind = trained
    if kind != "bpe":
        pytest.skip("llama.cpp's 'llama' vocabulary is SentencePiece BPE")
    n = ref.get_piece_size()
    types = [2 if ref.is_unknown(i) else 3 if ref.is_control(i) else 6 if ref.is_byte(i) else 1 for i in range(n)]
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([ref.id_to_piece(i) for i in range(n)])
    w.add_token_scores([ref.get_score(i) for i in range(n)])
    w.add_token_types(types)
    w.add_remove_extra_whitespaces(True)  # as trained (SentencePiece's default; Llama 2 has it off)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("dummy", np.zeros(1, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = load_tokenizer(ModelFiles("gguf", tmp_path / "v.gguf"))
    for text in SAMPLES:
        assert ours.encode(text) == [1, *ref.encode(text)], text
