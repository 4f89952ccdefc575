"""Reading a validated checkpoint's tensors with plain reads, not mmap.

`CheckpointReader.get` maps the shards: every page the converter touched would stay mapped, and so
resident in the process, until the end, and a streaming pass over a checkpoint larger than memory
would look like it holds all of it. Here each tensor's bytes are read (`os.preadv`, the GIL released)
into a fresh buffer that is freed with the tensor, and come back exactly as stored.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from inkling.checkpoint import CheckpointReader


class RawTensorReader:
    """`read(name)`: the tensor as stored (dtype, shape, bytes), read from its shard without mmap."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self._files: dict[str, int] = {}  # shard -> file descriptor
        self._offsets: dict[str, dict[str, tuple[int, int]]] = {}  # shard -> name -> absolute [begin, end)

    def _layout(self, shard: str) -> tuple[int, dict[str, tuple[int, int]]]:
        if shard not in self._files:
            fd = os.open(os.path.join(self.reader.path, shard), os.O_RDONLY)
            self._files[shard] = fd
            (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, header_len, 8))
            start = 8 + header_len
            self._offsets[shard] = {
                name: (start + entry["data_offsets"][0], start + entry["data_offsets"][1])
                for name, entry in header.items()
                if name != "__metadata__"
            }
        return self._files[shard], self._offsets[shard]

    def read(self, name: str) -> torch.Tensor:
        fd, offsets = self._layout(self.reader.shard_of(name))
        begin, end = offsets[name]
        data = torch.empty(end - begin, dtype=torch.uint8)
        view = memoryview(data.numpy())
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], begin + done)
            if n <= 0:
                raise OSError(f"{self.reader.shard_of(name)}: unexpected end of file reading {name}")
            done += n
        return data.view(self.reader.dtype(name)).reshape(self.reader.shape(name))

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def __enter__(self) -> RawTensorReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
