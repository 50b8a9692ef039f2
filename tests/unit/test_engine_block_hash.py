import hashlib
import random
import struct
import subprocess
import sys

import pytest

from engine.block_hash import BLOCK_HASH_SEED, hash_block, prefix_block_hashes

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


@pytest.mark.parametrize(("tokens", "message"), [([-1] * 4, "unsigned 32-bit"), ([2**32] * 4, "unsigned 32-bit"),
                                                 ([1.0] * 4, "integers"), (["1"] * 4, "integers")])  # fmt: skip
def test_the_native_chain_refuses_what_hash_block_refuses(tokens: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prefix_block_hashes(tokens, 4)
