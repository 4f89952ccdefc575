"""The output directory: written in a temp dir beside it and renamed into place; the side files copied."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import ConvertError


def check_output_path(model_dir: str, output_dir: str, force: bool) -> None:
    """Refuse an existing output without --force, and any output that would overwrite the input."""
    src, out = os.path.realpath(model_dir), os.path.realpath(output_dir)
    if out == src or src.startswith(out + os.sep):
        raise ConvertError(f"--output_dir {output_dir} would overwrite the input checkpoint {model_dir}")
    if os.path.lexists(output_dir) and not force:
        raise ConvertError(f"--output_dir {output_dir} already exists: pass --force to replace it")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


@contextmanager
def atomic_output_dir(output_dir: str, force: bool) -> Iterator[str]:
    """Yields a temp dir beside `output_dir`; on success it becomes `output_dir`, on failure it is removed."""
    out = os.path.abspath(output_dir)
    parent, base = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is not
    try:
        yield tmp
        if os.path.lexists(out):
            if not force:
                raise ConvertError(
                    f"--output_dir {output_dir} appeared while converting: pass --force to replace it"
                )
            old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
            os.rename(out, os.path.join(old, base))
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        if os.path.lexists(tmp):
            _remove(tmp)
        raise


def copy_side_files(model_dir: str, out_dir: str, skip: set[str]) -> list[str]:
    """Copy the checkpoint's non-weight files (tokenizer.json, generation_config.json, ...) but `skip`."""
    copied = []
    for name in sorted(os.listdir(model_dir)):
        src = os.path.join(model_dir, name)
        if name in skip or name.startswith(".") or name.endswith(".safetensors") or not os.path.isfile(src):
            continue
        shutil.copy2(src, os.path.join(out_dir, name))
        copied.append(name)
    return copied
