"""What a writer sends: a value as parts written in order, never joined (`Parts`).

Either buffers that exist already (a serialized chunk's header and its tensor's memory), or
`Pieces`: parts made as they are written, e.g. a sealed blob encrypted one piece at a time into
one buffer reused piece after piece, rather than into a whole sealed copy of the value. A writer
learns the total from `nbytes_of` before writing (a frame or a RESP header carries it), then
writes each part before taking the next, and keeps none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import chain

Buffer = bytes | bytearray | memoryview


class Pieces:
    """`nbytes` bytes made by `make` as they are taken: each iteration makes them again from the
    start (the same bytes, so a writer may retry), and a piece is valid only until the next one
    is taken."""

    def __init__(self, nbytes: int, make: Callable[[], Iterator[Buffer]]) -> None:
        self.nbytes = nbytes
        self._make = make

    def __iter__(self) -> Iterator[Buffer]:
        return self._make()


Parts = Sequence[Buffer] | Pieces


def nbytes_of(parts: Parts) -> int:
    """The total length of `parts`."""
    if isinstance(parts, Pieces):
        return parts.nbytes
    return sum(memoryview(p).nbytes for p in parts)


def prefixed(head: Sequence[Buffer], parts: Parts) -> Parts:
    """`head` followed by `parts` (a list where both are buffers already)."""
    if isinstance(parts, Pieces):
        return Pieces(nbytes_of(head) + parts.nbytes, lambda: chain(head, parts))
    return [*head, *parts]
