"""Non-persistent buffers: module state that no checkpoint holds (rotary ``inv_freq``, masks, tables).

A model built on the meta device and materialized with ``to_empty`` gets *uninitialised memory* for
them, and no restore can fix that from a file. `init_non_persistent_buffers` recomputes them where
the module says how (Hugging Face rotary embeddings; any module with a ``reset_buffers()`` method);
`buffer_problems` finds the ones that are still wrong (non-finite, different from the module's own
initialisation) and fingerprints the rest so that ranks can compare them (replicated state must be
equal on every rank; uninitialised memory rarely is).
"""

from __future__ import annotations

import warnings
import zlib

import torch
from torch import nn

from .shards import _join, clean_name, ddp_prefix

FINGERPRINT_MODULUS = 1_048_573  # a prime below 2**20: sums of squares over many ranks stay within int64


def nonpersistent_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(clean name, module, attribute, tensor)`` of every non-persistent buffer, each tensor once."""
    top = ddp_prefix(model)
    seen: set[int] = set()
    out = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr in sorted(module._non_persistent_buffers_set):
            buf = module._buffers.get(attr)
            if buf is None or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((clean_name(_join(mod_name, attr).removeprefix(top)), module, attr, buf))
    return out


def _is_rotary(module: nn.Module) -> bool:
    """A Hugging Face rotary embedding (what transformers' own ``_init_weights`` recognises)."""
    return hasattr(module, "rope_type") and hasattr(module, "config") and hasattr(module, "original_inv_freq")


def _rotary_value(module: nn.Module) -> torch.Tensor | None:
    """A Hugging Face rotary embedding's ``inv_freq``, computed as its ``__init__`` does (on the CPU)."""
    if not _is_rotary(module):
        return None
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:  # pragma: no cover - transformers absent
        return None
    functions = {"default": getattr(module, "compute_default_rope_parameters", None), **ROPE_INIT_FUNCTIONS}
    fn = functions.get(module.rope_type)
    if fn is None:
        return None
    with torch.device("cpu"):
        value, _ = fn(module.config)
    return value


def expected_value(module: nn.Module, attr: str) -> torch.Tensor | None:
    """What the module's own initialisation puts into buffer ``attr``, where we know how to compute it,
    in the buffer's current dtype: computed as the module computes it, then cast, as ``model.to(dtype)``
    cast the buffer (a Llama cast with ``.to(torch.bfloat16)`` holds a bf16 ``inv_freq``)."""
    value = _rotary_value(module) if attr in ("inv_freq", "original_inv_freq") else None
    current = getattr(module, attr, None)  # a registered buffer, or transformers' plain-attribute copy
    if value is not None and isinstance(current, torch.Tensor) and current.dtype != value.dtype:
        value = value.to(current.dtype)
    return value


def _tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the comparison with `expected_value`: 1e-5 in fp32 (the module may compute on
    another device, whose ``pow`` differs in the last bits), one unit in the last place of a lower
    precision (a last-bit difference in fp32 may round to the neighbouring bf16 / fp16 value)."""
    return max(1e-5, torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def init_non_persistent_buffers(model: nn.Module) -> list[str]:
    """Recompute the non-persistent buffers that the module knows how to initialise (call after
    ``to_empty``, before or after restoring): Hugging Face rotary embeddings (``inv_freq``,
    ``original_inv_freq``) and any module with a ``reset_buffers()`` method. Returns the names of the
    buffers it set; any other non-persistent buffer keeps its values, with a warning naming it: after
    ``to_empty`` it holds leftover memory, which the restore's check tells from a real value only where it is
    NaN or inf or differs between ranks (`buffer_problems`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_non_persistent_buffers takes the model (a torch.nn.Module), not {type(model).__name__}")
    done: list[str] = []
    unknown: list[str] = []
    reset: set[int] = set()
    with torch.no_grad():
        for name, module, attr, buf in nonpersistent_buffers(model):
            if id(module) not in reset and callable(getattr(module, "reset_buffers", None)):
                module.reset_buffers()
                reset.add(id(module))
                done.append(name)
                continue
            if id(module) in reset:
                done.append(name)
                continue
            value = expected_value(module, attr)  # in the buffer's dtype: the copy changes no dtype
            if value is not None and value.shape == buf.shape:
                buf.copy_(value)
                done.append(name)
            elif not buf.is_meta and buf.numel():
                unknown.append(name)
        for module in model.modules():  # transformers keeps a plain-attribute copy too
            if _is_rotary(module) and isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
                if module.original_inv_freq.is_meta:
                    module.original_inv_freq = module.inv_freq.clone()
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        warnings.warn(f"init_non_persistent_buffers: no initialisation known for the non-persistent buffer(s) {shown},"
                      " which no checkpoint holds: after to_empty they hold leftover memory, which the restore's check"
                      " cannot tell from a real value unless it is NaN or inf or differs between ranks; give their"
                      " module a reset_buffers() method (then this sets them), or set them yourself", stacklevel=2)
    return done


def fingerprint(t: torch.Tensor) -> int:
    """crc32 of the tensor's bytes modulo `FINGERPRINT_MODULUS`: equal tensors print alike on every rank."""
    data = t.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy()  # (no copy of the bytes in Python)
    return zlib.crc32(data) % FINGERPRINT_MODULUS


def buffer_problems(model: nn.Module) -> tuple[list[str], list[tuple[str, int]]]:
    """(problems, fingerprints) of the non-persistent buffers on this rank: a buffer holding NaN/inf,
    or differing from its module's own initialisation, is a problem; the fingerprints (name, crc32
    modulo `FINGERPRINT_MODULUS`) let the ranks find buffers that differ between them."""
    problems: list[str] = []
    prints: list[tuple[str, int]] = []
    for name, module, attr, buf in nonpersistent_buffers(model):
        if buf.is_meta or buf.numel() == 0:
            continue
        # (float8: torch has no isfinite for most of them; their values hold exactly in fp32)
        if buf.is_floating_point() and not bool(torch.isfinite(buf.float() if buf.element_size() == 1 else buf).all()):
            problems.append(f"{name} holds NaN or inf")
        else:
            expected = expected_value(module, attr)
            if expected is not None and (expected.shape != buf.shape or not torch.allclose(
                    buf.detach().float().cpu(), expected.float(), rtol=_tolerance(buf.dtype), atol=0)):
                problems.append(f"{name} differs from its module's own initialisation")
        prints.append((name, fingerprint(buf)))
    return problems, prints
