"""The output folder of a conversion: checked before any work (check_output); it is written into a staging sibling
named by STAGING and renamed when complete (stages/write.py), and staging folders left by killed conversions are
removed."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from ...models.pretrained import source_folder

logger = logging.getLogger(__name__)

STAGING = ".{name}.partial-{pid}-"  # staging folder of a conversion in progress: OUT's name and the writer's pid


def check_output(source: str, out: Path, overwrite: bool) -> None:
    """Refuse, before any work, an OUT that would overwrite or nest with the source, that is a file, that exists
    (without overwrite) or that cannot be written; remove staging folders left by conversions that were killed."""
    target, src = out.resolve(), source_folder(source)
    if src is not None and (target == src or target in src.parents or src in target.parents):
        relation = "is" if target == src else "contains" if target in src.parents else "lies inside"
        raise ValueError(
            f"out={str(out)!r} {relation} the source {str(src)!r}: the source is never modified; "
            f"choose an OUT outside it"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} is a file, not a folder: choose another OUT")
    if out.exists() and not overwrite:
        raise ValueError(f"out={str(out)!r} exists: pass overwrite=True (--overwrite) to replace it")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"out={str(out)!r} cannot be written: {str(parent)!r} is not a writable folder")
    if target.parent.exists():
        _remove_stale_staging(target)


def _remove_stale_staging(target: Path) -> None:
    prefix = f".{target.name}.partial-"
    for folder in target.parent.glob(prefix + "*"):
        pid = folder.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            logger.warning("removing %s, left by conversion process %s that no longer runs", folder, pid)
            shutil.rmtree(folder, ignore_errors=True)
        else:
            logger.warning("%s: the staging folder of another conversion to the same OUT (in progress?)", folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
