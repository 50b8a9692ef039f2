import hashlib
import random
import struct
import subprocess
import sys

import pytest

from engine.block_hash import (
    BLOCK_HASH_SEED,
    hash_block,
    packed_block_hashes,
    packed_token_ids,
    prefix_block_hashes,
)
from engine.request import Request
from engine.sampling import SamplingParams
from kvconductor.v1 import conductor_pb2

GOLDEN_FIRST_BLOCK = "e8332a3d847160bd9f01c6bf445eec08b277e69ffaa9d0b28d96a6e5279e3f7b"
GOLDEN_SECOND_BLOCK = "00e89ec6b1276fa500ed34fc76b59897782be204a343bcdaa30fda4ff25b4c6a"


def test_golden_vectors() -> None:
    assert BLOCK_HASH_SEED == b"kvconductor/block-hash/v1"
    assert hash_block(None, []).hex() == "bddad0dd1dba72a0d2487ca6999664bb9fe6aab9fb6efa60433de22f8989bca5"
    assert hash_block(None, [0, 1, 2, 3]).hex() == GOLDEN_FIRST_BLOCK
    assert hash_block(bytes(32), [2**32 - 1, 7]).hex() == (
        "8361d376ef4bc17bcb028b8e561f03cc7fb219e21ff93eb097aac012be71bbb9"
    )


def test_spec_is_sha256_of_parent_and_le_uint32() -> None:
    root = hashlib.sha256(BLOCK_HASH_SEED).digest()
    first = hashlib.sha256(root + struct.pack("<4I", 0, 1, 2, 3)).digest()
    second = hashlib.sha256(first + struct.pack("<4I", 4, 5, 6, 7)).digest()
    assert [h.hex() for h in prefix_block_hashes(list(range(10)), 4)] == [first.hex(), second.hex()]
    assert second.hex() == GOLDEN_SECOND_BLOCK


def test_full_blocks_only_and_chained() -> None:
    assert prefix_block_hashes([1, 2, 3], 4) == []
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # the second hash covers the first block too


def test_stable_across_processes() -> None:
    code = "from engine.block_hash import hash_block; print(hash_block(None, [0, 1, 2, 3]).hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == GOLDEN_FIRST_BLOCK


def test_block_hash_does_not_import_torch() -> None:
    code = "import sys, engine.block_hash; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="unsigned 32-bit"):
        hash_block(None, [-1])
    with pytest.raises(ValueError, match="32-byte"):
        hash_block(b"short", [1])
    with pytest.raises(ValueError, match="block_size"):
        prefix_block_hashes([1], 0)


@pytest.mark.parametrize("block_size", [1, 4, 16, 33])
def test_the_native_chain_equals_hash_block_block_after_block(block_size: int) -> None:
    rng = random.Random(block_size)
    tokens = [rng.choice([0, 1, 2**31, 2**32 - 1, rng.randrange(2**32)]) for _ in range(700)]
    expected, parent = [], None
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        expected.append(parent)
    assert prefix_block_hashes(tokens, block_size) == expected
    assert prefix_block_hashes(tuple(tokens), block_size) == expected
    # continued from any block's hash: the rest of the chain
    cut = len(expected) // 3
    rest = tokens[cut * block_size :]
    assert prefix_block_hashes(rest, block_size, expected[cut - 1] if cut else None) == expected[cut:]


def test_a_request_hashes_its_blocks_step_by_step_as_the_whole_sequence_at_once() -> None:
    """An engine extends a request's hashes at every step, across its prompt and its output."""
    rng = random.Random(5)
    request = Request("r", [rng.randrange(2**32) for _ in range(37)], SamplingParams())
    for step in range(40):
        request.output_token_ids.append(rng.randrange(2**32))
        request.full_block_hashes(4, 37 + step // 3)  # some steps complete no block, some several
    whole = request.prompt_token_ids + request.output_token_ids
    assert request.full_block_hashes(4, len(whole)) == prefix_block_hashes(whole, 4)
    assert request.tokens(30, 45) == whole[30:45]


@pytest.mark.parametrize(("tokens", "message"), [([-1] * 4, "unsigned 32-bit"), ([2**32] * 4, "unsigned 32-bit"),
                                                 ([1.0] * 4, "integers"), (["1"] * 4, "integers")])  # fmt: skip
def test_the_native_chain_refuses_what_hash_block_refuses(tokens: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prefix_block_hashes(tokens, 4)


def _varint(value: int) -> bytes:
    out = b""
    while value > 0x7F:
        out, value = out + bytes([value & 0x7F | 0x80]), value >> 7
    return out + bytes([value])


def test_ids_packed_from_the_wire_hash_as_the_list_does() -> None:
    ids = [random.Random(3).randrange(2**32) for _ in range(1000)] + [0, 1, 127, 128, 2**32 - 1]
    wire = conductor_pb2.TokenIds(ids=ids).SerializeToString()  # packed, as protobuf writes repeated uint32
    packed = packed_token_ids(wire, 2**32)
    assert packed == struct.pack(f"<{len(ids)}I", *ids)
    assert packed_block_hashes(packed, 16) == prefix_block_hashes(ids, 16)
    # unpacked ids and fields of every other wire type (skipped) read the same
    unpacked = b"".join(b"\x08" + _varint(i) for i in ids[:50])
    others = b"\x10\x05" + b"\x1a\x03abc" + b"\x25abcd" + b"\x29" + bytes(8)
    assert packed_token_ids(others + unpacked + others, 2**32) == struct.pack("<50I", *ids[:50])
    assert packed_token_ids(b"", 10) == b""


@pytest.mark.parametrize("wire", [b"\x0a\x05\x01", b"\x08", b"\x08\xff", b"\x0b", b"\x29abc", b"\x08" + b"\xff" * 11])
def test_a_malformed_wire_is_a_value_error(wire: bytes) -> None:
    with pytest.raises(ValueError, match="malformed"):
        packed_token_ids(wire, 2**32)


def test_the_first_id_outside_the_vocabulary_is_named() -> None:
    wire = conductor_pb2.TokenIds(ids=[3, 9, 10, 12]).SerializeToString()
    with pytest.raises(ValueError, match=r"token id 10 is outside the vocabulary \(size 10\)"):
        packed_token_ids(wire, 10)
    with pytest.raises(ValueError, match="whole uint32s"):
        packed_block_hashes(b"abc", 1)
