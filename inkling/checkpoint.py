"""Checkpoint I/O: a streaming sharded safetensors writer and a validating lazy reader.

The writer knows every tensor's name, shape and dtype in advance (`layout.checkpoint_tensors`), so it
plans the shards and their headers first and then appends each tensor's bytes as it arrives: it never
holds more than the one tensor it is given. The reader checks a checkpoint against its config.json
without reading any tensor data, then loads tensors one at a time with plain reads.
Nothing here unpickles: a checkpoint is data, never code.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

Spec = tuple[tuple[int, ...], torch.dtype]  # a tensor's shape and dtype

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 10**9
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
_WRITE_CHUNK = 64 * 2**20
_MAX_LISTED = 5

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float8_e4m3fn: "F8_E4M3",
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, inconsistent or does not match its config."""


def _listed(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


# Writing.


@dataclass
class ShardPlan:
    """One shard: its file name, header bytes and each tensor's absolute offset in the file."""

    file_name: str
    names: list[str]
    header: bytes = b""
    offsets: dict[str, int] = field(default_factory=dict)  # name -> file offset of its first byte
    size: int = 0  # file size once complete


def _encode_header(specs: Mapping[str, Spec], names: list[str]) -> tuple[bytes, dict[str, int], int]:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    rel: dict[str, int] = {}
    end = 0
    for name in names:
        shape, dtype = specs[name]
        if dtype not in DTYPE_TO_ST:
            raise CheckpointError(
                f"{name}: dtype {dtype} is not supported; expected one of {list(DTYPE_TO_ST)}"
            )
        n = _nbytes(shape, dtype)
        header[name] = {"dtype": DTYPE_TO_ST[dtype], "shape": list(shape), "data_offsets": [end, end + n]}
        rel[name] = end
        end += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    blob = struct.pack("<Q", len(text)) + text
    return blob, {name: len(blob) + off for name, off in rel.items()}, len(blob) + end


def plan_shards(specs: Mapping[str, Spec], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[ShardPlan]:
    """Greedy shards in the order of `specs`; a tensor larger than `max_shard_bytes` gets a shard alone."""
    groups: list[list[str]] = []
    size = 0
    for name, (shape, dtype) in specs.items():
        n = _nbytes(shape, dtype)
        if not groups or (size + n > max_shard_bytes and size > 0):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    plans = []
    for i, names in enumerate(groups):
        header, offsets, total = _encode_header(specs, names)
        plans.append(ShardPlan(shard_name(i, len(groups)), names, header, offsets, total))
    return plans


class ShardedWriter:
    """Streams tensors into planned safetensors shards, then writes the index.

    Tensors may arrive in any order (each lands at its planned offset); in plan order the files grow
    sequentially. `close()` checks that every planned tensor was written and writes the index.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        specs: Mapping[str, Spec],
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> None:
        self.out_dir = os.fspath(out_dir)
        self.specs = {name: (tuple(shape), dtype) for name, (shape, dtype) in specs.items()}
        if not self.specs:
            raise CheckpointError("nothing to write: the tensor plan is empty")
        self.shards = plan_shards(self.specs, max_shard_bytes)
        self._shard_of = {name: i for i, s in enumerate(self.shards) for name in s.names}
        self._written: set[str] = set()
        self._started: set[int] = set()
        self._file: Any = None
        self._file_shard = -1
        self.closed = False
        os.makedirs(self.out_dir, exist_ok=True)

    @property
    def total_bytes(self) -> int:
        return sum(_nbytes(shape, dtype) for shape, dtype in self.specs.values())

    def _open(self, shard: int) -> Any:
        if self._file_shard != shard:
            if self._file is not None:
                self._file.close()
            path = os.path.join(self.out_dir, self.shards[shard].file_name)
            if shard in self._started:
                self._file = open(path, "r+b")
            else:
                self._file = open(path, "wb")
                self._file.write(self.shards[shard].header)
                self._started.add(shard)
            self._file_shard = shard
        return self._file

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.closed:
            raise CheckpointError(f"write({name!r}) after close()")
        if name not in self.specs:
            raise CheckpointError(f"tensor {name!r} is not in the plan")
        if name in self._written:
            raise CheckpointError(f"tensor {name!r} written twice")
        shape, dtype = self.specs[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(
                f"tensor {name!r}: planned {list(shape)} {dtype}, got {list(tensor.shape)} {tensor.dtype}"
            )
        shard = self._shard_of[name]
        f = self._open(shard)
        f.seek(self.shards[shard].offsets[name])
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        view = memoryview(data)
        for start in range(0, len(view), _WRITE_CHUNK):
            f.write(view[start : start + _WRITE_CHUNK])
        self._written.add(name)

    def close(self) -> None:
        """Finish: every planned tensor must have been written. Writes model.safetensors.index.json."""
        if self.closed:
            return
        self.abort()
        missing = [n for n in self.specs if n not in self._written]
        if missing:
            raise CheckpointError(
                f"closing with {len(missing)} planned tensors not written: {_listed(missing)}"
            )
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {name: self.shards[self._shard_of[name]].file_name for name in self.specs},
        }
        with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")

    def abort(self) -> None:
        """Close the open file without finishing (the directory is left incomplete)."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self._file_shard = -1
        self.closed = True

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


# Reading.


@dataclass(frozen=True)
class TensorInfo:
    shard: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    offset: int  # of its data in the shard file


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header and check that the file holds all its data."""
    name = os.path.basename(path)
    try:
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated ({file_size} bytes), no safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise CheckpointError(
                    f"{path}: header length {header_len} does not fit a file of {file_size} bytes"
                )
            header = json.loads(f.read(header_len))
    except FileNotFoundError as e:
        raise CheckpointError(f"shard file {path} does not exist") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    out: dict[str, TensorInfo] = {}
    data_end = 0
    for tname, entry in header.items():
        if tname == "__metadata__":
            continue
        try:
            dtype = ST_TO_DTYPE[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: bad or unsupported header entry for {tname!r}: {entry}") from e
        nbytes = _nbytes(shape, dtype)
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(f"{path}: {tname} has data_offsets {[begin, end]} for {nbytes} bytes")
        out[tname] = TensorInfo(name, shape, dtype, nbytes, 8 + header_len + begin)
        data_end = max(data_end, end)
    expected = 8 + header_len + data_end
    if file_size != expected:
        what = "truncated" if file_size < expected else "has trailing bytes"
        raise CheckpointError(f"{path}: {what}: {file_size} bytes, its header describes {expected}")
    return out


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"no {what} at {path}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def _shard_files(directory: str) -> dict[str, list[str]]:
    """shard file -> names the index assigns to it (or the single model.safetensors)."""
    index_path = os.path.join(directory, INDEX_FILE)
    if not os.path.exists(index_path):
        if os.path.exists(os.path.join(directory, SINGLE_FILE)):
            return {SINGLE_FILE: []}
        raise CheckpointError(f"{directory} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    index = _read_json(index_path, INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has no weight_map object")
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index_path}: {name} maps to {shard!r}, not a file name in the directory")
        shards.setdefault(shard, []).append(name)
    return shards


class CheckpointReader:
    """A validated checkpoint directory; tensors are read lazily, one at a time. A layout's reader
    (inkling.published.checkpoint.PublishedCheckpoint) opens it: it sets `path` and `config`, reads the
    shards' headers (`_read_headers`), checks them against the tensors its config names (`_check_against`,
    without reading tensor data) and keeps their order (`_order`)."""

    path: str
    config: Any
    _info: dict[str, TensorInfo]
    _order: list[str]
    _handles: dict[str, int]  # shard -> file descriptor

    def _read_headers(self) -> dict[str, TensorInfo]:
        info: dict[str, TensorInfo] = {}
        for shard, indexed in _shard_files(self.path).items():
            found = read_header(os.path.join(self.path, shard))
            if indexed:
                absent = [n for n in indexed if n not in found]
                if absent:
                    raise CheckpointError(
                        f"{INDEX_FILE} maps tensors to {shard} that it does not hold: {_listed(absent)}"
                    )
                unlisted = sorted(set(found) - set(indexed))
                if unlisted:
                    raise CheckpointError(
                        f"{shard} holds tensors that {INDEX_FILE} does not map to it: {_listed(unlisted)}"
                    )
            for name, t in found.items():
                if name in info:
                    raise CheckpointError(f"tensor {name} is in both {info[name].shard} and {shard}")
                info[name] = t
        return info

    def _check_against(self, expected: Mapping[str, Spec]) -> None:
        missing = [n for n in expected if n not in self._info]
        extra = sorted(n for n in self._info if n not in expected)
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"{len(missing)} missing tensors: {_listed(missing)}")
            if extra:
                parts.append(f"{len(extra)} unexpected tensors: {_listed(extra)}")
            raise CheckpointError(f"{self.path} does not match its config.json: " + "; ".join(parts))
        wrong = []
        for name, (shape, dtype) in expected.items():
            t = self._info[name]
            if t.shape != tuple(shape) or t.dtype != dtype:
                wrong.append(f"{name}: expected {list(shape)} {dtype}, found {list(t.shape)} {t.dtype}")
        if wrong:
            more = f" (and {len(wrong) - _MAX_LISTED} more)" if len(wrong) > _MAX_LISTED else ""
            raise CheckpointError(
                f"{self.path}: {len(wrong)} tensors with the wrong shape or dtype: "
                + "; ".join(wrong[:_MAX_LISTED])
                + more
            )

    def keys(self) -> list[str]:
        """Every tensor name, in `expected_tensors` order."""
        return list(self._order)

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def _tensor_info(self, name: str) -> TensorInfo:
        if name not in self._info:
            raise KeyError(f"no tensor {name!r} in {self.path}")
        return self._info[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensor_info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._tensor_info(name).dtype

    def nbytes(self, name: str) -> int:
        return self._tensor_info(name).nbytes

    def shard_of(self, name: str) -> str:
        return self._tensor_info(name).shard

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self._info.values())

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor as stored, read into its own buffer with plain reads (not mmap, so a streaming
        pass over a checkpoint larger than memory holds one tensor, not every page it touched)."""
        info = self._tensor_info(name)
        if info.shard not in self._handles:
            self._handles[info.shard] = os.open(os.path.join(self.path, info.shard), os.O_RDONLY)
        fd = self._handles[info.shard]
        data = torch.empty(info.nbytes, dtype=torch.uint8)
        view = memoryview(data.numpy())
        done = 0
        while done < info.nbytes:
            n = os.preadv(fd, [view[done:]], info.offset + done)
            if n <= 0:
                raise CheckpointError(f"{info.shard}: unexpected end of file reading {name}")
            done += n
        tensor = data.view(info.dtype).reshape(info.shape)
        return tensor if torch.device(device).type == "cpu" else tensor.to(device)

    def close(self) -> None:
        for fd in self._handles.values():
            os.close(fd)
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) for v in value)


def load_generation_config(path: str | os.PathLike) -> dict[str, Any]:
    """generation_config.json of a checkpoint directory: bos/eos/pad token ids and max_new_tokens."""
    file = os.path.join(os.fspath(path), GENERATION_CONFIG_FILE)
    data = _read_json(file, GENERATION_CONFIG_FILE)
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_new_tokens"):
        value = data.get(key)
        ok = value is None or isinstance(value, int) or (key == "eos_token_id" and _int_list(value))
        if not ok:
            raise CheckpointError(f"{file}: {key} must be an integer, got {value!r}")
    return data


def write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _publish(tmp: str, out: str) -> None:
    """Move the finished temp dir to `out`, replacing an old one only once the new one is complete."""
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=f".{os.path.basename(out)}.old-")
        os.rmdir(old)
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old)


@contextmanager
def atomic_checkpoint_dir(out: str | os.PathLike, force: bool = False) -> Iterator[str]:
    """A temp dir beside `out` to write a checkpoint into; it replaces `out` once the block completes, and
    is removed if it fails. An existing non-empty `out` needs `force`."""
    out = os.path.abspath(os.fspath(out))
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out) and not force):
        raise FileExistsError(f"{out} exists and is not empty; pass --force to replace it")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out)}.tmp-")
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the checkpoint is not
    try:
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
