"""Shared test helpers: exact equality of nested objects and small real checkpoints."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact equality, types included: tensors bit for bit (dtype, shape), floats incl. NaN."""
    assert type(a) is type(b), f"{path}: type {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad"
        assert torch.equal(a.detach().contiguous().view(-1).view(torch.uint8) if a.numel() else a.detach(),
                           b.detach().contiguous().view(-1).view(torch.uint8) if b.numel() else b.detach()), f"{path}: values"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), f"{path}: ndarray"
    elif isinstance(a, (dict, OrderedDict)):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for (ka, va), kb in zip(a.items(), b.keys()):
            assert type(ka) is type(kb), f"{path}: key type"
            assert_same(va, b[kb], f"{path}.{ka}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, argparse.Namespace):
        assert_same(vars(a), vars(b), path)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def tiny_gpt2(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A small GPT-2 (tied embeddings) with random init, no downloads."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = dict(vocab_size=97, n_positions=32, n_embd=24, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0)  # no dropout: resumed and uninterrupted runs must match
    cfg.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**cfg))


def tiny_llama(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=101, hidden_size=30, intermediate_size=46, num_hidden_layers=2, num_attention_heads=3,
               num_key_value_heads=1, max_position_embeddings=32)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def training_checkpoint(model: torch.nn.Module, steps: int = 2, seed: int = 0) -> dict[str, Any]:
    """Train ``model`` for a few AdamW steps and return a full training checkpoint like real runs save."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    vocab = model.config.vocab_size
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 8))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "scheduler": sched.state_dict(),
            "step": steps, "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                   "python": random.getstate()},
            "config": argparse.Namespace(lr=1e-3, name="tiny", layers=[1, 2])}


def raw_safetensors(header_json: bytes | str, data: bytes = b"") -> bytes:
    """A safetensors file from a raw header text (any JSON, valid or not), padded as the format asks."""
    text = header_json.encode() if isinstance(header_json, str) else header_json
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def torch_archive(path: Any, records: dict[str, bytes]) -> Any:
    """A zip archive at ``path`` written by torch's own writer (the one torch.save uses, so laid out exactly as
    torch.save lays out its files) holding ``records`` in order, plus what the writer adds itself (``version``,
    ``byteorder`` and ``.data/serialization_id`` where not given); the archive's folder is the file's stem."""
    writer = torch._C.PyTorchFileWriter(str(path))
    for name, data in records.items():
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    del writer  # closes the file
    return path


def archive_records(path: Any) -> dict[str, bytes]:
    """The records of a torch.save file, by name within its folder, in order (without the serialization id,
    which a writer makes anew)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return {info.filename.split("/", 1)[1]: archive.read(info) for info in archive.infolist()
                if not info.filename.endswith("/.data/serialization_id")}


@contextlib.contextmanager
def through_torch():
    """`fsdp_restore.convert` reads every source through torch's loader meanwhile, as it did before its torch-free
    reads (`plain_pt`, `zero_plain`): the path the tests of those reads compare them with."""
    module = importlib.import_module("fsdp_restore.convert")
    before, module._TORCH_FREE_READS = module._TORCH_FREE_READS, False
    try:
        yield
    finally:
        module._TORCH_FREE_READS = before


class SecondThreadGate:
    """Holds each thread's first call until a second thread makes one too (or 30 s pass), so that a test of
    work spread over threads sees at least two of them: on a busy machine one thread can otherwise take every
    piece before another starts. Call it at the top of a patched per-piece function; `reset` between runs."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._arrived = threading.Event()
        self._threads: set[int] = set()

    def __call__(self) -> None:
        import threading

        with self._lock:
            self._threads.add(threading.get_ident())
            if len(self._threads) >= 2:
                self._arrived.set()
        assert self._arrived.wait(timeout=30), "a second thread never started"

    def reset(self) -> None:
        with self._lock:
            self._threads.clear()
            self._arrived.clear()


def reading_all_but(real_read: Any, skipped: Any) -> Any:
    """A stand-in for `Checkpoint.read_contiguous` (``real_read``) that returns without writing a byte of the
    parts ``skipped(part)`` picks, and without a word of it: the other parts are read one by one, each with the
    ``pread`` it was given (the check's own, where the check is on)."""

    def read(self: Any, parts: Any, **options: Any) -> None:
        for part in parts:
            if not skipped(part):
                real_read(self, [part], **options)

    return read
