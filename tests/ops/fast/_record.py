"""A dispatch mode that records the arguments of every compactionrl_fast custom op a call runs."""
from torch.utils._python_dispatch import TorchDispatchMode


class RecordOps(TorchDispatchMode):
    """calls: [(op name, args)] of the compactionrl_fast ops dispatched inside the `with`."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("compactionrl_fast."):
            self.calls.append((str(func), args))
        return func(*args, **(kwargs or {}))

    def args(self, name):
        """The arguments of the one call of op `name` (e.g. "ppo_policy_loss")."""
        got = [a for f, a in self.calls if f == f"compactionrl_fast.{name}.default"]
        assert len(got) == 1, self.calls
        return got[0]
