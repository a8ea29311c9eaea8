"""The transformers (and PEFT) fixtures of tests/fixtures/ and runners on them, shared by the agent
tests: each family folder's golden logits and a runner on its weights; the LoRA adapters' goldens and
a runner with them in slots; teacher-forced logits along a fixture's sequences."""
from __future__ import annotations

import numpy as np

from agent.graph_call import setup_mindspore
from agent.lora import read_adapter
from agent.model.lora import LoraSlots
from agent.runner import ModelRunner
from agent.runner_config import RunnerConfig
from agent.tensor_parallel import Group
from agent.weights.load import load_model
from common.config import QUANT_GROUP_SIZE
from common.model_files import ModelFiles
from server.sampling_params import SamplingParams
from shm.arena import Arena, ArenaSpec
from shm.step import RowInput
from tests.helpers import ROOT

BLOCK, MAX_LEN = 16, 64
FIXTURES = ROOT / "tests" / "fixtures" / "families"
FOLDERS = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").exists())
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3, "int8": 6e-2, "int8:-1": 6e-2, "q8_0": 8e-2, "gguf": 6e-2}


def golden(folder: str) -> list[tuple[np.ndarray, np.ndarray]]:
    z = np.load(FIXTURES / folder / "golden.npz")
    return [(z[f"ids{i}"], z[f"logits{i}"]) for i in range(len(z.files) // 2)]


def runner_for(folder: str, dtype: str = "float32", native: bool = True, files: ModelFiles | None = None) -> ModelRunner:
    """A runner on the fixture's folder, or on `files` (the same weights in another format)."""
    setup_mindspore()
    files = files or ModelFiles("hf", FIXTURES / folder)
    dtype, _, group = dtype.partition(":")  # int8:-1: per-channel int8
    cfg, weights = load_model(files, max_position=MAX_LEN, int8=dtype == "int8", blocks=dtype == "gguf")
    rc = RunnerConfig(num_blocks=1 + 4 * (MAX_LEN // BLOCK), block_size=BLOCK, max_model_len=MAX_LEN,
                      token_buckets=[4, 32] if native else [32],  # one plain graph: each takes seconds to build
                      max_running=4, native_kernels=native, model_dtype=dtype,
                      int8_group=int(group or QUANT_GROUP_SIZE))
    runner = ModelRunner(cfg, weights, rc)
    runner.warmup()
    return runner


def forced_logits(runner: ModelRunner, seqs: list[np.ndarray], prompt_lens: list[int],
                  adapters: list[int] | None = None) -> list[np.ndarray]:
    """Each sequence's logits at its last prompt token and every later one: the prompts in one step,
    then one token per sequence a step, fed from `seqs` (teacher forcing); `adapters`: each one's
    LoRA adapter (RowInput.adapter)."""
    arena = Arena.private(ArenaSpec(256, max(8, len(seqs)), MAX_LEN // BLOCK + 1))
    tables = [list(range(1 + i * (MAX_LEN // BLOCK), 1 + (i + 1) * (MAX_LEN // BLOCK))) for i in range(len(seqs))]
    got: list[list[np.ndarray]] = [[] for _ in seqs]
    fed = [0] * len(seqs)
    upto = list(prompt_lens)
    while any(u <= len(s) for u, s in zip(upto, seqs)):
        live = [i for i, s in enumerate(seqs) if upto[i] <= len(s)]
        rows = [RowInput(i, np.asarray(seqs[i][fed[i]:upto[i]], np.int32), fed[i], tables[i], True,
                         SamplingParams(), prompt_lens[i], upto[i] - prompt_lens[i],
                         adapter=adapters[i] if adapters else 0) for i in live]
        logits, _ = runner.forward(arena.step(arena.write_step(rows, BLOCK)).inputs)
        for k, i in enumerate(live):
            got[i].append(logits[k].copy())
            fed[i], upto[i] = upto[i], upto[i] + 1
    return [np.stack(g) for g in got]


LORA = ROOT / "tests" / "fixtures" / "lora"
ADAPTERS = ("qv8", "all16")


def lora_runner(base: str, native: bool, slots: int = 3, dtype: str = "float32", tp: Group = Group()) -> ModelRunner:
    """The fixture base with both adapters in slots 0 and 1 (slot 2 left empty); `tp`: as this rank
    of a tensor-parallel group (tests/agent/test_tensor_parallel.py)."""
    setup_mindspore()
    cfg, weights = load_model(ModelFiles("hf", FIXTURES / base), max_position=MAX_LEN, int8=dtype == "int8")
    adapters = [read_adapter(name, LORA / base / name, cfg, 16) for name in ADAPTERS]
    n_seqs = 12
    rc = RunnerConfig(num_blocks=1 + n_seqs * (MAX_LEN // BLOCK), block_size=BLOCK, max_model_len=MAX_LEN,
                      token_buckets=[16, 128] if native else [128], max_running=n_seqs, native_kernels=native,
                      model_dtype=dtype, lora=(slots, 16), tp=tp)
    runner = ModelRunner(cfg, weights, rc, lora=LoraSlots(adapters, slots, 16))
    runner.warmup()
    return runner


def lora_golden(base: str, name: str) -> list[tuple[np.ndarray, np.ndarray]]:
    z = np.load(LORA / base / f"{name}.npz")
    return [(z[f"ids{i}"], z[f"logits{i}"]) for i in range(len(z.files) // 2)]
