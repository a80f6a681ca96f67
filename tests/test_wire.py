"""The wire formats (`colocate.wire`): adapter layout, header and checksum, trajectory header."""
import pytest
import torch

from colocate.wire import (ADAPTER_HEADER_NUMEL, LoraSpec, RunFlags, adapter_header, checksum, encode_batch,
                           flatten_lora, parse_adapter_header, unflatten_lora)


def test_flatten_unflatten_roundtrip():
    tensors = {"b": torch.randn(3, 4), "a": torch.randn(5), "c": torch.randn(2, 2, 2)}
    spec = LoraSpec.of(tensors)
    assert spec.names == ("a", "b", "c") and spec.numel == 5 + 12 + 8
    flat = flatten_lora(tensors, spec)
    back = unflatten_lora(flat, spec)
    for n in tensors:
        assert torch.equal(back[n], tensors[n])
    assert back["a"].data_ptr() == flat.data_ptr()  # views, no copies
    flat2 = flat.clone()
    flat2[0] += 1e-3
    assert checksum(flat) != checksum(flat2)


def test_flat_buffer_of_another_layout_is_refused():
    spec = LoraSpec.of({"a": torch.zeros(4)})
    with pytest.raises(ValueError, match="not the spec"):
        flatten_lora(torch.zeros(5), spec)


def test_checksum_does_not_depend_on_the_chunking():
    flat = torch.randn(10_001, dtype=torch.float32)
    words = flat.view(torch.uint8).to(torch.int64)  # the definition, in one piece
    whole = int((words * (torch.arange(1, words.numel() + 1) % 65521)).sum())
    assert checksum(flat) == whole
    assert checksum(flat, chunk_bytes=4096) == whole and checksum(flat, chunk_bytes=7) == whole


def test_adapter_header_roundtrip_and_size_mismatch():
    spec = LoraSpec.of({"a": torch.zeros(3, 2, dtype=torch.bfloat16)})
    flat = torch.randn(6).to(torch.bfloat16)
    header = adapter_header(7, spec, flat, RunFlags.CHECKPOINT | RunFlags.STOP)
    assert header.shape == (ADAPTER_HEADER_NUMEL,) and header.dtype == torch.int64
    head = parse_adapter_header(header, spec)
    assert head.version == 7 and head.checksum == checksum(flat)
    assert head.flags == RunFlags.CHECKPOINT | RunFlags.STOP
    assert parse_adapter_header(adapter_header(1, spec, None, RunFlags.NONE), spec).checksum == 0
    other = LoraSpec.of({"a": torch.zeros(4, 2, dtype=torch.bfloat16)})
    with pytest.raises(RuntimeError, match="adapter size mismatch"):
        parse_adapter_header(header, other)


def test_trajectory_header_carries_flags_last():
    from tests.test_channel import _example_batch
    header, payload = encode_batch(_example_batch(), RunFlags.STOP)
    assert int(header[-1]) == RunFlags.STOP and len(payload) == int(header[0])
