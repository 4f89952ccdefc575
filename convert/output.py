"""The output directory: written in a temp dir beside it and renamed into place, with a manifest."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from .errors import ConvertError

MANIFEST_FILE = "manifest.json"
_HASH_CHUNK = 8 * 2**20
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str | int) -> int:
    """'2GB' -> 2_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000 (as Hugging Face counts)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ConvertError(f"cannot read the size {text!r}: expected e.g. 2GB, 500MB, 4GiB or a byte count")
    size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if size <= 0:
        raise ConvertError(f"size must be positive, got {text!r}")
    return size


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


def write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(out_dir: str, num_threads: int = 2) -> dict[str, dict[str, Any]]:
    """manifest.json: {file: {size, sha256}} for every other file of the directory (hashlib drops the GIL)."""
    files = sorted(
        os.path.relpath(os.path.join(root, f), out_dir) for root, _, names in os.walk(out_dir) for f in names
    )
    files = [f for f in files if f != MANIFEST_FILE]
    paths = [os.path.join(out_dir, f) for f in files]
    with ThreadPoolExecutor(max(1, num_threads)) as pool:
        digests = list(pool.map(sha256_file, paths))
    manifest = {f: {"size": os.path.getsize(p), "sha256": d} for f, p, d in zip(files, paths, digests)}
    write_json(os.path.join(out_dir, MANIFEST_FILE), manifest)
    return manifest
