"""The ``fsdp-restore`` command line: convert, verify, inspect, check-restore.

Options come, lowest precedence first, from the built-in defaults (mirrored in
``configs/convert.yaml``), a ``--config FILE``, the flags, then ``key=value`` overrides. Every option
is checked at the door (type and range, `check_convert_options`), before anything is read or written.
Errors print one line and exit non-zero (usage errors, a bad option value or config file included: 2;
everything else: 1); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table
from rich.text import Text

from .errors import FsdpRestoreError
from .import_clock import timing_import

CONVERT_DEFAULTS: dict[str, Any] = {
    "dtype": None,  # bf16 | fp16 | fp32 | fp64: cast the model's floating weights
    "cast_include": None,  # key patterns (fnmatch) the cast applies to; default: the model's weights
    "cast_exclude": [],  # key patterns kept in their dtype
    "max_shard_size": None,  # e.g. 5GB: write a directory of shards plus an index json
    "select": None,  # e.g. model: write only this subtree, with plain keys
    "thread_count": None,  # default: every core, at least 4 (they mostly wait on the disk)
    "force": False,  # replace an existing destination
    "verify_checksums": False,  # also check the source's crc32s where that costs a pass (casts, partial views)
    "trust_pickle": False,  # run arbitrary pickle code in the source (only for files you trust)
    "allow_globals": [],  # extra data-only classes the safe unpickler may build, "module.Name"
    "on_unsupported": "error",  # error | skip (drop unsupported values with a warning)
    "tag": None,  # a DeepSpeed checkpoint directory's tag (default: the one 'latest' names)
}


def _drop_output(stream: Any) -> None:
    """Send what is still written to ``stream`` nowhere: its reader closed the pipe (``| head``) and has all it
    wanted; the command goes on and exits as it would have (rich's default, and Python's own, exit with 1)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        self.quiet = True
        _drop_output(self.file)


err = _Console(stderr=True)
out = _Console()


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


class OptionError(ValueError):
    """A command-line option, config file or override that is malformed or out of range (one line)."""


def _yaml_problem(e: yaml.YAMLError, where: bool = True) -> str:
    """A YAML error on one line: what is wrong and (in a file) where; PyYAML's text spans several lines."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = (e.problem_mark or e.context_mark) if where else None
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"{e.problem or e.context or 'invalid YAML'}{at}"
    return str(e).replace("\n", " ")


def _load_layer(source: str, load: Callable[[], Any], known: Sequence[str], in_file: bool = False) -> DictConfig:
    """One layer of options, refused in one line naming ``source`` when it is not YAML, not a mapping of
    options, or names an unknown option."""
    try:
        layer = load()
    except FileNotFoundError:
        raise OptionError(f"{source}: no such file") from None
    except OSError as e:  # a directory, no permission: the file cannot be read
        raise OptionError(f"{source}: cannot read it ({e.strerror or e}); give a YAML file of option: value") from None
    except yaml.YAMLError as e:
        raise OptionError(f"{source}: not valid YAML ({_yaml_problem(e, in_file)}); fix the syntax, e.g."
                          " cast_exclude=[optim.*] or thread_count: 4") from None
    except (OmegaConfBaseException, UnicodeDecodeError) as e:
        raise OptionError(f"{source}: {str(e).splitlines()[0]}") from None
    if layer is None:  # an empty file
        return OmegaConf.create({})
    if not isinstance(layer, DictConfig):
        raise OptionError(f"{source}: must be a mapping of option: value (see configs/convert.yaml), not a"
                          f" {type(layer).__name__.removesuffix('Config').lower()}")
    layer = _renamed_options(source, layer, known)
    unknown = set(layer.keys()) - set(known)
    if unknown:
        raise OptionError(f"{source}: unknown option(s) {', '.join(sorted(map(str, unknown)))}; known: {', '.join(known)}")
    return layer


_RENAMED = {"threads": "thread_count"}  # an option's old name -> its name: still accepted, with a warning


def _renamed_options(source: str, layer: DictConfig, known: Sequence[str]) -> DictConfig:
    """A layer with each option given by its old name (`_RENAMED`) under its new one, with a deprecation
    warning; both names in one layer are refused. Values are moved unresolved (interpolations included)."""
    old = [str(k) for k in layer.keys() if str(k) in _RENAMED and _RENAMED[str(k)] in known]
    if not old:
        return layer
    items = OmegaConf.to_container(layer, resolve=False)
    assert isinstance(items, dict)
    for key in old:
        new = _RENAMED[key]
        if new in items:
            raise OptionError(f"{source}: both {key} and {new}; {key} is the old name of {new}: give {new} only")
        warnings.warn(f"{source}: {key} is renamed {new} ({key} will be removed in the next release)",
                      DeprecationWarning, stacklevel=2)
    return OmegaConf.create({(_RENAMED[k] if k in old else k): v for k, v in items.items()})


_FLAGS = {"allow_globals": "--allow-global"}  # the flags whose name is not the option's


def _config_layers(defaults: dict[str, Any], config_file: str | None, flags: dict[str, Any],
                   overrides: Sequence[str]) -> list[tuple[str, DictConfig]]:
    """(source, options) of every layer above the defaults, lowest precedence first."""
    layers = []
    if config_file:
        layers.append((f"--config {config_file}", _load_layer(f"--config {config_file}",
                                                                lambda: OmegaConf.load(config_file), list(defaults),
                                                                in_file=True)))
    for key, value in flags.items():  # one layer per flag, so that an error names the flag
        if value is not None:
            layers.append((_FLAGS.get(key, "--" + key.replace("_", "-")), OmegaConf.create({key: value})))
    for item in overrides:  # one at a time, so that an error names the override at fault
        layers.append((f"override '{item}'", _load_layer(f"override '{item}'", lambda: OmegaConf.from_dotlist([item]),
                                                         list(defaults))))
    return layers


def _merge(defaults: dict[str, Any], layers: list[tuple[str, DictConfig]]) -> DictConfig:
    """Each layer's values replace the lower ones key by key (a list replaces a list, as OmegaConf.merge
    does). Not OmegaConf.merge itself: it refuses a value of another type than the default's (a mapping
    for a list) with a TypeError that names neither the option nor the layer; `check_convert_options`
    judges the types instead. Interpolations (${...}) stay unresolved until the values are read."""
    merged = dict(defaults)
    for _, layer in layers:
        merged.update(OmegaConf.to_container(layer, resolve=False))  # type: ignore[arg-type]
    cfg = OmegaConf.create(merged)
    OmegaConf.set_struct(cfg, True)
    return cfg


def build_config(defaults: dict[str, Any], config_file: str | None, flags: dict[str, Any],
                 overrides: Sequence[str]) -> DictConfig:
    """Merge defaults < --config file < flags < key=value overrides; unknown keys are errors."""
    return _merge(defaults, _config_layers(defaults, config_file, flags, overrides))


def convert_options(config_file: str | None, flags: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """The options of a conversion as plain values, every one checked (`check_convert_options`); an error
    names the layer that set the bad value (--config FILE, a flag, an override)."""
    return check_convert_options(*_convert_values(config_file, flags, overrides))


def _convert_values(config_file: str | None, flags: dict[str, Any], overrides: Sequence[str]
                    ) -> tuple[dict[str, Any], dict[str, str]]:
    """The options of a conversion, merged and resolved but not checked, and where each was set."""
    layers = _config_layers(CONVERT_DEFAULTS, config_file, flags, overrides)
    origin = {key: "the defaults" for key in CONVERT_DEFAULTS}
    for source, layer in layers:
        origin.update({str(key): source for key in layer.keys()})
    cfg = _merge(CONVERT_DEFAULTS, layers)
    values: dict[str, Any] = {}
    for key in CONVERT_DEFAULTS:
        try:  # an interpolation (${...}) is resolved here, and may point nowhere
            values[key] = _resolved(cfg, key)
        except OmegaConfBaseException as e:
            raise OptionError(f"{origin[key]}: {key}: {str(e).splitlines()[0]}") from None
    return values, origin


def _resolved(cfg: DictConfig, key: str) -> Any:
    node = cfg[key]
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


_SIZE_HINT = "a size such as 5GB, 512MiB or a number of bytes >= 1"


def _patterns(key: str, value: Any, *, allow_null: bool) -> list[str] | None:
    """A list of key patterns; one pattern alone (``cast_exclude=optim.*``) is a list of one, not of its
    characters; bare numbers (``cast_include=[0]``, a list index) are patterns too."""
    if value is None:
        return None if allow_null else []
    items = [value] if isinstance(value, (str, int)) and not isinstance(value, bool) else value
    if not isinstance(items, list) or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in items):
        raise OptionError(f"{key}: expected a list of key patterns such as [optim.*, model.lm_head.*], got {value!r}")
    return [str(p) for p in items]


def _scalar_text(key: str, value: Any, example: str) -> str | None:
    """null or one name (a bare number is a name: tag=1000, select=0)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
        raise OptionError(f"{key}: expected one name such as {example} (or null), got {value!r}")
    return str(value)


def check_convert_options(values: dict[str, Any], origin: dict[str, str] | None = None) -> dict[str, Any]:
    """Every convert option checked for type and range, normalized (sizes in bytes, one pattern -> a list
    of one): `OptionError` naming the option, the value, where it was set and what it takes. Checked here
    so that a bad value fails before anything is read, not as a TypeError deep in the conversion, and so
    that a wrong one (``max_shard_size=-5``, ``thread_count=0``) is never silently taken for a default."""
    out = dict(values)

    def fail(key: str, text: str) -> NoReturn:
        where = f" ({origin[key]})" if origin and key in origin and origin[key] != "the defaults" else ""
        raise OptionError(f"{key}={values[key]!r}{where}: {text}")

    def check(key: str, fn: Callable[[], Any]) -> None:
        try:
            out[key] = fn()
        except OptionError as e:
            fail(key, str(e).removeprefix(f"{key}: "))

    count = values.get("thread_count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        fail("thread_count", "expected a whole number >= 1 (or null: every core, at least 4)")
    size = values.get("max_shard_size")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, (int, str)):
            fail("max_shard_size", f"expected {_SIZE_HINT} (or null: one file)")
        from .jobs import parse_size  # the parser convert itself uses

        try:
            parsed = parse_size(size)
        except ValueError:
            fail("max_shard_size", f"expected {_SIZE_HINT} (or null: one file)")
        if parsed is None or parsed < 1:
            fail("max_shard_size", f"expected {_SIZE_HINT} (or null: one file)")
        out["max_shard_size"] = parsed
    for key in ("force", "trust_pickle", "verify_checksums"):
        if not isinstance(values.get(key), bool):
            fail(key, "expected true or false")
    if values.get("on_unsupported") not in ("error", "skip"):
        fail("on_unsupported", "expected error (refuse the file) or skip (drop such values with a warning)")
    check("cast_include", lambda: _patterns("cast_include", values.get("cast_include"), allow_null=True))
    check("cast_exclude", lambda: _patterns("cast_exclude", values.get("cast_exclude"), allow_null=False))
    check("allow_globals", lambda: _patterns("allow_globals", values.get("allow_globals"), allow_null=False))
    if any("." not in name.strip(".") for name in out["allow_globals"] or []):
        fail("allow_globals", "expected a list of classes as module.Name, e.g. [argparse.Namespace]")
    check("select", lambda: _scalar_text("select", values.get("select"), "model"))
    check("tag", lambda: _scalar_text("tag", values.get("tag"), "global_step1000"))
    check("dtype", lambda: _scalar_text("dtype", values.get("dtype"), "bf16"))
    if out["dtype"] is not None:
        from .jobs import cast_target  # convert's own rule: floating targets only

        try:
            cast_target(out["dtype"])
        except (ValueError, TypeError) as e:
            fail("dtype", str(e))
    return out


def _progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err, transient=False, disable=not err.is_terminal)


def cmd_convert(args: argparse.Namespace) -> int:
    from .prefetch import start_prefetch

    flags = {"dtype": args.dtype, "max_shard_size": args.max_shard_size, "select": args.select, "tag": args.tag,
             "thread_count": args.thread_count, "force": True if args.force else None,
             "verify_checksums": True if args.verify_checksums else None,
             "trust_pickle": True if args.trust_pickle else None,
             "allow_globals": args.allow_global or None}
    values, origin = _convert_values(args.config, flags, args.overrides)
    text = {key: value if isinstance(value, str) else None for key, value in values.items()}
    ranks = args.ranks  # --ranks (under torchrun): convert on every rank together
    if ranks and not all(os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        raise OptionError("--ranks: run under torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT),"
                          " e.g. torchrun --nproc-per-node 2 -m fsdp_restore convert SRC DST --ranks")
    if not ranks:  # (each rank reads only its blocks' bytes: no rank reads the whole source ahead)
        start_prefetch(args.src, select=text["select"], tag=text["tag"])  # the disk reads while torch is imported
    with timing_import("torch") as torch_import:  # wherever the command first needs it
        started = time.perf_counter()  # checking --dtype or --max-shard-size may be what imports torch first
        cfg = check_convert_options(values, origin)
        from .convert import convert  # the first command to need torch imports it here: timed apart from the work

        imports = time.perf_counter() - started
        counted = torch_import.seconds  # torch's import so far, if any, is in `imports`
        if ranks:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")  # torchrun's environment
            cfg["process_group"] = dist.group.WORLD
            if dist.get_rank() != 0:  # rank 0 reports; every rank raises the same error if any fails
                convert(args.src, args.dst, **cfg)
                return 0
        with _progress() as progress:
            task = progress.add_task("convert", total=None)

            def on_progress(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            before, started = torch_import.seconds, time.perf_counter()  # (--ranks imported it just above)
            report = convert(args.src, args.dst, progress=on_progress, **cfg)
            whole = time.perf_counter() - started
    # a conversion that reads or casts what the torch-free path leaves to torch imports it within the call: that
    # import is the command's first-use cost, reported with the imports, not as conversion time (its whole wall
    # time: where it runs on one write thread, the others' work meanwhile is not counted either)
    within = torch_import.seconds - before
    imports += torch_import.seconds - counted
    seconds = max(whole - within, 1e-9)
    out.print(f"converted {args.src} -> {args.dst}", highlight=False, soft_wrap=True)  # whole paths, unwrapped
    table = Table()
    table.add_column("what")
    table.add_column("value", justify="right")
    for name, value in [("tensors", str(report.tensors)), ("tensor bytes", human_bytes(report.nbytes)),
                        ("tensors cast", str(report.cast_tensors)), ("files", str(len(report.files))),
                        ("seconds", f"{seconds:.2f}"), ("throughput", human_bytes(report.nbytes / seconds) + "/s"),
                        ("importing libraries (torch...), not in seconds", f"{imports:.2f} s"),
                        ("peak anonymous memory", human_bytes(report.peak_anon_bytes)),
                        ("threads", str(report.threads))]:
        table.add_row(name, value)
    rest = None
    if os.path.isfile(args.src) or report.source_crcs is not None:  # (of a directory: a ZeRO checkpoint's files)
        from .source_crc import describe, describe_rest

        table.add_row("source crc32s checked", describe(report.source_crcs))
        rest = describe_rest(report.source_crcs)
    for group, info in report.cast.items():
        out.print(f"cast: {group}: {info['tensors']} tensors ("
                  + ", ".join(f"{n} {label}" for label, n in info["casts"].items()) + ")")
    if rest:
        out.print(rest, highlight=False, soft_wrap=True)
    out.print(table)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .verify import inspect_checkpoint, render_inspect

    _must_exist(args.path)
    info = inspect_checkpoint(args.path)
    if args.json:
        import json

        try:
            print(json.dumps(info, indent=2), flush=True)
        except BrokenPipeError:
            _drop_output(sys.stdout)
    else:
        render_inspect(info, out, max_depth=args.depth)
    return 0


def _must_exist(path: str, option: str = "") -> None:
    """A missing input is one line before any work starts (verify would report it in its table)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{option + ' ' if option else ''}{path}: no such file or directory")


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import render_verify, verify

    _must_exist(args.path)
    if args.against:
        _must_exist(args.against, "--against")
    with _progress() as progress:
        task = progress.add_task("verify", total=None)
        report = verify(args.path, against=args.against, select=args.select, thread_count=args.thread_count,
                        trust_pickle=args.trust_pickle, tag=args.tag, allow_globals=args.allow_global or (),
                        progress=lambda d, t: progress.update(task, completed=d, total=t))
    render_verify(report, out)
    return report.exit_code


def cmd_check_restore(args: argparse.Namespace) -> int:
    from .check_restore import run_check_restore

    with err.status(f"restoring on {args.nproc} ranks..."):
        try:
            report = run_check_restore(args.path, args.model, nproc=args.nproc, fsdp=args.fsdp,
                                       model_prefix=args.model_prefix, key_map=args.key_map, strict=args.strict)
        except ValueError as e:  # checked before any rank starts: --model, --key-map, --nproc (a usage error)
            raise OptionError(str(e)) from None
    out.print(report.summary(), highlight=False, soft_wrap=True)  # its lines as they are: piped, not cut at 80
    return 0 if report.ok else 1


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (its own print the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low`` (argparse names the option when it is not)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got '{text}'") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {value}")
        return value
    return parse


class _RenamedFlag(argparse.Action):
    """One option with a new and an old name (the old one hidden from --help, with a deprecation warning):
    giving both is a usage error, as in the Python API; the same name twice keeps the last."""

    def __init__(self, *args: Any, old: str, new: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.old, self.new = old, new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string == self.old:
            warnings.warn(f"{self.old} is renamed {self.new} ({self.old} will be removed in the next release)",
                          DeprecationWarning, stacklevel=2)
        given = f"_{self.dest}_flag"
        if getattr(namespace, given, None) not in (None, option_string):
            parser.error(f"{self.old} and {self.new} name one option: give it once (as {self.new})")
        setattr(namespace, given, option_string)
        setattr(namespace, self.dest, values)


def _thread_count_flags(p: argparse.ArgumentParser, help: str) -> None:
    """--thread-count, and --threads (its old name: hidden, deprecated), both setting ``thread_count``."""
    names = {"old": "--threads", "new": "--thread-count"}
    p.add_argument("--thread-count", type=_int_at_least(1), metavar="N", help=help, action=_RenamedFlag, **names)
    p.add_argument("--threads", dest="thread_count", type=_int_at_least(1), action=_RenamedFlag,
                   help=argparse.SUPPRESS, **names)


def _version() -> str:
    """The installed distribution's version, else the package's (a source tree run without installing)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fsdp_restore")
    except PackageNotFoundError:
        from . import __version__

        return __version__


class _VersionFlag(argparse.Action):
    """``--version``, the version looked up only when asked for: `importlib.metadata` costs every other command a
    few tens of milliseconds of imports (BENCHMARKS.md, "Session 22")."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog} {_version()}")  # on stdout, as argparse's own version action
        parser.exit()


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fsdp-restore", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action=_VersionFlag, help="show the program's version number and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    # --debug also after the command (a flag typed last); SUPPRESS: a command without it keeps the top level's
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")

    p = sub.add_parser("convert", parents=[debug],
                       help="stream a torch.save .pt file, a DeepSpeed ZeRO or a DCP checkpoint"
                                       " directory into safetensors")
    p.add_argument("src", help="a torch.save file, a DeepSpeed checkpoint directory (ZeRO 1-3) or a DCP directory")
    p.add_argument("dst", help="a .safetensors file, or a directory with --max-shard-size")
    p.add_argument("--config", help="YAML options file (see configs/convert.yaml)")
    p.add_argument("--dtype", help="cast the model's floating weights: bf16, fp16, fp32 or fp64 (optimizer state and"
                                   " scalars keep theirs unless cast_include names them)")
    p.add_argument("--max-shard-size", help="e.g. 5GB: write shards plus model.safetensors.index.json")
    p.add_argument("--select", help="only this subtree, e.g. model")
    p.add_argument("--tag", help="DeepSpeed checkpoint tag to convert, e.g. global_step1000 (default: latest)")
    _thread_count_flags(p, "read/write threads (default: one per core, at least 4, at most 16)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing checkpoint at dst (never the source, nor a directory of other files)")
    p.add_argument("--ranks", action="store_true",
                   help="under torchrun: every rank writes its share of the one output (for several nodes)")
    p.add_argument("--trust-pickle", action="store_true", help="execute the file's pickle (trusted files only)")
    p.add_argument("--verify-checksums", action="store_true",
                   help="also check the source's recorded crc32s where that costs a pass over its bytes (tensors"
                        " cast, views of part of a storage, a ZeRO checkpoint's partitions); those the output"
                        " holds unchanged are always checked")
    p.add_argument("--allow-global", action="append", metavar="MODULE.NAME",
                   help="let the safe unpickler build this data-only class")
    p.epilog = "Any option of configs/convert.yaml can also be given as key=value, e.g. cast_exclude=[optim.*]"
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", parents=[debug], help="show what a checkpoint holds")
    p.add_argument("path", help="a .safetensors file, a sharded directory or its index json, or a torch.save file"
                                " (read by torch's weights-only unpickler, nothing of it run)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a tree")
    p.add_argument("--depth", type=_int_at_least(0), default=3,
                   help="tree depth shown (default: 3; totals include everything below)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", parents=[debug],
                       help="check a converted checkpoint (checksums; --against the source .pt)",
                       description="Exit 0: identical (bit for bit, or every checksum verified) or identical up to"
                                   " the casts the file declares; 1: a problem; 3: only the header could be"
                                   " checked (no checksums, no --against)")
    p.add_argument("path", help="the checkpoint to check: a .safetensors file, a sharded directory or its index json")
    p.add_argument("--against", help="the source (.pt, DeepSpeed or DCP directory): compare every tensor")
    p.add_argument("--select", help="the subtree of the source that was converted (convert --select)")
    p.add_argument("--tag", help="a DeepSpeed source's tag, as given to convert (default: the one 'latest' names)")
    _thread_count_flags(p, "checksum/compare threads (default: every core)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="load --against with the full unpickler, executing its pickle (trusted files only)")
    p.add_argument("--allow-global", action="append", metavar="MODULE.NAME",
                   help="let the safe unpickler build this data-only class of --against, as given to convert")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("check-restore", parents=[debug],
                       help="restore into your sharded model on N local ranks and check it")
    p.add_argument("path", help="the checkpoint to restore: a .safetensors file, a sharded directory or its index"
                                " json")
    p.add_argument("--model", required=True, metavar="MODULE:FUNCTION",
                   help="a function returning the (unsharded) model, e.g. mypkg.models:build or train.py:build")
    p.add_argument("--nproc", type=_int_at_least(1), default=2, help="local ranks (processes) to restore on"
                                                                       " (default: 2)")
    p.add_argument("--fsdp", choices=["fsdp2", "fsdp1"], default="fsdp2", help="how to shard it (default: fsdp2)")
    names = {"old": "--prefix", "new": "--model-prefix"}
    p.add_argument("--model-prefix", default=None, action=_RenamedFlag, **names,
                   help="subtree holding the weights (default: model, or '' for plain files)")
    p.add_argument("--prefix", dest="model_prefix", action=_RenamedFlag, help=argparse.SUPPRESS, **names)
    p.add_argument("--key-map", metavar="FILE|MODULE:ATTR", help="the checkpoint's name of each model name: a JSON/YAML"
                   " list of [regex, replacement] pairs or mapping, or a Python callable/dict/list")
    p.add_argument("--no-strict", dest="strict", action="store_false",
                   help="restore what the file holds of the model (a LoRA adapter's file, a partial checkpoint) and"
                        " compare that; list the model's tensors the file lacks, and the file's the model lacks")
    p.set_defaults(func=cmd_check_restore)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    warnings.simplefilter("default")  # before parsing: a deprecated flag's warning is shown
    # unwrapped, as errors are: a path cut across lines cannot be copied (and no markup is read from the message)
    warnings.showwarning = lambda msg, cat, *a, **k: err.print(Text.assemble(("warning: ", "yellow"), str(msg)),
                                                               highlight=False, soft_wrap=True)
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may sit anywhere among the flags (argparse cannot interleave them).
    args.overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    unknown = [a for a in extra if a not in args.overrides]
    if args.command == "convert":  # an override typed before SRC or DST was taken for one of them
        misplaced = [a for a in (args.src, args.dst) if a.partition("=")[0] in CONVERT_DEFAULTS and "=" in a]
        if misplaced:
            parser.exit(2, f"{parser.prog}: error: {misplaced[0]} was taken for a path: key=value overrides go after"
                           f" SRC and DST (fsdp-restore convert SRC DST {misplaced[0]})\n")
    if unknown or (args.overrides and args.command != "convert"):
        parser.exit(2, f"{parser.prog}: error: unrecognized arguments: {' '.join(unknown or args.overrides)} (see"
                       f" {parser.prog} {args.command} --help)\n")
    try:
        return args.func(args)
    except (FsdpRestoreError, FileExistsError, FileNotFoundError, KeyError, ValueError, OSError) as e:
        if args.debug:
            raise
        text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        err.print(Text.assemble(("error: ", "bold red"), str(text)), highlight=False, soft_wrap=True)
        return 2 if isinstance(e, OptionError) else 1  # a bad option value is a usage error, as argparse's are
    except KeyboardInterrupt:
        err.print("[red]interrupted[/]")
        return 130


def run() -> NoReturn:
    """The ``fsdp-restore`` command: `main`, then exit with its code. After a command that imported torch, the
    process ends without Python's teardown of the interpreter (exit handlers run and the output is flushed, then
    ``os._exit``): tearing torch's modules down takes a large part of a short command's time (BENCHMARKS.md),
    and a command has fsynced, closed and renamed everything it writes before it returns."""
    code = main()
    if "torch" not in sys.modules:
        sys.exit(code)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is not None:
        run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): what was written is all the reader wanted
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
