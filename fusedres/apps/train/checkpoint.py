"""Checkpoints that cannot run code, cannot be half-written and are not trusted unread.

Files ``<run>/checkpoints/iter_<iteration>.pt``, written to a temporary file in the same folder,
flushed to disk, then renamed over the final name (atomic on POSIX), so a kill at any moment
leaves either the old set or the new one. The newest ``keep`` are kept. Loading uses
``torch.load(weights_only=True)``: only tensors and plain containers, never a pickled object.

Each checkpoint carries a digest of its content (key ``digest``: SHA-256 over every other field,
tensors by dtype, shape and bytes: :func:`content_digest`), computed when it is written and
checked when it is loaded. torch.save's zip archive records CRC-32s that torch.load does not
check, so without it a byte flipped on disk inside a tensor loads as a slightly different
weight. A mismatch is refused naming the file. Then every field the trainer reads back is checked
by type (:mod:`.resume_checks`; a resume checks the values against the run too) before the
caller uses any of it. Checkpoints of fusedres versions before the digest have none: they are
loaded with those field checks only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
import torch

from . import resume_checks

__all__ = ["CheckpointError", "CheckpointWriteError", "FORMAT", "RunWriteError", "content_digest",
           "latest", "list_checkpoints", "load", "remove_stale_temporaries", "rng_state", "save",
           "set_rng_state", "write_atomically", "writing"]

FORMAT = "fusedres-train-checkpoint"
VERSION = 1
DIGEST = "digest"
_NAME = re.compile(r"iter_(\d+)\.pt")
# The temporary files of write_atomically (a ".tmp-" prefix) and of the metrics log's rewrite
# (a ".tmp" suffix): what a killed run leaves behind.
_TEMPORARY = re.compile(r"\.tmp-.*|metrics\.(jsonl|csv)\.tmp")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and why."""


class RunWriteError(OSError):
    """A file of the run (checkpoint, metrics log, config.yaml, summary) that could not be
    written (a full disk, a quota, a read-only mount): the message names the file and the
    cause. The trainer reports it as one line and exits 1."""


class CheckpointWriteError(RunWriteError):
    """A checkpoint that could not be written: the message names the file, the cause and the
    previous checkpoint, which is left intact."""


def os_error_of(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: ``e`` itself, or the one torch.save's RuntimeError
    was raised from. torch.save writes through its C++ zip writer, which turns the file
    object's OSError (a full disk) into ``RuntimeError: [enforce fail at inline_container.cc]
    ... unexpected pos``, the OSError kept as its context. None for any other error."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError):
            return e
        if not isinstance(e, RuntimeError):
            return None
        e = e.__cause__ or e.__context__
        seen += 1
    return None


@contextlib.contextmanager
def writing(path: str | Path):
    """Turns an OSError raised inside the block (or torch.save's RuntimeError raised from one:
    :func:`os_error_of`) into a :class:`RunWriteError` naming ``path`` (one that already
    names its file passes through)."""
    try:
        yield
    except RunWriteError:
        raise
    except (OSError, RuntimeError) as e:
        cause = os_error_of(e)
        if cause is None:
            raise
        err = RunWriteError(f"cannot write {str(path)!r}: {cause.strerror or cause}")
        err.errno = cause.errno
        raise err from None


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint files of a run, oldest first (by iteration)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def latest(run_dir: str | Path) -> Path | None:
    files = list_checkpoints(run_dir)
    return files[-1] if files else None


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(f)`` into a temporary file in ``path``'s folder, flushed to disk, then renamed
    over ``path``: a reader (or a kill at any moment) sees the old file or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def content_digest(payload: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` of every field of ``payload`` but the digest itself, in an encoding
    that depends on content only: each value tagged with its kind, containers with their
    length and in their order (torch.load gives dicts back in the order saved), floats in
    their exact hex form, tensors as dtype, shape and the bytes of their values (not their
    strides or storage). Raises TypeError for a value of another kind (a checkpoint holds
    tensors and plain containers only)."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in payload.items() if k != DIGEST})
    return "sha256:" + h.hexdigest()


def _feed(h, v: Any) -> None:
    if isinstance(v, torch.Tensor):
        t = v.detach()
        h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(v, Mapping):
        h.update(f"D{len(v)};".encode())
        for key, value in v.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(v, (list, tuple)):
        h.update(f"L{len(v)};".encode())
        for item in v:
            _feed(h, item)
    elif isinstance(v, str):
        b = v.encode()
        h.update(f"S{len(b)};".encode() + b)
    elif v is None or isinstance(v, (bool, torch.dtype, torch.device)):
        h.update(f"O{v!r};".encode())
    elif isinstance(v, int):
        h.update(f"I{v};".encode())
    elif isinstance(v, float):
        h.update(f"F{v.hex()};".encode())
    else:
        raise TypeError(f"a checkpoint cannot hold a {type(v).__name__}")


def save(run_dir: str | Path, state: dict[str, Any], iteration: int, keep: int) -> Path:
    """Write ``state`` atomically as the checkpoint of ``iteration``, with its content's
    digest; prune to ``keep`` files."""
    folder = checkpoint_dir(run_dir)
    final = folder / f"iter_{iteration:08d}.pt"
    payload = {"format": FORMAT, "version": VERSION, "iteration": iteration, **state}
    payload[DIGEST] = content_digest(payload)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(final, lambda f: torch.save(payload, f))
    except (OSError, RuntimeError) as e:
        cause = os_error_of(e)
        if cause is None:
            raise
        # write_atomically removed its temporary file and never touched the older ones (pruning
        # comes after a successful write): say so, with the newest one a resume would use.
        prev = latest(run_dir)
        kept = (f"the previous checkpoint {str(prev)!r} is intact" if prev is not None
                else "no earlier checkpoint exists")
        err = CheckpointWriteError(f"cannot write checkpoint {str(final)!r}: "
                                   f"{cause.strerror or cause}; {kept}")
        err.errno = cause.errno
        raise err from None
    for old in list_checkpoints(run_dir)[:-keep]:
        with contextlib.suppress(OSError):  # a checkpoint kept too many ends no run
            old.unlink(missing_ok=True)
    return final


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Delete the temporary files a killed run left in ``run_dir`` and its checkpoints folder
    (write_atomically's ``.tmp-*``, the metrics log's ``metrics.*.tmp``): a kill between a
    temporary file's creation and its rename leaves it, and nothing else ever reads it. Only
    for a run directory whose lock this process holds: another trainer's are in use. Returns
    the files removed."""
    removed = []
    for folder in (Path(run_dir), checkpoint_dir(run_dir)):
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if _TEMPORARY.fullmatch(p.name) and p.is_file():
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p)
    return removed


# How every file torch.save writes begins: a zip archive's first local header.
_ZIP_MAGIC = b"PK\x03\x04"


def _unreadable(path: Path, e: Exception) -> str:
    """Why torch.load could not read ``path`` (raising ``e``), in a few words."""
    with open(path, "rb") as f:
        head = f.read(len(_ZIP_MAGIC))
    if not head:
        return "it is empty"
    if head != _ZIP_MAGIC:
        # torch.load reads a file that is no zip archive as a pickle of torch's legacy format,
        # and weights_only then refuses its first byte: not a sign of pickled objects.
        return "it is not a file torch.save writes (it does not begin as a zip archive)"
    text = str(e)
    if "Weights only load failed" in text or "Unsupported global" in text:
        return "it holds pickled objects, not a fusedres training checkpoint"
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    # torch's first sentence (its long advice after it would be cut mid-word).
    return f"it is truncated or corrupt ({first.split('. ')[0]})"


def load(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save`, its digest checked and every field the trainer
    reads back checked by type (:func:`resume_checks.check_payload`); :class:`CheckpointError`
    names the file and says what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        why = _unreadable(path, e)
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded: {why}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r} is not a fusedres training checkpoint "
                              "(no 'format' marker)")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has version {payload.get('version')}, "
                              f"this fusedres reads version {VERSION}")
    if DIGEST in payload:
        try:
            matches = payload[DIGEST] == content_digest(payload)
        except TypeError as e:
            raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {e}") from None
        if not matches:
            raise CheckpointError(f"checkpoint {str(path)!r} is damaged: its content does not "
                                  "match the digest written with it")
    missing = [k for k in ("iteration", "model", "optimizer", "config") if k not in payload]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks {', '.join(missing)}")
    try:
        resume_checks.check_payload(payload)
    except resume_checks.FieldError as e:
        raise CheckpointError(f"checkpoint {str(path)!r} is not usable: {e}") from None
    return payload


def rng_state() -> dict[str, Any]:
    """Every random generator's state, as tensors and plain values (weights_only-loadable)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
