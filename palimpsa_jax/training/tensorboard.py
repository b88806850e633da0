"""TensorBoard scalar event files, written without TensorFlow.

An event file is a TFRecord stream of `Event` protocol buffers:
  record = uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
  Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
  Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
Only scalars are written; TensorBoard reads the files from the workdir. A
resumed run continues the newest event file, after dropping the events past the
restored step (drop_events_after), so each step appears once.
"""

import glob
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


def read_records(path: str) -> list[bytes]:
  """The data of each complete TFRecord in `path` (a torn last record is left out)."""
  with open(path, "rb") as f:
    data = f.read()
  records, offset = [], 0
  while offset + 12 <= len(data):
    (length,) = struct.unpack_from("<Q", data, offset)
    end = offset + 12 + length + 4
    if end > len(data):
      break
    records.append(data[offset + 12:end - 4])
    offset = end
  return records


def _read_varint(data: bytes, offset: int) -> tuple[int, int]:
  value, shift = 0, 0
  while True:
    byte = data[offset]
    offset += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if not byte & 0x80:
      return value, offset


def event_step(event: bytes) -> int:
  """The `step` field of a serialised Event (0 when absent)."""
  offset = 0
  while offset < len(event):
    key, offset = _read_varint(event, offset)
    number, wire_type = key >> 3, key & 7
    if wire_type == 0:
      value, offset = _read_varint(event, offset)
      if number == 2:
        return value
    elif wire_type == 1:
      offset += 8
    elif wire_type == 5:
      offset += 4
    elif wire_type == 2:
      length, offset = _read_varint(event, offset)
      offset += length
    else:
      raise ValueError(f"unsupported protobuf wire type {wire_type} in an event")
  return 0


def event_files(logdir: str) -> list[str]:
  """The event files in `logdir`, oldest first (by the creation time in the name)."""
  def created(path):
    stamp = os.path.basename(path).split(".")[3]
    return (int(stamp) if stamp.isdigit() else 0, path)
  paths = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
  return sorted((p for p in paths if not p.endswith(".partial")), key=created)


def drop_events_after(logdir: str, step: int) -> None:
  """Rewrites the event files in `logdir` without their events past `step`."""
  for path in event_files(logdir):
    records = read_records(path)
    kept = [r for r in records if event_step(r) <= step]
    torn = os.path.getsize(path) != sum(16 + len(r) for r in records)
    if len(kept) == len(records) and not torn:
      continue
    partial = path + ".partial"
    with open(partial, "wb") as f:
      f.write(b"".join(frame_record(r) for r in kept))
    os.replace(partial, path)


class EventFileWriter:
  """Appends scalar summaries to DIR/events.out.tfevents.<time>.<host>, continuing
  the newest event file in DIR if there is one (one event stream per run)."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    existing = event_files(logdir)
    if existing:
      self.path = existing[-1]
      self._file = open(self.path, "ab")
      return
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
