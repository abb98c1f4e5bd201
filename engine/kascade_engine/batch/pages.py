"""Pages: the KV cache's allocator, pure python (no torch). The cache is `pages` fixed-size pages of
`page_size` token slots; each sequence owns a block table (its pages, in position order).

Data flow: the scheduler asks `fits(seq, tokens)` / `grow(seq, tokens)` before it schedules tokens of a
sequence (admission by free pages), `free(seq)` on finish, abort or preemption; the engine turns a
block table into slot indices (`slot = page * page_size + offset`) for the torch cache (kvcache.py).
Page 0 is never handed out: its first slot stays zero and pads gathers, so padding never reads garbage.
Sliding-window models (every layer attends to the last W positions only) hand back pages no future query
can see with `drop_before(seq, pos)`: the table keeps its length (positions still index it) and the
dropped entries become 0, which gathers read as the zero slot.
"""

from __future__ import annotations


class PagePool:
    def __init__(self, pages: int, page_size: int) -> None:
        if pages < 2 or page_size < 1:
            raise ValueError(f"a page pool needs >= 2 pages of >= 1 slot, got {pages} x {page_size}")
        self.pages, self.page_size = pages, page_size
        self._free = list(range(pages - 1, 0, -1))  # pop() hands out low pages first
        self.tables: dict[str, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        return (self.pages - 1) * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.pages - 1 - len(self._free)

    @property
    def usage(self) -> float:
        return self.used_pages / (self.pages - 1)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def missing(self, seq: str, tokens: int) -> int:
        """Pages `seq` still needs to hold `tokens` positions."""
        return max(0, self.pages_for(tokens) - len(self.tables.get(seq, ())))

    def grow(self, seq: str, tokens: int) -> bool:
        """Give `seq` enough pages for `tokens` positions; all or nothing."""
        table = self.tables.get(seq)
        if table is not None and len(table) * self.page_size >= tokens:
            return True  # most decode steps: the last page has room
        need = self.missing(seq, tokens)
        if need > len(self._free):
            return False
        table = self.tables.setdefault(seq, [])
        table.extend(self._free.pop() for _ in range(need))
        return True

    def free(self, seq: str) -> int:
        table = [p for p in self.tables.pop(seq, []) if p]
        self._free.extend(reversed(table))
        return len(table)

    def drop_before(self, seq: str, pos: int) -> int:
        """Free `seq`'s pages whose every position is < `pos` (outside the window of any later query)."""
        table = self.tables.get(seq)
        if not table:
            return 0
        dropped = 0
        for i in range(min(max(0, pos) // self.page_size, len(table))):
            if table[i]:
                self._free.append(table[i])
                table[i] = 0
                dropped += 1
        return dropped

    def held(self, seq: str) -> int:
        """Pages `seq` holds now (dropped entries not counted)."""
        return sum(1 for p in self.tables.get(seq, ()) if p)

    def add_pages(self, n: int) -> None:
        """A growable pool (one split sequence's private cache) gets `n` more pages."""
        self._free[:0] = range(self.pages + n - 1, self.pages - 1, -1)
        self.pages += n
