"""Training metrics to experiment trackers: TensorBoard event files (always; written here, no
TensorBoard needed to write them) and Weights & Biases when ``[train] wandb_project`` is set
(offline, into the output, when there is no ``WANDB_API_KEY``).

An event file is a TFRecord stream of ``Event`` protocol buffers: each record is its length,
a masked CRC-32C of the length, the bytes, and a masked CRC-32C of the bytes. The few fields a
scalar needs are encoded by hand below.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

from eagleops.pipeline.errors import ConfigError

__all__ = ["TensorBoardWriter", "Trackers", "crc32c"]


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, *, file_version: str | None = None, scalars: dict[str, float] | None = None) -> bytes:
    out = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    if scalars:
        values = b"".join(
            _length_delimited(1, _length_delimited(1, tag.encode()) + _field(2, 5) + struct.pack("<f", value))
            for tag, value in scalars.items()
        )
        out += _length_delimited(5, values)
    return out


class TensorBoardWriter:
    """Scalars into ``directory/events.out.tfevents.*``, flushed every write (a kill loses nothing)."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.eagleops"
        self._file = open(self.path, "ab")
        self._write(_event(time.time(), 0, file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", _masked(header)) + data + struct.pack("<I", _masked(data)))
        self._file.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._write(_event(time.time(), step, scalars=values))

    def close(self) -> None:
        self._file.close()


class Trackers:
    """Every configured tracker; ``log`` takes a train record (lists become one scalar per TTT step).

    The wandb run's id is kept in ``wandb-run-id`` beside the event files, so a resumed train
    and the eval after it add to the same run instead of starting new ones."""

    def __init__(self, directory: Path, *, wandb_project: str = "", run_name: str = "", config: dict[str, Any] | None = None):
        self.tensorboard = TensorBoardWriter(directory / "tensorboard")
        self.wandb: Any = None
        if wandb_project:
            self.wandb = _wandb_run(directory, wandb_project, run_name, config or {})

    @staticmethod
    def flatten(record: dict[str, Any]) -> dict[str, float]:
        values: dict[str, float] = {}
        for key, value in record.items():
            if key in ("step", "epoch"):
                continue
            if isinstance(value, (list, tuple)):
                values.update({f"{key}/ttt_{i}": float(v) for i, v in enumerate(value)})
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                values[key] = float(value)
        return values

    def log(self, step: int, record: dict[str, Any]) -> None:
        values = self.flatten(record)
        self.tensorboard.scalars(step, values)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
            # finish() returns while wandb's service may still be writing the run's file (a read
            # right after saw only its header, 1 time in 6); teardown waits for the service to end
            import wandb

            wandb.teardown()


def _wandb_run(directory: Path, project: str, run_name: str, config: dict[str, Any]) -> Any:
    try:
        import wandb
    except ImportError:
        raise ConfigError("[train] wandb_project is set but wandb is not installed: pip install wandb") from None
    id_file = directory / "wandb-run-id"
    if not id_file.exists():
        id_file.write_text(os.urandom(6).hex() + "\n")
    run_id = id_file.read_text().strip()
    # a mode the user set wins; otherwise online only with a key to go online with
    mode: Any = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    # silent and no console capture: wandb's lines would tear the console's screen
    settings = wandb.Settings(silent=True, console="off")
    return wandb.init(
        project=project, name=run_name or None, id=run_id, resume="allow", dir=str(directory), mode=mode, config=config, settings=settings
    )
