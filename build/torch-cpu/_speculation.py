"""What the last backward of a kind of call found, for the next forward's plan (``_plan``)."""


class Speculation:
    """What the last backward of a kind of call found: whether its upstream gradient was one
    value on every row (with a target), so that the gradients made in the forward's sweep, scaled,
    are exact. Held by the op layer (one per kind: the per-token outputs, keyed by the outputs
    asked for, ``"entropy,log_probs"``; the divergence, one key) and read by ``grads_in_forward``.

    The re-arming rules: a key never seen speculates. A backward that took the sweep's gradients
    records its verdict (``found``). One that did not still checks its weights while the key is off
    (``recheck``: one small launch, its result copied to the host behind the work queued, read by
    the next ``speculates``), so that [sft, sft, rl, sft, sft] makes the gradients in the sweeps of
    calls 1, 2, 3 and 5 (call 3's backward finds them unequal, call 4's equal again)."""

    def __init__(self):
        self._uniform: dict[str, bool] = {}
        self._pending: dict[str, tuple] = {}  # key -> (host flag [1], ready event or None)

    def speculates(self, key: str = "") -> bool:
        """Whether the next forward of ``key`` makes its gradients in the sweep: unless its last
        backward found unequal weights (a pending check is read first)."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            flag, ready = pending
            if ready is not None:
                ready.synchronize()  # (long done: queued in the last backward)
            self._uniform[key] = bool(flag[0] == 1.0)
        return self._uniform.get(key, True)

    def off(self, key: str = "") -> bool:
        """Whether the last backward of ``key`` found unequal weights (its forwards recompute)."""
        return self._uniform.get(key) is False

    def found(self, key: str, uniform: bool) -> None:
        """A backward's verdict on its upstream gradient."""
        self._uniform[key] = bool(uniform)

    def recheck(self, key: str, host_flag) -> None:
        """A check queued by a backward that did not take the sweep's gradients: (host flag [1],
        ready event or None), 1.0 where the weights were equal; read by the next ``speculates``."""
        self._pending[key] = host_flag

    def forget(self, key: str = "") -> None:
        """Back to a fresh process's state for ``key`` (no backward seen)."""
        self._uniform.pop(key, None)
        self._pending.pop(key, None)
