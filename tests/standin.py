"""`StandIn`: an in-memory `Service` for tests of the API without the engine.

No torch, no tokenizers, no `shoal.engine`: each text's vector is drawn from a generator seeded by
a hash of the model id and the text, so it is the same in every process and can be recomputed by
the test (`StandIn.vector`). Options are honoured as the engine honours them: Matryoshka
`dimensions` (truncate before normalising), `normalize` (default: the model's), and `output_dtype`
float32 / float16 / int8 (scaled so the largest component is ±127) / binary (sign bits, packbits).
Only dense output is served. "Tokens" are whitespace words plus two special tokens per text.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np

from shoal.calls import AnyCall, AnyResult, EncodeCall, EncodedItem, EncodeResult
from shoal.errors import InvalidRequest, UnknownModel
from shoal.metrics import Metrics
from shoal.service import Capacity, ModelStatus
from shoal.vectors import OUTPUT_DTYPES, finish

MODELS = (
    ModelStatus(
        id="standin/dense-16", tasks=("encode",), outputs=("dense",), max_length=64, verified="unverified",
        loaded=False, architecture="standin", dimensions=16, pooling="mean",
        description="16 hashed dimensions, normalised by default",
    ),
    ModelStatus(
        id="standin/dense-8-raw", tasks=("encode",), outputs=("dense",), max_length=32, verified="unverified",
        loaded=False, architecture="standin", dimensions=8, pooling="cls",
        description="8 hashed dimensions, not normalised by default",
    ),
)
# Whether each model normalises when a call leaves `normalize` unset (a card's `normalize`).
NORMALIZES = {"standin/dense-16": True, "standin/dense-8-raw": False}
MAX_QUEUED_TOKENS = 100_000


def count_tokens(text: str) -> int:
    return len(text.split()) + 2  # [CLS] words [SEP]


class StandIn:
    """A `shoal.service.Service` that computes hashed vectors in process; it records what it gets."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self._models = {status.id: status for status in MODELS}
        self._started = False
        self._stopped = False
        self.warmed: list[str] = []
        self.calls: list[AnyCall] = []

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._started = True

    async def stop(self) -> None:
        self._stopped = True

    async def warm(self, model_ids: list[str]) -> None:
        for model_id in model_ids:
            self._status(model_id)
            if model_id not in self.warmed:
                self.warmed.append(model_id)

    @property
    def ready(self) -> bool:
        return self._started and not self._stopped

    @property
    def stopped(self) -> bool:
        return self._stopped

    # --- Service ---------------------------------------------------------------------------------

    def models(self) -> list[ModelStatus]:
        return [msgspec.structs.replace(status, loaded=status.id in self.warmed) for status in MODELS]

    def has_model(self, model_id: str) -> bool:
        return model_id in self._models

    def capacity(self) -> Capacity:
        return Capacity(queued_tokens=0, max_queued_tokens=MAX_QUEUED_TOKENS, tokens_per_s=None)

    async def run(self, call: AnyCall) -> AnyResult:
        if not isinstance(call, EncodeCall):
            raise InvalidRequest(f"the stand-in does not serve {type(call).__name__} calls")
        status = self._status(call.model)
        if call.outputs not in (None, ("dense",)):
            raise InvalidRequest(f"{call.model} outputs only dense vectors", details={"outputs": list(call.outputs)})
        if call.dimensions is not None and not 1 <= call.dimensions <= status.dimensions:
            raise InvalidRequest(
                f"dimensions {call.dimensions} is outside 1..{status.dimensions} for {call.model}",
                details={"option": "dimensions", "max": status.dimensions},
            )
        normalize = NORMALIZES.get(call.model, True) if call.normalize is None else call.normalize
        self.calls.append(call)
        items = [
            EncodedItem(dense=self.vector(call.model, text, dimensions=call.dimensions, normalize=normalize,
                                          output_dtype=call.output_dtype))
            for text in call.texts
        ]
        num_tokens = sum(count_tokens(text) for text in call.texts)
        self.metrics.tokens.labels(call.model).inc(num_tokens)
        self.metrics.items.labels(call.model).inc(len(call.texts))
        return EncodeResult(items=items, num_tokens=num_tokens, request_id=call.request_id)

    # --- the vectors -----------------------------------------------------------------------------

    @staticmethod
    def raw_vector(model_id: str, text: str, num_dims: int) -> np.ndarray:
        """`[num_dims]` float32, seeded by blake2b(model id, text): stable across processes."""
        digest = hashlib.blake2b(f"{model_id}\0{text}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        return rng.standard_normal(num_dims).astype(np.float32)

    @classmethod
    def vector(cls, model_id: str, text: str, *, dimensions: int | None = None, normalize: bool | None = None,
               output_dtype: str = "float32") -> np.ndarray:
        """What `run` answers for `text` with these options (None: the model's default)."""
        num_dims = next(status.dimensions for status in MODELS if status.id == model_id)
        v = cls.raw_vector(model_id, text, num_dims)
        if output_dtype not in OUTPUT_DTYPES:
            raise InvalidRequest(f"output_dtype {output_dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
        normalize = NORMALIZES.get(model_id, True) if normalize is None else normalize
        return finish(v, dimensions=dimensions, normalize=normalize, output_dtype=output_dtype)

    def _status(self, model_id: str) -> ModelStatus:
        try:
            return self._models[model_id]
        except KeyError:
            raise UnknownModel(f"unknown model {model_id!r}", details={"model": model_id}) from None
