"""Writing files and folders so that a crash never leaves a half-written one under the real name.

Everything mixerzoo writes that a later run reads back (checkpoints, token caches, tokenizers, export folders,
evaluation results) goes through here: the content is written next to its destination under a temporary name
and renamed into place (``os.replace`` is atomic within one file system, which is why the temporary file is
in the destination's own folder and not in ``/tmp``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["atomic_write", "atomic_write_path", "atomic_folder"]


def atomic_write_path(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Create or replace the file ``path`` by calling ``write(tmp_path)`` (a path in the same folder), fsync-ing
    it and renaming it into place. On any failure the temporary file is removed and ``path`` is as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_write(path: str | os.PathLike, write: Callable) -> Path:
    """Like :func:`atomic_write_path`, with ``write(f)`` given the temporary file opened in binary mode."""

    def to_file(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            write(f)

    return atomic_write_path(path, to_file)


def check_folder_target(out_dir: str | os.PathLike, may_replace: Callable[[Path], bool] = lambda p: False,
                        what: str = "folder mixerzoo wrote") -> Path:
    """The resolved ``out_dir`` when :func:`atomic_folder` may write it (absent, empty, or ``may_replace``): a
    caller with a long computation before the write checks first, so that a refusal comes before the work.

    Raises:
        FileExistsError: ``out_dir`` exists, is not empty and ``may_replace`` refuses it.
    """
    out = Path(os.path.expanduser(os.fspath(out_dir))).resolve()
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or may_replace(out))):
        raise FileExistsError(f"{out} exists and is not a {what}; choose another output folder (a previous "
                              f"{what} is replaced, anything else is left alone)")
    return out


def atomic_folder(out_dir: str | os.PathLike, write: Callable[[Path], None],
                  may_replace: Callable[[Path], bool] = lambda p: False, what: str = "folder mixerzoo wrote") -> Path:
    """Create ``out_dir`` by calling ``write(tmp_folder)`` on a temporary folder next to it, then renaming.

    An existing ``out_dir`` is replaced only after ``write`` returned, and only when it is empty or
    ``may_replace(out_dir)`` says so (``what`` names such a folder in the error; moved aside, the new folder renamed in, the old one deleted); if anything
    fails the temporary folder is removed and ``out_dir`` is as it was.

    Raises:
        FileExistsError: ``out_dir`` exists, is not empty and ``may_replace`` refuses it (never overwritten).
    """
    out = check_folder_target(out_dir, may_replace, what)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / "previous")
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(old / "previous", out)
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
