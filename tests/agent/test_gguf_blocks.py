"""model_dtype gguf: GGUF's quantised blocks read as stored (agent/kernels/linear_gguf.cpp). Every block
type dequantises to the bits of the gguf package's NumPy dequantiser (an independent reference of
llama.cpp's formats); the projection equals float64 arithmetic on its int8-quantised activations and
those weights, gives a token the same bits in a step of any size, and a served GGUF holds its file's
bytes."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from agent import kernels as native
from agent.model.blocks import BLOCK_TYPES, BlockRows, segments
from tests.agent.kernel_calls import call_kernel

pytestmark = pytest.mark.isa  # the kernels a CPU kind changes: run again under LLM_SERVING_MAX_ISA
# where each block stores its float16 scales (the rest: any bytes are a valid block)
SCALES_AT = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


@pytest.fixture(scope="module")
def lib():
    path = native.library()
    assert path, "the native kernels must build here"
    return ctypes.CDLL(path)


def random_rows(rng: np.random.Generator, kind: int, n: int, k: int) -> BlockRows:
    per, size = BLOCK_TYPES[kind]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at in SCALES_AT[kind]:
        scales = rng.uniform(-0.02, 0.02, (n, k // per)).astype(np.float16)
        raw[..., at:at + 2] = scales.view(np.uint8).reshape(n, k // per, 2)
    return BlockRows(kind, raw.reshape(n, -1), k)


def quantized_input(x: np.ndarray) -> np.ndarray:
    """The kernel's activations in float64: per token and 32 inputs, round(x * 127 / max|x|) times max|x| / 127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True).astype(np.float32)
    q = np.round(blocks.astype(np.float64) * np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32))
    return (q * (amax / np.float32(127)).astype(np.float32)).reshape(x.shape)


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_each_block_type_dequantises_to_the_gguf_package_s_bits(lib, kind):
    rng = np.random.default_rng(kind)
    rows = random_rows(rng, kind, 24, 512)
    want = rows.dequantize()
    got = np.zeros(rows.shape, np.float32)
    assert call_kernel(lib, "DequantizeGguf", [rows.data, np.array([kind], np.int64), got]) == 0
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_projection_of_mixed_types_equals_float64_on_its_quantised_input(lib):
    """Q|K|V as Q4_K_M files mix it: three segments of three types, the first scaled (the attention
    scale), the norm gain in front; within 2e-6 of the largest output."""
    rng = np.random.default_rng(1)
    k, m = 512, 7
    parts = [random_rows(rng, 12, 40, k), random_rows(rng, 6, 24, k), random_rows(rng, 14, 24, k)]
    w, seg, rs = segments(parts, [0.125, 1.0, 1.0])
    x, g = rng.standard_normal((m, k)).astype(np.float32), rng.uniform(0.5, 1.5, k).astype(np.float32)
    y = np.zeros((m, rs.size), np.float32)
    assert call_kernel(lib, "LinearGguf", [x, w, seg, rs, g, y]) == 0
    weights = np.concatenate([p.dequantize() for p in parts]).astype(np.float64)
    want = quantized_input(x * g) @ weights.T * rs
    assert np.abs(y - want).max() <= 2e-6 * np.abs(want).max()


@pytest.mark.parametrize("kind", [3, 12, 14])
def test_a_token_s_output_is_the_same_bits_in_a_step_of_any_size(lib, kind):
    """Batch invariance by construction: one token alone, and at each place of steps of 2 to 9 tokens."""
    rng = np.random.default_rng(2)
    k = 768 if kind in (12, 14) else 576
    w, seg, rs = segments([random_rows(rng, kind, 70, k)], [1.0])
    g = np.ones(k, np.float32)
    x = rng.standard_normal((9, k)).astype(np.float32)
    alone = []
    for t in range(9):
        y = np.zeros((1, rs.size), np.float32)
        call_kernel(lib, "LinearGguf", [x[t:t + 1].copy(), w, seg, rs, g, y])
        alone.append(y[0])
    for m in range(2, 10):
        y = np.zeros((m, rs.size), np.float32)
        call_kernel(lib, "LinearGguf", [x[:m].copy(), w, seg, rs, g, y])
        assert all(np.array_equal(y[t], alone[t]) for t in range(m)), m


def test_embedding_rows_are_the_dequantised_rows_times_the_scale(lib):
    rng = np.random.default_rng(3)
    rows = random_rows(rng, 8, 50, 256)
    w, seg, _ = segments([rows], [1.0])
    tokens = np.array([3, 0, 49, 3], np.int32)
    scale = np.full(256, 16.0, np.float32)
    y = np.zeros((4, 256), np.float32)
    assert call_kernel(lib, "EmbedGguf", [tokens, w, seg, scale, y]) == 0
    assert np.array_equal(y, rows.dequantize()[tokens] * np.float32(16.0))


def test_malformed_weights_are_refused_not_read(lib):
    rng = np.random.default_rng(4)
    w, seg, rs = segments([random_rows(rng, 2, 8, 64)], [1.0])
    x, g, y = np.ones((1, 64), np.float32), np.ones(64, np.float32), np.zeros((1, 8), np.float32)
    for bad in (np.array([[99, 8, 0]], np.int64), np.array([[2, 8, 64]], np.int64), np.array([[2, 9, 0]], np.int64)):
        assert call_kernel(lib, "LinearGguf", [x, w, bad, rs, g, y]) != 0


def test_a_folder_or_an_unread_block_type_is_refused_by_name(tiny_model_dir, tmp_path):
    """gguf reads a GGUF file's blocks: a Hugging Face folder is refused, and so is a file whose
    matrices are of a type the kernels do not read (named with its tensor), never served otherwise."""
    from agent.weights.families import UnsupportedModel
    from agent.weights.gguf import read_tensor
    from agent.weights.load import load_model
    from common.model_files import ModelFiles
    from common.gguf_file import GgufFile
    import gguf

    with pytest.raises(UnsupportedModel, match="is not a .gguf"):
        load_model(ModelFiles("hf", tiny_model_dir), blocks=True)
    path = tmp_path / "f16.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 32), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match="blk.0.attn_q.weight is F16: model_dtype gguf reads"):
        read_tensor(GgufFile(path).tensors[0], blocks=True)
