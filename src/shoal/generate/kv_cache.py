"""KV caches: keys and values of up to `slots` sequences, every layer, in two preallocated pools of
positions `[layers, positions, kv_heads, head_dim]`, handed out in blocks.

    PagedCache  blocks of `block_size` positions; a sequence takes the blocks its prompt and
                max_new_tokens need when it joins (so it never runs out mid-way) and gives them
                back when it leaves. The pool is sized in positions, not in sequences of the
                longest context: 32 chats of ~300 positions fit where 8 slots of 2,048 did.
    SlabCache   one block of `max_len` positions per slot (a PagedCache with block_size max_len):
                what short sequences leave unused is wasted

A sequence is a slot (a row of the block table); its length is how many of its positions hold
keys. The forward reads and writes positions through `flat` and `gather_index` (indices into the
pools), the same for both. SmolLM2-135M in float32: 30 layers x 3 kv heads x 64 x 2 (keys, values)
x 4 bytes = 45 KB a position.
"""

from __future__ import annotations

import math

import torch

from ..errors import InvalidRequest, Overloaded


class PagedCache:
    """Pools of positions handed out in blocks (see the module docstring)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        slots: int,
        max_len: int,
        positions: int | None = None,
        block_size: int = 64,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        block_size = min(block_size, max_len)
        blocks = math.ceil((positions if positions is not None else slots * max_len) / block_size)
        if slots < 1 or max_len < 1 or blocks < 1:
            raise ValueError(f"a KV cache needs at least one slot of one position (slots={slots}, max_len={max_len})")
        shape = (num_layers, blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.block_size = block_size
        self.lengths = [0] * slots  # positions filled, per slot
        self._free = list(range(slots - 1, -1, -1))  # a stack: the lowest slot first
        self._free_blocks = list(range(blocks - 1, -1, -1))
        self._blocks: list[list[int]] = [[] for _ in range(slots)]
        # Each slot's blocks in order, padded with block 0 (what a padded gather reads is masked).
        self._table = torch.zeros((slots, math.ceil(max_len / block_size)), dtype=torch.long, device=device)

    @property
    def slots(self) -> int:
        return len(self.lengths)

    @property
    def in_use(self) -> int:
        """Slots held by sequences."""
        return self.slots - len(self._free)

    @property
    def positions(self) -> int:
        """Positions the pools hold."""
        return int(self.k.shape[1])

    @property
    def free_positions(self) -> int:
        return len(self._free_blocks) * self.block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check(self, length: int) -> None:
        """InvalidRequest if a sequence of `length` positions can never fit."""
        if length > self.max_len:
            raise InvalidRequest(
                f"the prompt and max_new_tokens need {length} positions; this model's context holds {self.max_len}: "
                "shorten the prompt or ask for fewer new tokens",
                details={"positions": length, "context": self.max_len},
            )
        if self._blocks_for(length) * self.block_size > self.positions:
            raise InvalidRequest(
                f"the prompt and max_new_tokens need {length} positions; this model's KV cache holds "
                f"{self.positions} in all: shorten the prompt or ask for fewer new tokens",
                details={"positions": length, "cache_positions": self.positions},
            )

    def fits(self, length: int) -> bool:
        """Whether a sequence of `length` positions could join now (a free slot and its blocks)."""
        return bool(self._free) and self._blocks_for(length) <= len(self._free_blocks)

    def alloc(self, length: int) -> int:
        """A free slot with the blocks for a sequence that will reach `length` positions."""
        self.check(length)
        if not self._free:
            raise Overloaded(f"all {self.slots} KV cache slots are in use; retry shortly", retry_after_s=1.0)
        need = self._blocks_for(length)
        if need > len(self._free_blocks):
            raise Overloaded(
                f"the KV cache has {self.free_positions} of {self.positions} positions free and this sequence "
                f"needs {length}; retry shortly",
                retry_after_s=1.0,
            )
        slot = self._free.pop()
        blocks = [self._free_blocks.pop() for _ in range(need)]
        self._blocks[slot] = blocks
        self._table[slot, :need] = torch.tensor(blocks, dtype=torch.long)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"KV cache slot {slot} is already free")
        self._free_blocks.extend(reversed(self._blocks[slot]))
        self._blocks[slot] = []
        self.lengths[slot] = 0
        self._free.append(slot)

    def reserved(self, slot: int) -> int:
        """Positions the slot's blocks hold (what it may fill, at most max_len)."""
        return min(self.max_len, len(self._blocks[slot]) * self.block_size)

    def flat(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each (slot, position)'s index into the pools."""
        return self._table[slots, positions // self.block_size] * self.block_size + positions % self.block_size

    def gather_index(self, slots: list[int], length: int) -> torch.Tensor:
        """`[len(slots), length]`: each slot's first `length` positions' indices into the pools
        (past a slot's blocks, block 0's: the attention masks them)."""
        positions = torch.arange(length, device=self._table.device)
        rows = self._table[torch.tensor(slots, device=self._table.device)]
        return rows[:, positions // self.block_size] * self.block_size + positions % self.block_size

    def held(self, slot: int) -> int:
        """Positions the slot's blocks take from the pools (what freeing it gives back)."""
        return len(self._blocks[slot]) * self.block_size

    def positions_for(self, length: int) -> int:
        """Positions a sequence that will reach `length` takes from the pools (whole blocks)."""
        return self._blocks_for(length) * self.block_size

    def span(self, slot: int, length: int) -> int | None:
        """The pool index of the slot's position 0 when its first `length` positions lie side by
        side in the pools (its blocks consecutive: what a sequence gets from an unfragmented pool),
        so they can be read as one slice instead of gathered; else None."""
        blocks = self._blocks[slot][: self._blocks_for(length)]
        if not blocks or blocks[-1] - blocks[0] != len(blocks) - 1 or blocks != sorted(blocks):
            return None
        return blocks[0] * self.block_size

    def _blocks_for(self, length: int) -> int:
        return max(1, math.ceil(length / self.block_size))


class SlabCache(PagedCache):
    """One block of `max_len` positions per slot."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__(
            num_layers,
            num_kv_heads,
            head_dim,
            slots=slots,
            max_len=max_len,
            positions=slots * max_len,
            block_size=max_len,
            dtype=dtype,
            device=device,
        )
