"""TensorBoard scalar event files, written without TensorFlow.

An event file is a TFRecord stream of `Event` protocol buffers:
  record = uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
  Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
  Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
Only scalars are written; TensorBoard reads the files from the workdir.
"""

import os
import socket
import struct
import time

_CRC32C_POLY = 0x82F63B78


def _crc32c_table() -> list[int]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ (_CRC32C_POLY if crc & 1 else 0)
    table.append(crc)
  return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli) of `data`."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
  out = bytearray()
  while True:
    bits = value & 0x7F
    value >>= 7
    if value:
      out.append(bits | 0x80)
    else:
      out.append(bits)
      return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
  return _varint((number << 3) | wire_type)


def _length_delimited(number: int, payload: bytes) -> bytes:
  return _field(number, 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int, scalars: dict[str, float] | None = None,
                 file_version: str | None = None) -> bytes:
  """Serialised Event protocol buffer."""
  event = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
  if file_version is not None:
    event += _length_delimited(3, file_version.encode())
  if scalars:
    summary = b"".join(
        _length_delimited(1, _length_delimited(1, tag.encode())
                          + _field(2, 5) + struct.pack("<f", value))
        for tag, value in scalars.items())
    event += _length_delimited(5, summary)
  return event


def frame_record(data: bytes) -> bytes:
  """One TFRecord: length, its masked CRC, the data, its masked CRC."""
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", masked_crc32c(length)) + data
          + struct.pack("<I", masked_crc32c(data)))


class EventFileWriter:
  """Appends scalar summaries to DIR/events.out.tfevents.<time>.<host>."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
    self.path = os.path.join(logdir, name)
    self._file = open(self.path, "ab")
    self._file.write(frame_record(encode_event(time.time(), 0, file_version="brain.Event:2")))
    self._file.flush()

  def scalars(self, step: int, values: dict[str, float]) -> None:
    self._file.write(frame_record(encode_event(time.time(), step, values)))
    self._file.flush()

  def close(self) -> None:
    self._file.close()
