"""``CrossEntropyLoss``: torch's semantics (mean over the targets that count,
``ignore_index=-100``), with the same forward/backward mechanism as the layers."""

from __future__ import annotations

import numpy as np

from attnlab._validation import as_float_array, shape_error
from attnlab.nn import functional as F
from attnlab.nn.module import Module


class CrossEntropyLoss(Module):
    """Mean negative log-likelihood of ``target`` under ``softmax(logits)``.

    ``logits`` ``(N, C)`` with ``target`` ``(N,)`` as in torch; also ``(..., C)`` with
    ``target`` ``(...)`` (flattened; torch wants the class axis second there). Targets equal
    to ``ignore_index`` do not count; if none counts the loss is NaN, as in torch.

    ``forward`` returns the loss as a Python float; ``backward(grad_output=1.0)`` returns
    ``dLoss/dlogits`` (times ``grad_output``).

    >>> loss_fn = CrossEntropyLoss()
    >>> round(loss_fn(np.zeros((2, 4)), np.array([1, -100])), 4)   # log(4)
    1.3863
    >>> loss_fn.backward().round(3)
    array([[ 0.25, -0.75,  0.25,  0.25],
           [ 0.  ,  0.  ,  0.  ,  0.  ]])
    """

    def __init__(self, *, ignore_index: int = -100):
        super().__init__()
        self.ignore_index = int(ignore_index)

    def forward(self, logits: np.ndarray, target: np.ndarray) -> float:
        logits = as_float_array(logits, "logits", min_ndim=1, layout="(N, C)")
        target = np.asarray(target)
        if not np.issubdtype(target.dtype, np.integer):
            raise TypeError(f"target must hold class indices (integers), got dtype {target.dtype}")
        if target.shape != logits.shape[:-1]:
            raise shape_error("target", target.shape, f"{logits.shape[:-1]} (logits without the class axis)")
        C = logits.shape[-1]
        flat_t = target.reshape(-1)
        bad = (flat_t != self.ignore_index) & ((flat_t < 0) | (flat_t >= C))
        if bad.any():
            raise ValueError(
                f"target values must lie in [0, {C}) or equal ignore_index={self.ignore_index}, "
                f"got {int(flat_t[bad][0])}"
            )
        loss, grad = F.cross_entropy(logits.reshape(-1, C), flat_t, ignore_index=self.ignore_index)
        self._save(grad=grad.reshape(logits.shape))
        return loss

    def backward(self, grad_output: float = 1.0) -> np.ndarray:
        grad = self._saved()["grad"]
        return grad if grad_output == 1.0 else grad * grad.dtype.type(grad_output)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}"
