"""The ``fsdp-restore`` command line: convert, verify, inspect, check-restore.

Options come, lowest precedence first, from the built-in defaults (mirrored in
``configs/convert.yaml``), a ``--config FILE``, the flags, then ``key=value`` overrides. Errors
print one line and exit non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table
from rich.text import Text

from .errors import FsdpRestoreError

CONVERT_DEFAULTS: dict[str, Any] = {
    "dtype": None,  # bf16 | fp16 | fp32: cast the model's floating weights
    "cast_include": None,  # key patterns (fnmatch) the cast applies to; default: the model's weights
    "cast_exclude": [],  # key patterns kept in their dtype
    "max_shard_size": None,  # e.g. 5GB: write a directory of shards plus an index json
    "select": None,  # e.g. model: write only this subtree, with plain keys
    "threads": None,  # default: every core
    "force": False,  # replace an existing destination
    "trust_pickle": False,  # run arbitrary pickle code in the source (only for files you trust)
    "allow_globals": [],  # extra data-only classes the safe unpickler may build, "module.Name"
    "on_unsupported": "error",  # error | skip (drop unsupported values with a warning)
    "tag": None,  # a DeepSpeed checkpoint directory's tag (default: the one 'latest' names)
}

err = Console(stderr=True)
out = Console()


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def build_config(defaults: dict[str, Any], config_file: str | None, flags: dict[str, Any],
                 overrides: Sequence[str]) -> DictConfig:
    """Merge defaults < --config file < flags < key=value overrides; unknown keys are errors."""
    cfg = OmegaConf.create(defaults)
    OmegaConf.set_struct(cfg, True)
    layers = []
    if config_file:
        layers.append(OmegaConf.load(config_file))
    layers.append(OmegaConf.create({k: v for k, v in flags.items() if v is not None}))
    layers.append(OmegaConf.from_dotlist(list(overrides)))
    for layer in layers:
        unknown = set(layer.keys()) - set(defaults)
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(sorted(map(str, unknown)))}; known: {', '.join(defaults)}")
        cfg = OmegaConf.merge(cfg, layer)
    return cfg


def _progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err, transient=False, disable=not err.is_terminal)


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert

    flags = {"dtype": args.dtype, "max_shard_size": args.max_shard_size, "select": args.select, "tag": args.tag,
             "threads": args.threads, "force": True if args.force else None,
             "trust_pickle": True if args.trust_pickle else None,
             "allow_globals": args.allow_global or None}
    cfg = OmegaConf.to_container(build_config(CONVERT_DEFAULTS, args.config, flags, args.overrides))
    assert isinstance(cfg, dict)
    with _progress() as progress:
        task = progress.add_task("convert", total=None)

        def on_progress(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        report = convert(args.src, args.dst, progress=on_progress, **cfg)
    table = Table(title=f"converted {args.src} -> {args.dst}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for name, value in [("tensors", str(report.tensors)), ("tensor bytes", human_bytes(report.nbytes)),
                        ("tensors cast", str(report.cast_tensors)), ("files", str(len(report.files))),
                        ("seconds", f"{report.seconds:.2f}"), ("throughput", human_bytes(report.throughput) + "/s"),
                        ("peak anonymous memory", human_bytes(report.peak_anon_bytes)),
                        ("threads", str(report.threads))]:
        table.add_row(name, value)
    for group, info in report.cast.items():
        out.print(f"cast: {group}: {info['tensors']} tensors ("
                  + ", ".join(f"{n} {label}" for label, n in info["casts"].items()) + ")")
    out.print(table)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .verify import inspect_checkpoint, render_inspect

    info = inspect_checkpoint(args.path)
    if args.json:
        import json

        print(json.dumps(info, indent=2))
    else:
        render_inspect(info, out, max_depth=args.depth)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import render_verify, verify

    with _progress() as progress:
        task = progress.add_task("verify", total=None)
        report = verify(args.path, against=args.against, select=args.select, threads=args.threads,
                        trust_pickle=args.trust_pickle, progress=lambda d, t: progress.update(task, completed=d, total=t))
    render_verify(report, out)
    return report.exit_code


def cmd_check_restore(args: argparse.Namespace) -> int:
    from .check_restore import run_check_restore

    with err.status(f"restoring on {args.nproc} ranks..."):
        report = run_check_restore(args.path, args.model, nproc=args.nproc, fsdp=args.fsdp, prefix=args.prefix,
                                   key_map=args.key_map)
    out.print(report.summary())
    return 0 if report.ok else 1


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-restore", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="stream a torch.save .pt file, a DeepSpeed ZeRO or a DCP checkpoint"
                                       " directory into safetensors")
    p.add_argument("src", help="a torch.save file, a DeepSpeed checkpoint directory (ZeRO 1-3) or a DCP directory")
    p.add_argument("dst", help="a .safetensors file, or a directory with --max-shard-size")
    p.add_argument("--config", help="YAML options file (see configs/convert.yaml)")
    p.add_argument("--dtype", help="cast the model's floating weights: bf16, fp16 or fp32 (optimizer state and"
                                   " scalars keep theirs unless cast_include names them)")
    p.add_argument("--max-shard-size", help="e.g. 5GB: write shards plus model.safetensors.index.json")
    p.add_argument("--select", help="only this subtree, e.g. model")
    p.add_argument("--tag", help="DeepSpeed checkpoint tag to convert, e.g. global_step1000 (default: latest)")
    p.add_argument("--threads", type=int)
    p.add_argument("--force", action="store_true", help="replace an existing destination")
    p.add_argument("--trust-pickle", action="store_true", help="execute the file's pickle (trusted files only)")
    p.add_argument("--allow-global", action="append", metavar="MODULE.NAME",
                   help="let the safe unpickler build this data-only class")
    p.epilog = "Any option of configs/convert.yaml can also be given as key=value, e.g. cast_exclude=[optim.*]"
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="show what a checkpoint holds")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.add_argument("--depth", type=int, default=3, help="tree depth shown (totals include everything below)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check a converted checkpoint (checksums; --against the source .pt)",
                       description="Exit 0: identical (bit for bit, or every checksum verified) or identical up to"
                                   " the casts the file declares; 1: a problem; 3: only the header could be"
                                   " checked (no checksums, no --against)")
    p.add_argument("path")
    p.add_argument("--against", help="the source (.pt, DeepSpeed or DCP directory): compare every tensor")
    p.add_argument("--select", help="the subtree of the source that was converted (convert --select)")
    p.add_argument("--threads", type=int)
    p.add_argument("--trust-pickle", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("check-restore", help="restore into your sharded model on N local ranks and check it")
    p.add_argument("path")
    p.add_argument("--model", required=True, metavar="MODULE:FUNCTION",
                   help="a function returning the (unsharded) model, e.g. mypkg.models:build or train.py:build")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--fsdp", choices=["fsdp2", "fsdp1"], default="fsdp2")
    p.add_argument("--prefix", default=None, help="subtree holding the weights (default: model, or '' for plain files)")
    p.add_argument("--key-map", metavar="FILE|MODULE:ATTR", help="the checkpoint's name of each model name: a JSON/YAML"
                   " list of [regex, replacement] pairs or mapping, or a Python callable/dict/list")
    p.set_defaults(func=cmd_check_restore)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may sit anywhere among the flags (argparse cannot interleave them).
    args.overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    unknown = [a for a in extra if a not in args.overrides]
    if unknown or (args.overrides and args.command != "convert"):
        parser.error(f"unrecognized arguments: {' '.join(unknown or args.overrides)}")
    warnings.simplefilter("default")
    warnings.showwarning = lambda msg, cat, *a, **k: err.print(f"[yellow]warning:[/] {msg}")
    try:
        return args.func(args)
    except (FsdpRestoreError, FileExistsError, FileNotFoundError, KeyError, ValueError, OSError) as e:
        if args.debug:
            raise
        text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        err.print(Text.assemble(("error: ", "bold red"), str(text)), highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        err.print("[red]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
