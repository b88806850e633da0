"""TensorBoard event files: CRC, record framing, and protobuf decoding of our encoding."""

import struct

from google.protobuf import descriptor_pb2
from google.protobuf import descriptor_pool
from google.protobuf import message_factory
import pytest

from palimpsa_jax.training import tensorboard


def _event_class():
  """Event/Summary/Value as in tensorflow/core/util/event.proto (the fields we use)."""
  f = descriptor_pb2.FileDescriptorProto(name="tb_test_event.proto", package="tbtest")
  value = f.message_type.add(name="Value")
  value.field.add(name="tag", number=1, type=9, label=1)
  value.field.add(name="simple_value", number=2, type=2, label=1)
  summary = f.message_type.add(name="Summary")
  summary.field.add(name="value", number=1, type=11, label=3, type_name=".tbtest.Value")
  event = f.message_type.add(name="Event")
  event.field.add(name="wall_time", number=1, type=1, label=1)
  event.field.add(name="step", number=2, type=3, label=1)
  event.field.add(name="file_version", number=3, type=9, label=1)
  event.field.add(name="summary", number=5, type=11, label=1, type_name=".tbtest.Summary")
  pool = descriptor_pool.DescriptorPool()
  pool.Add(f)
  return message_factory.GetMessageClass(pool.FindMessageTypeByName("tbtest.Event"))


def _records(path):
  data = open(path, "rb").read()
  offset, out = 0, []
  while offset < len(data):
    (length,) = struct.unpack_from("<Q", data, offset)
    (length_crc,) = struct.unpack_from("<I", data, offset + 8)
    assert length_crc == tensorboard.masked_crc32c(data[offset:offset + 8])
    payload = data[offset + 12:offset + 12 + length]
    (payload_crc,) = struct.unpack_from("<I", data, offset + 12 + length)
    assert payload_crc == tensorboard.masked_crc32c(payload)
    out.append(payload)
    offset += 16 + length
  return out


def test_crc32c_known_vector():
  assert tensorboard.crc32c(b"123456789") == 0xE3069283


def test_event_file_decodes_with_protobuf(tmp_path):
  writer = tensorboard.EventFileWriter(str(tmp_path))
  writer.scalars(300, {"train/loss": 1.25, "eval/accuracy": 0.5})
  writer.close()
  event_class = _event_class()
  first, second = (event_class.FromString(r) for r in _records(writer.path))
  assert first.file_version == "brain.Event:2"
  assert second.step == 300 and second.wall_time > 0
  values = {v.tag: v.simple_value for v in second.summary.value}
  assert values == {"train/loss": 1.25, "eval/accuracy": pytest.approx(0.5)}
