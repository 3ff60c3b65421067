"""What the last backward of a kind of call found, for the next call's plan (``_plan``)."""


class Speculation:
    """What the last backward of each kind of call (a key) found, yes or no, for the next call of
    that kind to speculate on. Two uses:

    - the sweep's gradients: yes where the upstream gradient was one value on every row (with a
      target), so that the gradients made in the forward's sweep, scaled, are exact. Held by the op
      layer (``_ops.TOKEN_SPECULATION`` for the per-token outputs, keyed by the outputs asked for,
      ``"entropy,log_probs"``; the divergence's, one key) and read by ``grads_in_forward``;
    - the kept rows' backward (``_kept.SPECULATION``, keyed by the outputs): yes where every row
      the forward computed had a gradient, so that the next kept backward takes them all without
      counting them on the host first (``_plan.kept_rows_whole``).

    The re-arming rules: a key never seen speculates. A backward that decides on the host records
    its verdict (``found``); one that does not queues a small check (``recheck``: its result copied
    to the host behind the work queued, read by the next ``speculates``). For the sweep's
    gradients, a backward that did not take them checks its weights while the key is off, so that
    [sft, sft, rl, sft, sft] makes the gradients in the sweeps of calls 1, 2, 3 and 5 (call 3's
    backward finds them unequal, call 4's equal again)."""

    def __init__(self):
        self._verdict: dict[str, bool] = {}
        self._pending: dict[str, tuple] = {}  # key -> (host flag [1], ready event or None)

    def speculates(self, key: str = "") -> bool:
        """Whether the next call of ``key`` speculates: unless its last backward found no (a pending
        check is read first)."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            flag, ready = pending
            if ready is not None:
                ready.synchronize()  # (long done: queued in the last backward)
            self._verdict[key] = bool(flag[0] == 1.0)
        return self._verdict.get(key, True)

    def off(self, key: str = "") -> bool:
        """Whether the last backward of ``key`` found no (for the sweep's gradients: unequal weights)."""
        return self._verdict.get(key) is False

    def found(self, key: str, verdict: bool) -> None:
        """A backward's verdict, read on the host (it replaces one still pending: the later wins)."""
        self._pending.pop(key, None)
        self._verdict[key] = bool(verdict)

    def recheck(self, key: str, host_flag) -> None:
        """A backward's verdict queued on the device: (host flag [1], ready event or None), 1.0 for
        yes (for the sweep's gradients: equal weights); read by the next ``speculates``."""
        self._pending[key] = host_flag

    def forget(self, key: str = "") -> None:
        """Back to a fresh process's state for ``key`` (no backward seen)."""
        self._verdict.pop(key, None)
        self._pending.pop(key, None)
