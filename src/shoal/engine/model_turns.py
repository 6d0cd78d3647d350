"""Which of a device's lanes may run a batch on a model now: batches of one model run side by side,
except a batch that routes LoRA adapters. Those hooks are installed on the model for one forward
(layers/lora.py), so such a batch waits for the model's running batches to end and has it to itself;
no batch starts on the model meanwhile, so the adapter batch never waits for long.
"""

from __future__ import annotations

import threading


class ModelTurns:
    """The models in use by a device's lanes, by `id(model)`, guarded by the device's lock."""

    def __init__(self, lock: threading.RLock) -> None:
        self._turn = threading.Condition(lock)  # a model's batch ended (a lane may wait to run one)
        self._shared: dict[int, int] = {}  # id(model): its batches running side by side
        self._held: set[int] = set()  # id(model): a batch with adapters waits for or has it alone

    def clear(self) -> None:
        """Forget every model in use (new lanes start with none)."""
        self._shared.clear()
        self._held.clear()

    def enter(self, model: object, alone: bool) -> None:
        """Wait until `model` may run this lane's batch: beside its other batches, or, for a batch
        with adapters (`alone`), once the batches running on it have ended."""
        key = id(model)
        with self._turn:
            while key in self._held:
                self._turn.wait()
            if alone:
                self._held.add(key)
                while self._shared.get(key):
                    self._turn.wait()
            else:
                self._shared[key] = self._shared.get(key, 0) + 1

    def leave(self, model: object, alone: bool) -> None:
        """This lane's batch on `model` ended (`alone` as it entered)."""
        key = id(model)
        with self._turn:
            if alone:
                self._held.discard(key)
            elif self._shared[key] > 1:
                self._shared[key] -= 1
            else:
                del self._shared[key]
            self._turn.notify_all()
