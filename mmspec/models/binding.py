"""Draft heads that borrow their target's token embedding and LM head (never saved with them)."""

from __future__ import annotations

from ..core.errors import check


class BoundToTarget:
    """``bind(target)``, ``target`` and ``vocab_size`` for a head with a diffusers ``config``.

    A subclass says which config keys it shares with its target (``_target_config``) and how its
    messages name things: ``target_kind`` (what ``bind`` expects), ``bind_hint`` (the argument in
    "call head.bind(...) first") and ``whose`` (the config's owner in the mismatch message)."""

    target_kind = "target"
    bind_hint = "target"
    whose = "the head's"
    _bound_to: tuple = ()  # (target,): a tuple keeps the target out of the module's submodules

    def _target_config(self, target) -> dict:
        """``{key: target's value}`` for every config key the head must share with its target."""
        raise NotImplementedError

    def bind(self, target):
        """Use ``target``'s token embedding and LM head (shared, not copied); returns self."""
        for key, value in self._target_config(target).items():
            check(value == self.config[key], "target",
                  f"a {self.target_kind} with {key}={self.config[key]} ({self.whose})", value)
        self._bound_to = (target,)
        return self

    @property
    def target(self):
        """The bound target, whose embedding and LM head the head uses."""
        if not self._bound_to:
            raise RuntimeError(f"{type(self).__name__} is not bound to a target: "
                               f"call head.bind({self.bind_hint}) first")
        return self._bound_to[0]

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size
