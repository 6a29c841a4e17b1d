"""Open checkpoints for reading: lazily (memory-mapped, for `load`) or by exact byte ranges (for restore).

`open_checkpoint` accepts a safetensors file (recognised by its content, whatever its name), a sharded
directory or its index json, and a ``torch.save`` file that has a ``.safetensors`` sibling (file or
directory), as OLMo does. Files we did not write (a Hugging Face ``model.safetensors`` or sharded
directory) open too, as a flat dict.

A `Checkpoint` opens each file once and reads its header and its data through that one descriptor (the
memory-mapped `load` path included), and a sharded set's index and shards through one descriptor of their
directory: a checkpoint replaced while it is read (write.py replaces by rename) is seen whole, as the
version that was opened, never as one version's header with another's tensors.

The restore path reads with ``os.preadv`` straight into the destination buffer, at offsets computed
from the header. We measured `safe_open(...).get_slice(name)[rows]` over-reading ~15x on a cold
cache (readahead around the mmap fault) and ``dcp.load`` reading the whole file on every rank;
positional reads with ``POSIX_FADV_RANDOM`` read ~1.1x the slice. Every byte read is counted.
Ranges stored back to back go in one scattering ``preadv`` (`read_contiguous`); a column block of short
rows is copied out of a mapping of its span (`read_rows`), since a system call per row costs more.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from .errors import FormatError
from .flatten import (STRUCTURE_VERSION, flat_structure, iter_nodes_with_keys, skipped_values, unflatten,
                      validate_structure)
from .format import (DEFAULT_INDEX_NAME, INDEX_SUFFIX, META_CAST, META_CHECKSUMS, META_HEADER_CRC, META_SET_ID,
                     META_SOURCE, META_STRUCTURE, MISSING, PT_SUFFIXES, SAFETENSORS, TORCH_LEGACY, TORCH_ZIP,
                     TRUNCATED_FIX, FileHeader, TensorEntry, detect, open_file, parse_json, read_header, read_index)
from .provenance import mismatch
from .screened_read import pread_all

# Rows at least this long are read with one positional read each; shorter rows (a column block of a
# wide matrix: thousands of rows of a few KiB) are copied out of a mapping of their span in one strided
# copy, because a system call per row costs more than the row (BENCHMARKS.md, "Shard(1)").
ROW_READ_MIN_BYTES = 64 * 1024
SAMPLED_PAGES = 4  # data pages per file in `Checkpoint.content_sample`: the first, the last, two between
_PAGE = 4096


_TORCH_INDEX_NAME = "pytorch_model.bin.index.json"  # transformers' index of torch.save shards


def find_safetensors_for(path: str | os.PathLike[str]) -> Path | None:
    """The checkpoint that ``path`` names in our format, or None when it is only a ``torch.save`` file.

    Decided by content (`format.detect`), never by the name: a safetensors file names itself whatever
    its suffix (``out``, ``pytorch_model.bin``); a directory or an index json names itself; a ``torch.save``
    file (zip or legacy pickle) names its sibling ``x.safetensors`` (file or sharded directory) when one
    exists. A missing path with a ``.pt``-like suffix names its sibling too; any other path names itself,
    so that the reader says precisely what is wrong with it.
    """
    path = Path(path)
    if path.name.endswith(".json"):
        return path
    kind = detect(path)
    if kind == SAFETENSORS or path.is_dir():
        return path
    if kind in (TORCH_ZIP, TORCH_LEGACY) or path.suffix in PT_SUFFIXES:
        sibling = path.with_suffix(".safetensors")
        return sibling if sibling != path and sibling.exists() else None
    return path


def stale_sibling(path: str | os.PathLike[str]) -> tuple[Path, str] | None:
    """For ``x.pt`` with an ``x.safetensors`` sibling that was not converted from ``x.pt`` as it is now:
    (the sibling, why). None otherwise (no sibling, a matching one, or a path that is not a ``.pt``)."""
    path = Path(path)
    sibling = find_safetensors_for(path)
    if sibling is None or sibling == path or not path.is_file():
        return None
    with Checkpoint(sibling) as ckpt:
        why = mismatch(ckpt.source, path, sibling, cast=ckpt.cast, skipped=ckpt.skipped_values())
    return (sibling, why) if why else None


def _converted_shards(index_path: Path, weight_map: dict[str, Path]) -> dict[Path, Path]:
    """``{torch.save shard: its converted sibling}`` for an index of ``.bin`` shards (transformers' older
    ``pytorch_model.bin.index.json``) whose shards were each converted (``x.bin`` -> ``x.safetensors``, as the
    converter's error for such an index says; a ``.bin`` that is a safetensors file is read as it is); `FormatError`
    naming the first shard not converted yet."""
    torch_shards = sorted({shard for shard in weight_map.values()
                           if shard.suffix in PT_SUFFIXES and detect(shard) in (TORCH_ZIP, TORCH_LEGACY, MISSING)})
    missing = [shard for shard in torch_shards if not shard.with_suffix(".safetensors").is_file()]
    if missing:
        raise FormatError(index_path, f"indexes torch.save shards, and {len(missing)} of {len(torch_shards)} have no"
                          f" converted sibling ({missing[0].name}{', ...' if len(missing) > 1 else ''}): convert each"
                          f" (fsdp-restore convert {missing[0]} {missing[0].with_suffix('.safetensors')}), then open"
                          " this index again")
    return {shard: shard.with_suffix(".safetensors") for shard in torch_shards}


def _torch_index(directory: Path) -> Path | None:
    """``pytorch_model.bin.index.json`` of a directory where nothing else is to be read: no ``.safetensors`` file
    but the conversions of the shards it names (a ``model.safetensors`` beside it is what to read instead)."""
    index = directory / _TORCH_INDEX_NAME
    if not index.is_file():
        return None
    try:
        _, weight_map = read_index(index)
    except FormatError:
        return index  # opened as the index it is, and said what is wrong with it
    siblings = {shard.with_suffix(".safetensors") for shard in weight_map.values()}
    # (the directory resolved, as read_index resolves the shards: "hf/" or "." finds them too; the file itself not,
    # so that a conversion linked in from elsewhere is still this directory's)
    here = directory.resolve()
    return index if all(here / f.name in siblings for f in directory.glob("*.safetensors")) else None


def _resolve_files(path: Path) -> tuple[Path | None, list[Path]]:
    """(index json or None, shard files) for a checkpoint path."""
    if path.is_dir():
        indexes = sorted(path.glob("*" + INDEX_SUFFIX))
        if (path / DEFAULT_INDEX_NAME).exists():
            indexes = [path / DEFAULT_INDEX_NAME]
        if not indexes and (torch_index := _torch_index(path)) is not None:  # shards converted one by one
            indexes = [torch_index]
        if len(indexes) == 1:
            return indexes[0], []
        if len(indexes) > 1:
            raise FormatError(path, f"several index files ({', '.join(p.name for p in indexes)}); name one")
        files = sorted(path.glob("*.safetensors"))
        if len(files) == 1:
            return None, files
        if files:  # a Hugging Face Trainer checkpoint: model.safetensors beside a converted optimizer.safetensors
            raise FormatError(path, f"directory holds no index json and several .safetensors files"
                              f" ({', '.join(p.name for p in files[:8])}{', ...' if len(files) > 8 else ''}): pass"
                              " the one to read (e.g. model.safetensors to restore_model, the optimizer's to"
                              " restore_optimizer)")
        raise FormatError(path, "directory holds no index json and no .safetensors files" + _source_hint(path))
    if path.name.endswith(".json"):
        return path, []
    if not path.exists():
        raise FormatError(path, "no such file or directory")
    return None, [path]


def _source_hint(path: Path) -> str:
    """For a directory we cannot read that `convert` can (a DeepSpeed or a DCP checkpoint): the command."""
    from .dcp_in import is_dcp_checkpoint
    from .zero_files import is_zero_checkpoint

    what = "a DeepSpeed checkpoint" if is_zero_checkpoint(path) else "a DCP checkpoint" if is_dcp_checkpoint(
        path) else None
    if what is None:
        return ""
    here = path.resolve()  # ("." and ".." name no file to write beside them)
    return f"; it is {what}: convert it first: fsdp-restore convert {path} {here.parent / (here.name + '.safetensors')}"


class Checkpoint:
    """An opened checkpoint in our format (or a plain safetensors file / Hugging Face directory).

    Attributes: ``entries`` (key -> `TensorEntry` with exact byte offsets), ``structure`` (the
    nested layout; a flat dict for files without one), ``checksums`` (key -> crc32 hex, when
    present), ``cast`` (key -> dtype name before conversion), ``bytes_read`` (bytes read by
    `read_range` so far).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        resolved = find_safetensors_for(path)
        if resolved is None:
            kind = detect(path)
            what = f"is a {kind} file, not" if kind in (TORCH_ZIP, TORCH_LEGACY) else "is not"
            sibling = Path(path).with_suffix(".safetensors")
            beside = "" if sibling.name == Path(path).name else f", and no {sibling.name} sibling exists"
            raise FormatError(path, f"{what} a safetensors checkpoint{beside}; convert it first: fsdp-restore"
                              f" convert {path} {sibling if beside else 'DST.safetensors'}")
        self.path = resolved
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._fds: dict[Path, int] = {}  # one descriptor per file, opened here, used for header and data
        self._inodes: dict[Path, tuple[int, int]] = {}  # (st_dev, st_ino) of each file as opened
        self._maps: dict[Path, mmap.mmap] = {}
        self.headers: dict[Path, FileHeader] = {}
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                structure_json, metadata, weight_map = self._open_files(resolved)
                break
            except _Replaced:
                self.close()
                if attempt == _OPEN_ATTEMPTS - 1:
                    raise FormatError(resolved, f"was replaced while it was being opened, {_OPEN_ATTEMPTS} times in a"
                                      " row (another process writing it again and again?); open it again once"
                                      " the writer is done") from None
            except FormatError as e:
                self.close()
                raise self._as_sibling(e, path, resolved) from None
            except BaseException:
                self.close()
                raise
        try:
            self._index(resolved, path, structure_json, metadata, weight_map)
        except FormatError as e:
            self.close()
            raise self._as_sibling(e, path, resolved) from None
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _as_sibling(e: FormatError, given: str | os.PathLike[str], resolved: Path) -> FormatError:
        """A fault of the converted sibling read in place of the ``.pt`` the caller named, said so (the caller
        named another file than the one at fault)."""
        if Path(given) == resolved or "was not converted from " in e.problem:
            return e  # (a stale sibling's message says already which file was read for which)
        fix = "" if "fsdp-restore convert" in e.problem else (f": convert it again with fsdp-restore convert {given}"
                                                              f" {resolved} --force")  # (not twice: a stale one's)
        return FormatError(e.path, f"{e.problem} (read in place of {Path(given).name}, as its converted sibling{fix})")

    def _open_files(self, resolved: Path) -> tuple[str | None, dict[str, Any], dict[str, Path]]:
        """Open every file of the checkpoint once and read its header through that descriptor: a single
        file by its path; a sharded set's index and shards through one descriptor of their directory, so
        that all come from one version of the directory even if it is replaced meanwhile (write.py
        exchanges the names). Raises `_Replaced` when that old version is deleted before every file is
        open (the caller opens the new one)."""
        self.headers = {}
        index_path, files = _resolve_files(resolved)
        self.index_path = index_path
        metadata: dict[str, Any] = {}
        weight_map: dict[str, Path] = {}
        if index_path is None:
            _raise_fd_limit(len(files))
            for file in files:
                fd = _open_file(file)
                self._keep(file, fd)
                self.headers[file] = read_header(file, fd)
            return (self.headers[files[0]].metadata.get(META_STRUCTURE) if files else None), metadata, weight_map
        directory = index_path.parent
        try:
            dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as e:
            raise FormatError(directory, f"cannot read: {e.strerror or e}") from None
        try:
            try:
                index_fd = open_file(index_path.name, dir_fd=dir_fd)
            except FormatError as e:
                raise FormatError(index_path, e.problem) from None
            except FileNotFoundError:
                _gone(directory, dir_fd, index_path, "the index disappeared while it was being opened; open it again")
            try:
                raw = _read_all(index_fd)
            finally:
                os.close(index_fd)
            metadata, weight_map = read_index(index_path, raw)
            root = directory.resolve()
            converted = _converted_shards(index_path, weight_map)
            weight_map = {key: converted.get(shard, shard) for key, shard in weight_map.items()}
            files = sorted(set(weight_map.values()))
            _raise_fd_limit(len(files))
            for shard in files:
                try:
                    fd = open_file(shard.relative_to(root), dir_fd=dir_fd)
                except FormatError as e:  # (a pipe or a device: named by its full path)
                    raise FormatError(shard, e.problem) from None
                except FileNotFoundError:
                    _gone(directory, dir_fd, index_path, f"shard {shard.name} named in the weight_map is missing")
                except OSError as e:
                    raise FormatError(shard, f"cannot read: {e.strerror or e}") from None
                self._keep(shard, fd)
                self.headers[shard] = read_header(shard, fd)
        finally:
            os.close(dir_fd)
        for torch_shard, shard in converted.items():  # each was converted from the torch.save shard as it is now
            if not torch_shard.exists():
                continue  # converted, then deleted to free the space: the conversion is all there is
            header = self.headers[shard]
            _refuse_stale(_source_record(header.metadata.get(META_SOURCE), shard), _json_meta(header, META_CAST),
                          torch_shard, shard, source_named=torch_shard.name,
                          skipped=_skipped(header.metadata.get(META_STRUCTURE), shard))
        set_id = metadata.get(META_SET_ID)
        for shard, header in self.headers.items():
            if set_id is not None and header.metadata.get(META_SET_ID) != set_id:
                raise FormatError(shard, f"belongs to another write than {index_path.name} (set id"
                                  f" {header.metadata.get(META_SET_ID)}, the index's {set_id}): the directory mixes"
                                  " files of two versions of the checkpoint (copied or replaced file by file?); write"
                                  " it again as a whole: fsdp-restore convert SRC DIR --force")
        structure = metadata.get(META_STRUCTURE)
        if structure is None and converted and set(converted.values()) == set(self.headers):
            structure = self._joined_structures(list(dict.fromkeys(converted.values())))
        return structure, metadata, weight_map

    def _joined_structures(self, shards: list[Path]) -> str | None:
        """The structures of converted ``.bin`` shards joined into one (each a state dict's part): a shard may hold
        a tied weight once, its other name a view in that shard's structure, which the index's names alone lose.
        None where a shard's is not a dict of its own (the flat structure of the entries then)."""
        items: list[Any] = []
        for shard in shards:
            raw = self.headers[shard].metadata.get(META_STRUCTURE)
            root = parse_json(raw, shard, "structure metadata").get("root") if raw else None
            if not (isinstance(root, dict) and root.get("type") in ("dict", "OrderedDict")
                    and isinstance(root.get("items"), list)):
                return None
            items += root["items"]
        return json.dumps({"version": STRUCTURE_VERSION, "root": {"type": "dict", "items": items}})

    def _keep(self, file: Path, fd: int) -> None:
        """Hold ``fd`` as the one descriptor of ``file`` (header and data reads) for this checkpoint's life."""
        st = os.fstat(fd)  # (``fd`` from `format.open_file`: a regular file, checked there)
        self._fds[file] = fd  # (held first: closed with the checkpoint whatever raises below)
        self._inodes[file] = (st.st_dev, st.st_ino)
        if hasattr(os, "posix_fadvise"):
            # No readahead past what we ask for: each rank wants only its own slice.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def _index(self, resolved: Path, path: str | os.PathLike[str], structure_json: str | None,
               metadata: dict[str, Any], weight_map: dict[str, Path]) -> None:
        """Index the opened files' tensors, checksums and casts, and decode the structure."""
        self.entries: dict[str, TensorEntry] = {}
        self.checksums: dict[str, str] = {}
        self.cast: dict[str, str] = {}
        self.source: dict[str, Any] | None = None  # the converted .pt's identity (provenance.py), if recorded
        files = list(self.headers)
        source_json = metadata.get(META_SOURCE) if self.index_path is not None else None
        for file, header in self.headers.items():
            if source_json is None and self.index_path is None:
                source_json = header.metadata.get(META_SOURCE)
            self.checksums.update(_json_meta(header, META_CHECKSUMS))
            self.cast.update(_json_meta(header, META_CAST))
            if not weight_map and not self.entries:  # a single file (or the first): its names are distinct keys
                self.entries.update(header.entries)
                continue
            for key, entry in header.entries.items():
                if weight_map and weight_map.get(key) != file:
                    continue  # a stale tensor in a shard the index does not point at: the index wins
                if key in self.entries:
                    raise FormatError(file, f"tensor '{key}' also appears in {self.entries[key].file.name}")
                self.entries[key] = entry
        viewed: set[str] = set()  # names a joined structure of converted shards holds as views of another
        if structure_json is not None and self.index_path is not None and any(k not in self.entries
                                                                              for k in weight_map):
            joined = parse_json(structure_json, self.index_path, "structure metadata")
            viewed = {path for path, _ in iter_nodes_with_keys(joined["root"])}
        for key, shard in weight_map.items():
            if key not in self.entries and key not in viewed:
                raise FormatError(shard, f"index says tensor '{key}' is in this shard but it is not")
        self.source = _source_record(source_json, self.index_path or files[0])
        if resolved != Path(path) and Path(path).is_file():  # opened through x.pt: must be x.pt's conversion
            # (what this header records: no second read)
            _refuse_stale(self.source, self.cast, path, resolved, source_named=str(path),
                          also=f" (or open {resolved} itself to use it as it is)",
                          skipped=_skipped(structure_json, self.index_path or files[0]))
        self.index_metadata = metadata  # the index's metadata ({} for a single file)
        self.has_structure = structure_json is not None
        self._structure_json = structure_json
        if structure_json is None:
            self.structure = flat_structure(list(self.entries))
        else:
            where = self.index_path or files[0]
            self.structure = parse_json(structure_json, where, "structure metadata")
            validate_structure(self.structure, where, self.entries)

    def skipped_values(self) -> list[str]:
        """Paths of the values the conversion that wrote this checkpoint could not store (None here:
        ``on_unsupported="skip"``)."""
        return skipped_values(self.structure) if self.has_structure and self.structure_mentions('"skipped"') else []

    def structure_mentions(self, text: str) -> bool:
        """Whether ``text`` occurs in the structure's JSON: a test at the speed of a string search before a walk of
        the structure for names that most checkpoints never hold."""
        return self._structure_json is not None and text in self._structure_json

    @property
    def version(self) -> str | None:
        """What identifies the version opened: a sharded set's id, or a single file's header crc32 (None for
        files that record neither). Ranks that each open a checkpoint can compare it to know that they read
        one version, not two on either side of a replacement."""
        if self.index_path is not None:
            return self.index_metadata.get(META_SET_ID) or self.index_metadata.get(META_HEADER_CRC)
        header = next(iter(self.headers.values()), None)
        return header.metadata.get(META_HEADER_CRC) if header is not None else None

    def content_sample(self) -> str:
        """The `version` where the files record one; for files that do not (other writers'), a crc32 of each
        file's header bytes and `SAMPLED_PAGES` pages of its data spread over it: ranks that compare it tell two
        different files of the same layout apart (a stale copy on one node, another run's weights), which the
        header alone cannot. A few small reads per file."""
        recorded = self.version
        if recorded is not None:
            return recorded
        crc = 0
        for file in sorted(self.headers):
            header, fd = self.headers[file], self._fd(file)
            crc = zlib.crc32(os.pread(fd, header.data_start, 0), crc)  # length and JSON
            data = header.file_size - header.data_start
            for i in range(SAMPLED_PAGES if data else 0):
                at = header.data_start + (max(0, data - _PAGE) * i) // (SAMPLED_PAGES - 1)
                crc = zlib.crc32(os.pread(fd, min(_PAGE, data), at), crc)
        return f"sampled:{crc:08x}"

    # -- lazy, memory-mapped access (the `load` API) -------------------------------------------

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_tensor(self, key: str) -> torch.Tensor:
        """The whole tensor, memory-mapped (pages are read when touched) from the descriptor the header was
        read through: one mapping per file, no system call per tensor. The mapping is private (copy on
        write, as ``torch.load(mmap=True)`` and ``safe_open`` map): changing the tensor never changes the
        file. A tensor whose offset is not a multiple of its itemsize (other writers) is read instead."""
        entry = self._entry(key)
        if entry.nbytes == 0 or entry.offset % entry.itemsize:
            return self.read_tensor(key)
        mapped = self._maps.get(entry.file)
        if mapped is None:
            fd = self._fd(entry.file)  # outside the lock: it may take it
            with self._lock:
                mapped = self._maps.get(entry.file)
                if mapped is None:
                    # private and writable: torch.frombuffer warns on read-only memory; copy on write keeps
                    # the file unchanged whatever the caller does with the tensor
                    mapped = self._maps[entry.file] = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE,
                                                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        flat = torch.frombuffer(mapped, dtype=entry.dtype, count=entry.numel, offset=entry.offset)
        return flat.view(entry.shape)

    def tensors(self, *, exact: bool = False) -> Mapping[str, torch.Tensor]:
        """A ``{key: tensor}`` mapping over every tensor: memory-mapped (lazy), or with ``exact`` read on
        access with positional reads (no mmap readahead: for small tensors on a restore path)."""
        return _LazyTensors(self, exact)

    def read_tensor(self, key: str) -> torch.Tensor:
        """The whole tensor in fresh memory, read with positional reads (exactly its bytes)."""
        entry = self._entry(key)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_range(key, 0, out.view(-1))
        return out

    def load(self, *, mmap: bool = True) -> Any:
        """The stored object, rebuilt exactly. Tensors are memory-mapped (read when touched), or with
        ``mmap=False`` read eagerly into memory with large positional reads: better on network
        filesystems, where page faults on a mapping turn into many small remote reads."""
        return unflatten(self.tensors(exact=not mmap), self.structure)

    def _entry(self, key: str) -> TensorEntry:
        try:
            return self.entries[key]
        except KeyError:
            raise KeyError(f"no tensor '{key}' in {self.path}") from None

    # -- exact byte-range reads (the restore path) ---------------------------------------------

    def _fd(self, file: Path) -> int:
        """The descriptor the header of ``file`` was read through. After `close`, the file is opened again,
        and refused if it is not the file that was opened first (replaced since)."""
        fd = self._fds.get(file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file)
                if fd is None:
                    fd = _open_file(file)
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != self._inodes.get(file):
                        os.close(fd)
                        raise FormatError(file, "was replaced since this checkpoint was opened (and closed); open"
                                          " the checkpoint again")
                    self._keep(file, fd)
        return fd

    def read_range(self, key: str, elem_start: int, dest: torch.Tensor) -> None:
        """Read ``dest.numel()`` elements of tensor ``key``, starting at flat element ``elem_start``,
        into ``dest`` (a contiguous CPU tensor of the entry's dtype), with positional reads."""
        self.read_contiguous([(key, elem_start, dest)])

    def read_contiguous(self, parts: Sequence[tuple[str, int, torch.Tensor]], *,
                        pread: Callable[[int, list[Any], int], int] = pread_all) -> None:
        """Read several ranges that lie back to back in one file, ``(key, first element, dest)`` each (as
        `read_range`), with one scattering ``preadv``: small tensors stored next to each other cost one
        system call, not one each. ``pread(fd, views, offset) -> bytes read`` moves the bytes into the dests'
        byte views (ctypes arrays over their memory; `screened_read.pread_all`): the check passes its own,
        `check.Ledger.pread`, which fills and screens the memory it is given as it reads."""
        # once per chunk of every restore: attribute lookups on the tensor kept to the cheap ones (``is_cpu``, not
        # ``device.type``; the entry's own ``numel`` and ``itemsize``), and the byte view made from the pointer
        views: list[Any] = []
        keys: list[str] = []
        entries = self.entries
        file: Path | None = None
        start = end = 0
        for key, elem_start, dest in parts:
            entry = entries.get(key)
            if entry is None:
                self._entry(key)  # raises, naming the file
            n = dest.numel()
            if elem_start < 0 or elem_start + n > entry.numel:
                raise ValueError(f"range [{elem_start}, {elem_start + n}) outside tensor '{key}' of {entry.numel}"
                                 " elements")
            if dest.dtype != entry.dtype or not dest.is_cpu or not dest.is_contiguous():
                raise ValueError("read_range needs a contiguous CPU destination of the stored dtype")
            if n == 0:
                continue
            nbytes = n * entry.itemsize
            offset = entry.offset + elem_start * entry.itemsize
            if file is None:
                file, start, end = entry.file, offset, offset
            elif offset != end or (entry.file is not file and entry.file != file):
                raise ValueError(f"read_contiguous: '{key}' does not follow the previous range in {file}")
            views.append((ctypes.c_char * nbytes).from_address(dest.data_ptr()))  # a writable buffer: what preadv needs
            keys.append(key)
            end += nbytes
        if file is None:
            return
        got = pread(self._fd(file), views, start)
        if got < end - start:
            _truncated(file, views, keys, start, got)
        with self._lock:
            self.bytes_read += end - start

    def read_rows(self, key: str, elem_start: int, dest: torch.Tensor, rows: int, stride: int) -> None:
        """Read ``rows`` runs of ``dest.numel() // rows`` elements of tensor ``key``, the first at flat
        element ``elem_start`` and each ``stride`` elements after the previous, into ``dest`` (a contiguous
        CPU tensor of the entry's dtype, the runs back to back). ``bytes_read`` counts the runs' bytes; the
        kernel reads whole pages, so runs shorter than a page apart bring in their neighbours' bytes too."""
        if rows <= 1:
            self.read_range(key, elem_start, dest)
            return
        entry = self._entry(key)
        n = dest.numel()
        run = n // rows
        last = elem_start + (rows - 1) * stride + run
        if run * rows != n or stride < run or elem_start < 0 or last > entry.numel:
            raise ValueError(f"{rows} rows of {run} elements {stride} apart from {elem_start} do not fit tensor"
                             f" '{key}' of {entry.numel} elements")
        if dest.dtype != entry.dtype or not dest.is_contiguous() or dest.device.type != "cpu":
            raise ValueError("read_rows needs a contiguous CPU destination of the stored dtype")
        if n == 0:
            return
        first = entry.offset + elem_start * entry.itemsize
        if run * entry.itemsize >= ROW_READ_MIN_BYTES or first % entry.itemsize:
            # one positional read per row, validated once above: the loop is the system calls
            fd = self._fd(entry.file)
            row_bytes, stride_bytes = run * entry.itemsize, stride * entry.itemsize
            view = _writable_bytes(dest)
            for i in range(rows):
                _pread_into(fd, [view[i * row_bytes:(i + 1) * row_bytes]], first + i * stride_bytes, entry.file, [key])
            with self._lock:
                self.bytes_read += n * entry.itemsize
            return
        fd = self._fd(entry.file)
        end = entry.offset + last * entry.itemsize
        base = first - first % mmap.ALLOCATIONGRANULARITY
        # A private mapping is writable memory to Python (torch.frombuffer warns on read-only buffers);
        # nothing writes to it.
        mapped = mmap.mmap(fd, end - base, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                           offset=base)
        try:
            if hasattr(mapped, "madvise"):  # read the span ahead in one go, and nothing around it
                mapped.madvise(mmap.MADV_WILLNEED)
            raw = torch.frombuffer(mapped, dtype=torch.uint8)[first - base:]
            src = raw.view(entry.dtype)
            src = src.as_strided((rows, run), (stride, 1), src.storage_offset())
            dest.view(rows, run).copy_(src)
            del raw, src
        finally:
            mapped.close()
        with self._lock:
            self.bytes_read += n * entry.itemsize

    def tied_aliases(self) -> dict[str, str]:
        """``{dropped name: kept name}`` recorded by ``safetensors.torch.save_model``, which stores one
        name of each group of tied tensors and writes the others into the metadata."""
        aliases: dict[str, str] = {}
        for header in self.headers.values():
            for dropped, kept in header.metadata.items():
                if kept in self.entries and dropped not in self.entries and dropped != kept:
                    aliases[dropped] = kept
        return aliases

    def close(self) -> None:
        """Close the descriptors. Tensors already mapped stay valid (their mapping outlives them)."""
        fds = getattr(self, "_fds", {})
        for fd in fds.values():
            os.close(fd)
        fds.clear()
        getattr(self, "_maps", {}).clear()  # not mmap.close(): tensors may still use the memory

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self.entries)} tensors, {len(self.headers)} file(s))"


_OPEN_ATTEMPTS = 3


class _Replaced(Exception):
    """The version of a sharded set being opened was deleted before all of its files were open."""


def _open_file(file: Path) -> int:
    try:
        return open_file(file)
    except FileNotFoundError:
        raise FormatError(file, "no such file or directory") from None
    except OSError as e:
        raise FormatError(file, f"cannot read: {e.strerror or e}") from None


def _gone(directory: Path, dir_fd: int, index_path: Path, what: str) -> NoReturn:
    """A file of a sharded set is missing: `_Replaced` when the directory we hold is no longer the one at
    its path (replaced, and its old version being deleted: open the new one), else a `FormatError`."""
    held = os.fstat(dir_fd)
    try:
        now = os.stat(directory)
        replaced = (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)
    except FileNotFoundError:
        replaced = True
    if replaced or held.st_nlink == 0:
        raise _Replaced(directory)
    raise FormatError(index_path, what)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _raise_fd_limit(files: int) -> None:
    """A checkpoint keeps one descriptor per file open: raise the soft limit (up to the hard one) for a
    set of many shards rather than fail with EMFILE halfway."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = files + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if new > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def _pread_into(fd: int, views: list[Any], offset: int, file: Path, keys: list[str]) -> None:
    """Fill ``views`` (writable byte buffers: memoryviews, ctypes arrays; the tensors ``keys``, back to back in
    ``file``) from ``offset`` of ``fd``: scattering positional reads, again where the kernel returns less; a file
    that ends early names the tensor."""
    got = pread_all(fd, views, offset)
    if got < sum(len(v) for v in views):
        _truncated(file, views, keys, offset, got)


def _truncated(file: Path, views: Sequence[Any], keys: Sequence[str], offset: int, got: int) -> NoReturn:
    """Raise the error of a read of ``views`` (the tensors ``keys``) from ``offset`` that got ``got`` bytes: the
    file ends in the tensor after them."""
    for view, key in zip(views, keys):
        if got < len(view):
            break
        got -= len(view)
        offset += len(view)
    raise FormatError(file, f"tensor '{key}': file ends at byte {offset + got} (truncated?): {TRUNCATED_FIX}")


def _writable_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory. Not ``t.numpy()``: a tensor viewed by
    numpy has its storage marked non-resizable, and FSDP2 resizes parameter storage on reshard."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


class _LazyTensors(Mapping[str, torch.Tensor]):
    def __init__(self, ckpt: Checkpoint, exact: bool = False) -> None:
        self._ckpt = ckpt
        self._exact = exact

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._ckpt.entries:
            raise KeyError(key)
        return self._ckpt.read_tensor(key) if self._exact else self._ckpt.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._ckpt.entries)

    def __len__(self) -> int:
        return len(self._ckpt.entries)


def _source_record(raw: str | None, where: Path) -> dict[str, Any] | None:
    """The converted source's identity a header (or an index) records (`provenance.source_identity`), if any."""
    record = parse_json(raw, where, f"metadata '{META_SOURCE}'") if raw is not None else None
    return record if isinstance(record, dict) else None


def _refuse_stale(recorded: dict[str, Any] | None, cast: Mapping[str, str], source: str | os.PathLike[str],
                  converted: Path, *, source_named: str, also: str = "", skipped: Sequence[str] = ()) -> None:
    """`FormatError` naming ``converted`` and the command that converts it again, where it is not a conversion of
    all of ``source`` (named ``source_named`` in the text) as it is now (`provenance.mismatch`)."""
    why = mismatch(recorded, source, converted, cast=cast, skipped=skipped)
    if why:
        raise FormatError(converted, f"was not converted from {source_named} as it is now ({why}); convert it again:"
                          f" fsdp-restore convert {source} {converted} --force{also}")


def _skipped(structure_json: str | None, where: Path) -> list[str]:
    """`flatten.skipped_values` of a structure's JSON (parsed only where the word is in it: most hold none)."""
    if not structure_json or '"skipped"' not in structure_json:
        return []
    return skipped_values(parse_json(structure_json, where, "structure metadata"))


def _json_meta(header: FileHeader, name: str) -> dict[str, str]:
    raw = header.metadata.get(name)
    if raw is None:
        return {}
    value = parse_json(raw, header.path, f"metadata '{name}'")
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise FormatError(header.path, f"metadata '{name}' is not a JSON object of strings")
    return value


def open_checkpoint(path: str | os.PathLike[str] | Checkpoint) -> Checkpoint:
    """Open a checkpoint (file, sharded directory, index json, or ``.pt`` with a sibling)."""
    return path if isinstance(path, Checkpoint) else Checkpoint(path)
