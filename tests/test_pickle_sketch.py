"""pickle_sketch.py: a torch.save file's storages found without torch and without running anything it names.
The oracle for where the bytes lie is torch itself: each tensor's own bytes must be what the file holds there."""

from __future__ import annotations

import collections
import io
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch

from fsdp_restore.pickle_sketch import Call, StorageRef, sketch, storage_range, storage_refs

class Loud:
    """Unpickling this for real calls ``os.system`` (a file's way to run code)."""

    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _bytes_at(path, offset, nbytes):
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def test_every_storage_is_found_where_its_bytes_are(tmp_path):
    torch.manual_seed(0)
    state = {"model": collections.OrderedDict(w=torch.randn(5, 3), b=torch.arange(7, dtype=torch.int16)),
             "optim": {"state": {0: {"exp_avg": torch.randn(4).to(torch.bfloat16), "step": torch.tensor(3.0)}},
                       "param_groups": [{"lr": 0.1, "params": [0]}]},
             "view": torch.randn(10)[2:6], "param": torch.nn.Parameter(torch.ones(2, 2))}
    path = tmp_path / "c.pt"
    torch.save(state, path)
    s = sketch(path)
    refs = list(storage_refs(s.root))
    assert len(refs) == 6 and len({r.key for r in refs}) == 6
    wanted = {bytes(t.untyped_storage()) for t in (state["model"]["w"], state["model"]["b"], state["view"],
                                                    state["optim"]["state"][0]["exp_avg"],
                                                    state["optim"]["state"][0]["step"], state["param"])}
    found = {_bytes_at(path, *storage_range(s, r)) for r in refs}
    assert found == wanted
    # a subtree finds only its own storages
    only_model = {_bytes_at(path, *storage_range(s, r)) for r in storage_refs(s.root["model"])}
    assert only_model == {bytes(state["model"]["w"].untyped_storage()), bytes(state["model"]["b"].untyped_storage())}
    assert isinstance(s.root["model"], Call) and s.root["model"].name == "collections.OrderedDict"


def test_a_shared_storage_is_named_once(tmp_path):
    base = torch.randn(8)
    torch.save({"a": base[:4], "b": base[4:], "c": base}, tmp_path / "s.pt")
    s = sketch(tmp_path / "s.pt")
    refs = list(storage_refs(s.root))
    assert len(refs) == 1 and _bytes_at(tmp_path / "s.pt", *storage_range(s, refs[0])) == bytes(base.untyped_storage())


def test_nothing_the_pickle_names_is_imported_or_called(tmp_path):
    """A file that would run a shell command when unpickled (and import a module with a side effect) is sketched
    without either happening: the globals are stand-ins that only record their arguments."""
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"x": Loud(), "y": [1, 2]}, protocol=2))
    module = tmp_path / "sideeffect.py"
    module.write_text("open('IMPORTED', 'w').close()\n")
    script = (f"import sys, os; os.chdir({str(tmp_path)!r}); sys.path.insert(0, {str(tmp_path)!r});"
              "import pickle, zipfile;"
              "from fsdp_restore.pickle_sketch import sketch, Call;"
              f"z = zipfile.ZipFile({str(tmp_path / 'mod.pt')!r}, 'w');"
              "z.writestr('archive/data.pkl', b'\\x80\\x02csideeffect\\nthing\\nq\\x00)\\x81q\\x01.'); z.close();"
              f"a = sketch({str(path)!r}).root; b = sketch({str(tmp_path / 'mod.pt')!r}).root;"
              "assert isinstance(a['x'], Call) and a['x'].name.endswith('.system') and a['x'].args == ('touch PWNED',);"
              "assert isinstance(b, Call) and b.name == 'sideeffect.thing'; assert 'sideeffect' not in sys.modules")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "IMPORTED").exists()


def test_a_cycle_in_the_pickle_ends(tmp_path):
    loop: list = [torch.zeros(2)]
    loop.append(loop)
    torch.save({"loop": loop}, tmp_path / "l.pt")
    refs = list(storage_refs(sketch(tmp_path / "l.pt").root))
    assert len(refs) == 1 and isinstance(refs[0], StorageRef)


@pytest.mark.parametrize("content", [b"", b"not a zip at all", b"PK\x03\x04truncated"])
def test_what_is_not_a_torch_save_archive_is_an_error(tmp_path, content):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises((ValueError, zipfile.BadZipFile, pickle.UnpicklingError, OSError)):
        sketch(path)


def test_an_archive_without_a_pickle_is_an_error(tmp_path):
    with zipfile.ZipFile(tmp_path / "x.pt", "w") as z:
        z.writestr("archive/other", b"x")
    with pytest.raises(ValueError, match="data.pkl"):
        sketch(tmp_path / "x.pt")


class _Marker:
    pass


def _pickle_with_storage(obj, pid) -> bytes:
    """``obj`` pickled with every `_Marker` in it saved as the persistent id ``pid``."""
    class P(pickle.Pickler):
        def persistent_id(self, o):
            return pid if isinstance(o, _Marker) else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _archive(path, pkl: bytes, records=(), *, zip64=False, compress=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compress) as z:
        for name, data in [("archive/data.pkl", pkl), *records]:
            with z.open(name, "w", force_zip64=zip64) as f:
                f.write(data)
    return path


# Every opcode that makes the C unpickler look up a global or call something, hand-built, each naming os.system
# with a command: the sketch must hand back a stand-in holding the arguments, and never run the command.
_CALLING_OPCODES = {
    "GLOBAL+REDUCE": b"\x80\x02cposix\nsystem\nX\x0b\x00\x00\x00touch PWNED\x85R.",
    "STACK_GLOBAL+REDUCE": b"\x80\x04\x8c\x05posix\x8c\x06system\x93\x8c\x0btouch PWNED\x85R.",
    "INST": b"(S'touch PWNED'\niposix\nsystem\n.",
    "OBJ": b"(cposix\nsystem\nS'touch PWNED'\no.",
    "NEWOBJ": b"\x80\x02cposix\nsystem\nX\x0b\x00\x00\x00touch PWNED\x85\x81.",
    "NEWOBJ_EX": b"\x80\x04\x8c\x05posix\x8c\x06system\x93\x8c\x0btouch PWNED\x85}\x92.",
    "BUILD": b"\x80\x02cposix\nsystem\n)\x81}X\x03\x00\x00\x00cmdX\x0b\x00\x00\x00touch PWNEDsb.",
}


@pytest.mark.parametrize("opcode", sorted(_CALLING_OPCODES))
def test_no_opcode_reaches_a_real_global(tmp_path, monkeypatch, opcode):
    monkeypatch.chdir(tmp_path)
    root = sketch(_archive(tmp_path / "x.pt", _CALLING_OPCODES[opcode])).root
    assert isinstance(root, Call) and root.name == "posix.system"
    assert "touch PWNED" in repr((root.args, root.state))
    assert not (tmp_path / "PWNED").exists()


def test_extension_codes_are_refused_when_registered(tmp_path):
    """EXT opcodes are resolved through copyreg's process-wide registry, around find_class: with no codes
    registered they fail; with some, the sketch refuses to run at all."""
    path = _archive(tmp_path / "x.pt", b"\x80\x02\x82\xf0)R.")  # EXT1 240, then a call
    with pytest.raises(ValueError, match="unregistered extension code"):
        sketch(path)
    script = ("import copyreg, sys; copyreg.add_extension('posix', 'system', 240);"
              "from fsdp_restore.pickle_sketch import sketch\n"
              f"try: sketch({str(path)!r})\nexcept ValueError as e: print('refused', e)")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("refused"), res.stdout + res.stderr[-2000:]
    assert not (tmp_path / "PWNED").exists()


def test_a_hostile_persistent_id_is_refused_without_printing_it(tmp_path):
    """A persistent id whose key is a list shared many times over (its repr doubles with each level) is refused
    at once, not turned into text."""
    nested: list = []
    for _ in range(40):
        nested = [nested, nested]
    pkl = _pickle_with_storage({"t": _Marker()}, ("storage", None, nested, "cpu", 1))
    assert len(pkl) < 2000
    with pytest.raises(pickle.UnpicklingError, match="persistent id"):
        sketch(_archive(tmp_path / "x.pt", pkl))


def test_a_compressed_pickle_is_not_inflated(tmp_path):
    path = _archive(tmp_path / "x.pt", pickle.dumps({"a": 1}), compress=zipfile.ZIP_DEFLATED)
    with pytest.raises(ValueError, match="compressed"):
        sketch(path)


def test_a_zip64_record_is_found_where_its_bytes_are(tmp_path):
    data = bytes(range(256)) * 3
    pkl = _pickle_with_storage({"t": _Marker()}, ("storage", None, "0", "cpu", len(data)))
    path = _archive(tmp_path / "x.pt", pkl, [("archive/data/0", data)], zip64=True)
    s = sketch(path)
    (ref,) = storage_refs(s.root)
    offset, nbytes = storage_range(s, ref)
    assert nbytes == len(data) and _bytes_at(path, offset, nbytes) == data
