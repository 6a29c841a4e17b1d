"""One verdict on every rank: problems collected per phase, agreed in one collective, raised everywhere.

A restore runs in phases (open and plan; read and check). Each phase runs under `Problems.guard`,
which turns *any* exception on this rank into a problem that names the rank and the exception type,
so that a rank never leaves the protocol early and its peers never wait in a collective for it.
At the end of a phase `agree` makes one fixed-size ``all_reduce`` (the number of failing ranks, the
plan's coverage digest and the buffer fingerprint); only when something is wrong do the lowest failing
ranks (at most `REPORTERS`) broadcast their problems, capped, so that every rank raises the same
`RestoreError` text and nothing any rank sends, receives or holds grows with the world size.

A rank that *dies* (killed, out of memory, a crash) cannot report anything: its peers learn of it in the
verdict's collective, which fails (gloo on one host: at once, "Connection closed by peer"; NCCL, or a rank
that hangs: at the process group's timeout). `_collective` turns that failure into a `RestoreError` too,
so that a caller handles one error type, and says what happened and what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .buffers import FINGERPRINT_MODULUS
from .check import DIGEST_PRIME, coverage_digest, name_weight
from .errors import RestoreError

_LABELS = {
    "error": "errors", "missing": "missing from the checkpoint", "unexpected": "unexpected in the checkpoint",
    "shape": "shape mismatches", "dtype": "dtype mismatches", "unrestored": "not restored (still NaN / not covered)",
    "unsupported": "unsupported layouts", "buffers": "non-persistent buffers (held by no checkpoint) that are wrong",
    "coverage": "plan: the ranks' reads do not cover these tensors exactly (a planner bug)",
    "key_map": "key_map problems", "unreadable": "stored in a form a restore cannot read",
    "checksum": "restored values that are not the bytes the file records a crc32 of (verify_checksums=True)",
    "replicas": "parameters every rank holds whole that differ between the ranks",
    "written": "written, but read back from the storage as other bytes (verify_checksums=True)",
    "looked_in": "names looked for in", "frozen": "the missing",
}
_CONTEXT = {"looked_in", "frozen"}  # kinds that say where, beside the problems: one line, not a count of items
_NAMES_HINT = ("check model_prefix= (CLI: --model-prefix; the subtree holding the weights), pass key_map= (CLI:"
               " --key-map) when the model names its tensors differently, or strict=False (CLI: --no-strict) to"
               " restore the keys that match")
_HINTS = {
    "shape": "a stored tensor of another shape: the model is configured otherwise (vocabulary, widths, heads), or a"
             " key_map sends a stored tensor to a parameter that fuses or splits several (q, k and v into one qkv): a"
             " rename cannot fuse or split, so join or cut those tensors in the source and convert again",
    "unreadable": "a view whose values are not one range of another tensor's elements (a transpose, a conj or neg"
                  " view) cannot be read in slices: save a contiguous copy of it (.contiguous(), .resolve_conj(),"
                  " .resolve_neg()) and convert again; two tensors under one name: rename one in the source and"
                  " convert again",
    "missing": _NAMES_HINT,
    "unexpected": _NAMES_HINT,
    "checksum": "the file's bytes changed after it was written (a damaged disk, an incomplete or altered copy):"
                " fsdp-restore verify FILE names every damaged tensor; restore from an intact copy (where the ranks'"
                " copies differ, give every rank the same file)",
    "buffers": "the model was probably built on the meta device and materialized with to_empty(): call"
               " fsdp_restore.init_non_persistent_buffers(model) (Hugging Face rotary embeddings, modules with"
               " reset_buffers()), re-run your own buffer initialisation, or build these modules on the real"
               " device; pass check_buffers=False if they are meant to differ",
    "written": "the storage did not keep what this save wrote (a failing disk, a file system that lost or misplaced"
               " a write): nothing was put at the destination and a checkpoint already there is untouched; check"
               " the storage, then save again",
    "replicas": "parameters that every rank holds whole differ between the ranks, so the file would take each from"
                " whichever rank writes it: nothing keeps them in sync (a module left outside fully_shard, whose"
                " gradients no rank all-reduces): shard it too (fully_shard(model) on the root as well), wrap the"
                " model in DistributedDataParallel, or keep them equal yourself before saving",
}
_PER_RANK = ("error", "unrestored", "buffers", "replicas", "written")  # kinds whose items may differ between ranks


@dataclass
class Problems:
    """This rank's problems in one phase, by kind."""

    items: dict[str, list[str]] = field(default_factory=dict)
    interrupted: bool = False  # a KeyboardInterrupt met in `guard`: raised again once every rank has the verdict

    def add(self, kind: str, texts: Sequence[str]) -> None:
        if texts:
            self.items.setdefault(kind, []).extend(texts)

    def update(self, problems: dict[str, list[str]]) -> None:
        for kind, texts in problems.items():
            self.add(kind, texts)

    def __bool__(self) -> bool:
        return any(self.items.values())

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Any exception inside becomes an "error" problem naming its type. A KeyboardInterrupt too, so that the
        other ranks learn of it at the next verdict instead of waiting for the process group's timeout; `agree`
        raises it again on this rank once the verdict is shared."""
        try:
            yield
        except KeyboardInterrupt:
            self.interrupted = True
            self.add("error", ["KeyboardInterrupt: interrupted on this rank"])
        except Exception as e:  # noqa: BLE001 - every failure must reach the verdict, whatever it is
            text = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip() or "(no message)"
            self.add("error", [f"{type(e).__name__}: {text}"])


_DIED_HINT = ("every rank of the process group must call it (a rank that waits elsewhere, in a barrier or another"
              " collective, leaves the others waiting here until the timeout); otherwise"
              " find the rank that died in its own log and exit status (killed, out of memory, a crash) or the"
              " broken connection, fix that and restart every rank; do not use what was being restored as it is (a"
              " restore stopped in its reads leaves it partly written; one stopped while planning, untouched)."
              " With gloo on one host the others fail at once; with NCCL, or a rank that hangs, they wait until the process group's timeout: pass timeout= to"
              " init_process_group to bound it")


@contextlib.contextmanager
def _collective(what: str, step: str) -> Iterator[None]:
    """A failing collective of the verdict (a peer died or its connection broke, or the process group
    timed out) becomes a `RestoreError` naming the phase (``what``) and the ``step``, not torch's
    RuntimeError / DistBackendError (whose text speaks of sockets and pair.cc lines)."""
    try:
        yield
    except RuntimeError as e:  # DistBackendError, DistNetworkError and gloo's errors all derive from it
        text = str(e).strip()
        cause = f"{type(e).__name__}: {text.splitlines()[0] if text else '(no message)'}"
        line = (f"a rank died or lost its connection, or did not make this call (the verdict's collective, {step},"
                f" failed with {cause})")
        raise RestoreError(f"{what} failed:\n  {_LABELS['error']} (1): {line}\n  hint: {_DIED_HINT}",
                           {"error": [line]}) from e


def _rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def new_problems() -> Problems:
    return Problems()


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, group=group)
    return t.cpu().tolist()


REPORTERS = 8  # on failure, the lowest failing ranks that send their problems to all (bounded, at any scale)
TEXTS_PER_KIND = 20  # problems of one kind a reporter sends (the rest are counted)
COVERAGE_BUCKETS = 4096  # hash buckets of the coverage terms exchanged when the digest is off


MAX_SAME = 12  # values `agree` compares between ranks (``same``): a fixed number of slots, so a fixed size


def agree(problems: Problems, what: str, group: dist.ProcessGroup | None = None, *,
          coverage: dict[str, tuple[int, int]] | None = None,
          buffer_prints: list[tuple[str, int]] | None = None, same: Sequence[tuple[str | None, str]] = (),
          prints_kind: str = "buffers", generic: str | None = None) -> None:
    """Raise the same `RestoreError` on every rank if any rank has a problem, the ranks' plans do not
    cover every tensor exactly (``coverage``: `check.coverage_terms`), a non-persistent buffer differs
    between ranks (``buffer_prints``: (name, fingerprint) pairs; ``prints_kind``: what they are, "buffers", or
    "replicas" for a save's replicated parameters), or a value of ``same`` (pairs ``(value, what it means if it
    differs)``, at most `MAX_SAME`: the checkpoint version each rank opened, the options it was called with) is not the
    same text on every rank that has one (a value None: this rank failed before it could say, and is left out of
    that comparison). Every rank calls it at the same point of the protocol, with its ``same`` in the same order
    and the same texts. Where ranks failed and also differ in a value of ``same`` (ranks given different files
    fail on what differs between them), the difference is said first, it being the cause, where every rank holds
    the same texts (a rank that failed at another point of the protocol, such as a bad argument refused at the
    door, holds other ones or none: then the failures alone are said). ``what`` heads the error
    ("restore of run/x.safetensors"); where it is not the same text on every rank (each rank was given its own
    file), ``generic`` ("restore") does instead, so that every rank raises the same text.

    Success costs one all-reduce of 47 integers. Failure costs a bounded number of small collectives,
    whatever the world size: no rank gathers anything per rank (see `_reports`). A rank whose ``problems`` met a
    KeyboardInterrupt raises that, from the verdict, once every rank has it."""
    try:
        _agree(problems, what, group, coverage=coverage, buffer_prints=buffer_prints, same=same,
               prints_kind=prints_kind, generic=generic)
    except RestoreError as e:
        if problems.interrupted:
            raise KeyboardInterrupt(str(e)) from e
        raise


def _agree(problems: Problems, what: str, group: dist.ProcessGroup | None, *,
           coverage: dict[str, tuple[int, int]] | None, buffer_prints: list[tuple[str, int]] | None,
           same: Sequence[tuple[str | None, str]], prints_kind: str = "buffers", generic: str | None = None) -> None:
    if len(same) > MAX_SAME:
        raise ValueError(f"agree compares at most {MAX_SAME} values, not {len(same)}")
    rank, world = _rank(group)
    d1, d2 = coverage_digest(coverage or {})
    fp = sum(_print_weight(i) * v for i, (_, v) in enumerate(sorted(buffer_prints or []))) % FINGERPRINT_MODULUS
    n = len(buffer_prints or [])
    # each value as (v, v*v, 1), or (0, 0, 0) where this rank has none: compared among the ranks that have one
    slots = [(zlib.crc32(value.encode()) % FINGERPRINT_MODULUS, 1) if value is not None else (0, 0)
             for value, _ in same]
    slots += [(0, 0)] * (MAX_SAME - len(slots))
    wording = zlib.crc32("\0".join(text for _, text in same).encode()) % FINGERPRINT_MODULUS  # what a difference says
    head = zlib.crc32(what.encode()) % FINGERPRINT_MODULUS  # the headline: the last two integers
    values = ([int(bool(problems)), d1, d2, fp, fp * fp, n, n * n] + [x for v, has in slots for x in (v, v * v, has)]
              + [wording, wording * wording, head, head * head])
    with _collective(what, "agreeing on the verdict"):
        summed = _all_reduce(values, group) if world > 1 else values
    failing, s1, s2, f1, f2, n1, n2 = summed[:7]
    if generic is not None and not _same_everywhere(summed[-2], summed[-1], world):
        what = generic
    differing = [same[i][1] if i < len(same) else "(the ranks compared different values: a bug)"
                 for i in range(MAX_SAME) if not _same_everywhere(*summed[7 + 3 * i:7 + 3 * i + 2], summed[9 + 3 * i])]
    if failing:
        with _collective(what, "collecting the failing ranks' problems"):
            reports, counts = _reports(problems.items, bool(problems), failing, group, rank, world)
        if differing and _same_everywhere(summed[-4], summed[-3], world):  # the cause, first; each rank's own after
            reports = {"error": differing + reports.get("error", []),
                       **{kind: texts for kind, texts in reports.items() if kind != "error"}}
            if "error" in counts:
                counts["error"] = (counts["error"][0] + len(differing), counts["error"][1])
        _raise(reports, what, counts=counts)
    if differing:
        _raise({"error": differing}, what)
    if s1 % DIGEST_PRIME or s2 % DIGEST_PRIME:
        with _collective(what, "finding the tensors the plans do not cover"):
            uncovered = _uncovered_names(coverage or {}, group, rank, world)
        _raise({"coverage": uncovered}, what)
    if not _same_everywhere(f1, f2, world):
        # the per-buffer all-reduce needs the same number of buffers on every rank
        with _collective(what, "finding the buffers that differ between ranks"):
            differing = _differing_buffers(buffer_prints or [], _same_everywhere(n1, n2, world), group, world)
        _raise({prints_kind: differing}, what)


def _same_everywhere(total: int, total_of_squares: int, world: int) -> bool:
    """Whether every rank contributed the same value, from the sums of the values and of their squares
    over ``world`` ranks (or over the ranks that contributed one): equal exactly then (Cauchy-Schwarz)."""
    return world * total_of_squares == total * total


def _print_weight(i: int) -> int:
    return (2654435761 * (i + 1)) % FINGERPRINT_MODULUS or 1


def _capped(items: dict[str, list[str]]) -> tuple[dict[str, list[str]], dict[str, int], dict[str, str]]:
    """At most `TEXTS_PER_KIND` distinct texts per kind, how many distinct texts each kind has, and a digest of
    each kind's whole set of them (ranks that hold the same set, such as the same missing names, say so exactly)."""
    distinct = {kind: list(dict.fromkeys(texts)) for kind, texts in items.items()}
    return ({kind: texts[:TEXTS_PER_KIND] for kind, texts in distinct.items()},
            {kind: len(texts) for kind, texts in distinct.items()},
            {kind: hashlib.sha256("\0".join(sorted(texts)).encode("utf-8", "surrogatepass")).hexdigest()
             for kind, texts in distinct.items()})


def _lowest_ranks(mine: bool, group: dist.ProcessGroup | None, rank: int, world: int, count: int) -> list[int]:
    """The ``count`` lowest ranks for which ``mine`` holds: one all-reduce (MIN) of one integer per round,
    so that no rank ever holds a list of every rank's anything."""
    found: list[int] = []
    for _ in range(count):
        candidate = rank if mine and rank not in found else world
        t = torch.tensor([candidate], dtype=torch.int64, device=_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        low = int(t.item())
        if low >= world:
            break
        found.append(low)
    return found


def _from_ranks(obj: object, senders: list[int], group: dist.ProcessGroup | None, rank: int) -> list:
    """Each sender's ``obj``, on every rank (one broadcast per sender)."""
    out = []
    for sender in senders:
        box = [obj if rank == sender else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, sender) if group is not None else sender,
                                   group=group, device=_device(group))
        out.append(box[0])
    return out


def _reports(items: dict[str, list[str]], mine: bool, failing: int, group: dist.ProcessGroup | None, rank: int,
             world: int) -> tuple[dict[str, list[str]], dict[str, tuple[int, bool]]]:
    """The problems of the (at most `REPORTERS`) lowest failing ranks, merged in rank order (per-rank kinds
    tagged with the ranks that saw them), and how many there are of each kind, ``(count, exact)``: the texts
    shown plus the most any one reporter held back, exact where one reporter sent the kind or none held any
    back (else a floor: what they held back may be names already shown, as with replicated parameters, or other
    ones). Every rank gets the same text."""
    if world == 1:
        return dict(items), {}
    reporters = _lowest_ranks(mine, group, rank, world, min(REPORTERS, failing))
    sent = _from_ranks(_capped(items), reporters, group, rank)
    by_text: dict[str, dict[str, list[int]]] = {}
    held: dict[str, list[tuple[int, int]]] = {}  # per reporter: (how many it holds, how many it held back)
    sets: dict[str, set[str]] = {}  # per kind: the digests of the reporters' whole sets
    for sender, (rank_items, rank_counts, digests) in zip(reporters, [s or ({}, {}, {}) for s in sent]):
        for kind, texts in rank_items.items():
            bucket = by_text.setdefault(kind, {})
            for text in texts:
                bucket.setdefault(text, []).append(sender)  # texts are distinct per sender (_capped)
            held.setdefault(kind, []).append((rank_counts[kind], rank_counts[kind] - len(texts)))
            sets.setdefault(kind, set()).add(digests[kind])
    merged: dict[str, list[str]] = {}
    counts: dict[str, tuple[int, bool]] = {}
    if failing > len(reporters):  # first: it must not fall among the texts a long list leaves out
        merged["error"] = [f"({failing} ranks failed; the problems of the first {len(reporters)} are shown)"]
    for kind, texts in by_text.items():
        lines = merged.setdefault(kind, [])
        extra = len(lines)  # the line on the ranks that did not report
        # a problem every rank may share (a missing name) is tagged too where some ranks did not fail: the ranks'
        # models or files differ, and the rank that holds the odd one is what the user must find
        tagged = kind in _PER_RANK or failing < world
        lines.extend(f"{text} [{_ranks_text(ranks, world)}]" if tagged else text for text, ranks in texts.items())
        # exact where one reporter sent the kind, or none held any back; else a floor: the distinct texts shown,
        # or the most one reporter holds (what several held back may be names already shown, or other ones)
        exact = len(held[kind]) == 1 or not any(back for _, back in held[kind]) or (
            len(sets[kind]) == 1 and len(held[kind]) == len(reporters))  # every reporter held the same set
        counts[kind] = (extra + max(len(texts), max(n for n, _ in held[kind])), exact)
    return merged, counts


def problem_line(label: str, items: Sequence[str], count: tuple[int, bool] | None = None, limit: int = 20) -> str:
    """``label (count): the first `limit` items, ... (N more)``; ``count``: ``(how many, exact)`` where ``items``
    holds only some of them (a floor when not exact: "at least")."""
    total, exact = count if count is not None else (len(items), True)
    total = max(total, len(items))
    more = total - min(limit, len(items))
    about = "" if exact else "at least "
    if more:
        tail = f", ... ({about}{more} more)"
    elif not exact:  # all of the floor is shown, but a rank held names back that may be others
        tail = ", ... (perhaps more, held back on the ranks)"
    else:
        tail = ""
    return f"{label} ({about}{total}): {', '.join(items[:limit])}{tail}"


def _uncovered_names(coverage: dict[str, tuple[int, int]], group: dist.ProcessGroup | None, rank: int,
                     world: int) -> list[str]:
    """The tensors whose coverage terms do not sum to zero over the ranks. The terms are summed in hash
    buckets (one fixed-size all-reduce); the names in buckets that do not sum to zero are sent by the
    lowest ranks that hold any."""
    if world == 1:
        return sorted(n for n, (a, b) in coverage.items() if a % DIGEST_PRIME or b % DIGEST_PRIME) or [
            "(the digest differs, no single tensor does)"]
    buckets = torch.zeros(COVERAGE_BUCKETS, 2, dtype=torch.int64)
    slot = {name: name_weight(name, b"bucket") % COVERAGE_BUCKETS for name in coverage}
    for name, (a, b) in coverage.items():
        buckets[slot[name], 0] += a % DIGEST_PRIME
        buckets[slot[name], 1] += b % DIGEST_PRIME
    t = buckets.to(_device(group))
    dist.all_reduce(t, group=group)
    off = set(torch.nonzero((t.cpu() % DIGEST_PRIME).any(dim=1)).view(-1).tolist())
    suspects = sorted(n for n in coverage if slot[n] in off)
    names: set[str] = set()
    for sent in _from_ranks(suspects[:TEXTS_PER_KIND * 5], _lowest_ranks(bool(suspects), group, rank, world, 2),
                            group, rank):
        names.update(sent or [])
    return sorted(names) or ["(the digest differs, no single tensor does)"]


def _differing_buffers(prints: list[tuple[str, int]], same_count: bool, group: dist.ProcessGroup | None,
                       world: int) -> list[str]:
    """Buffers whose fingerprint differs between ranks: per buffer, the sums of v and v^2 over the ranks
    (one all-reduce as long as the model's buffer list, not the world)."""
    ordered = sorted(prints)
    if not same_count:
        return ["(the ranks hold different sets of buffers)"]
    t = torch.tensor([[v, v * v] for _, v in ordered] or [[0, 0]], dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, group=group)
    sums = t.cpu().tolist()
    return [f"{name} differs between ranks" for (name, _), (s, q) in zip(ordered, sums)
            if not _same_everywhere(s, q, world)] or [
        "(the ranks hold different sets of buffers)"]


def _ranks_text(ranks: list[int], world: int) -> str:
    if len(ranks) == world and world > 1:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _raise(problems: dict[str, list[str]], what: str, *, counts: dict[str, tuple[int, bool]] | None = None
           ) -> None:
    """Raise one `RestoreError` listing every kind of problem (`problem_line`); ``counts``: how many problems
    of a kind there are where ``problems`` holds only some of them (the ranks' reports)."""
    problems = {k: v for k, v in problems.items() if v}
    if not problems:
        return
    counts = {kind: (counts or {}).get(kind, (len(items), True)) for kind, items in problems.items()}
    lines = [f"{what} failed:"]
    hints = []
    for kind, items in problems.items():
        label = _LABELS.get(kind, kind)
        lines.append(f"  {label}: {'; '.join(items)}" if kind in _CONTEXT else
                     "  " + problem_line(label, items, counts[kind]))
        hint = _HINTS.get(kind)
        if hint and hint not in hints:
            hints.append(hint)
    lines.extend(f"  hint: {h}" for h in hints)
    # the context lines are in the text only: the error's problems are the problems
    raise RestoreError("\n".join(lines), {k: v for k, v in problems.items() if k not in _CONTEXT},
                       {k: v for k, v in counts.items() if k not in _CONTEXT})
