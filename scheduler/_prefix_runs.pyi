from collections.abc import Sequence
from typing import TypeVar

V = TypeVar("V")

def prefix_runs(holders: dict[bytes, V], hashes: Sequence[bytes], /) -> list[tuple[int, V | None]]: ...
