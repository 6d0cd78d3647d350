"""A slab KV cache: keys and values of `slots` sequences of up to `max_len` positions each, for
every layer, in two preallocated tensors `[layers, slots, max_len, kv_heads, head_dim]`.

A sequence takes one slot when it joins and gives it back when it leaves; its length is how many
positions of the slot hold keys. Slab, not paged: the budget is spent in whole slots of `max_len`
(SmolLM2-135M in float32: 30 layers x 3 kv heads x 64 x 2 (keys, values) x 4 bytes = 45 KB a
position, 94 MB a slot of 2,048), which wastes what short sequences leave unused; a paged pool
would not, at the cost of a gather per step.
"""

from __future__ import annotations

import torch

from ..errors import InvalidRequest, Overloaded


class SlabCache:
    """Slots of keys and values (see the module docstring)."""

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
        if slots < 1 or max_len < 1:
            raise ValueError(f"a KV cache needs at least one slot of one position (slots={slots}, max_len={max_len})")
        shape = (num_layers, slots, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = [0] * slots  # positions filled, per slot
        self._free = list(range(slots - 1, -1, -1))  # a stack: the lowest slot first

    @staticmethod
    def slots_for(
        budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, itemsize: int
    ) -> int:
        """How many slots of `max_len` positions fit in `budget_bytes` (keys and values)."""
        per_slot = 2 * num_layers * max_len * num_kv_heads * head_dim * itemsize
        return budget_bytes // per_slot

    @property
    def slots(self) -> int:
        return len(self.lengths)

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def alloc(self, length: int) -> int:
        """A free slot for a sequence that will reach `length` positions."""
        self.check(length)
        if not self._free:
            raise Overloaded(f"all {self.slots} KV cache slots are in use; retry shortly", retry_after_s=1.0)
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def check(self, length: int) -> None:
        """InvalidRequest if a sequence of `length` positions cannot fit a slot."""
        if length > self.max_len:
            raise InvalidRequest(
                f"the prompt and max_new_tokens need {length} positions; this model's context holds {self.max_len}: "
                "shorten the prompt or ask for fewer new tokens",
                details={"positions": length, "context": self.max_len},
            )

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"KV cache slot {slot} is already free")
        self.lengths[slot] = 0
        self._free.append(slot)
