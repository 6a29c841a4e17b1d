"""What the pickle of a ``torch.save`` file costs to unpickle, with torch and without it, warm, in one process.

    python scripts/unpickle_cost.py SRC.pt [--rounds 5]

Alternating, ``rounds`` times, the cyclic garbage collector paused in both (as `fsdp_restore.convert.load_pt`
pauses it): ``load_pt`` (torch's weights-only unpickler, with the storages and each tensor's rebuild), and Python's
own pure-Python unpickler (``pickle._Unpickler``: a dict memo, objects built in opcode order) over the same pickle
bytes with every global an inert stand-in and persistent ids returned as they are (no torch objects). The second
is a measurement only: it is not a safe loader (it accepts any global, as a stand-in) and nothing uses it.
Results are in BENCHMARKS.md ("What a conversion without torch would save").
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import io
import pickle
import statistics
import time
import zipfile
from typing import Any


class _Stub:
    """An inert stand-in for any global: calling it records its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any) -> tuple[str, tuple[Any, ...]]:
        return self.name, args


class _Inert(pickle._Unpickler):  # type: ignore[name-defined]
    def find_class(self, module: str, name: str) -> Any:
        return collections.OrderedDict if (module, name) == ("collections", "OrderedDict") else _Stub(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    convert = importlib.import_module("fsdp_restore.convert")
    with zipfile.ZipFile(args.src) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    convert.load_pt(args.src)  # warm: the page cache, first-time code paths
    with_torch, without = [], []
    for _ in range(args.rounds):
        gc.collect()
        gc.disable()
        t = time.perf_counter()
        convert.load_pt(args.src)
        with_torch.append(time.perf_counter() - t)
        t = time.perf_counter()
        _Inert(io.BytesIO(data)).load()
        without.append(time.perf_counter() - t)
        gc.enable()
    print(f"pickle {len(data) / 1e6:.2f} MB")
    for label, times in (("load_pt (torch's unpickler, storages, rebuild)", with_torch),
                         ("pickle._Unpickler, inert stand-ins", without)):
        print(f"  {label}: median {statistics.median(times):.3f} s, runs {sorted(round(x, 3) for x in times)}")


if __name__ == "__main__":
    main()
