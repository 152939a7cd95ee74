"""Draft heads that borrow their target's token embedding and LM head (never saved with them),
and the fingerprint that ties a trained head to the target it was trained for."""

from __future__ import annotations

import hashlib
import json

from ..core.errors import check

# config entries that say how a model was saved or is run, not what it computes
_RUNTIME_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "architectures", "use_cache",
                           "return_dict", "output_hidden_states", "output_attentions", "attn_implementation"})


def _what_it_computes(value):
    if isinstance(value, dict):
        return {k: _what_it_computes(v) for k, v in sorted(value.items())
                if not str(k).startswith("_") and k not in _RUNTIME_KEYS}
    if isinstance(value, (list, tuple)):
        return [_what_it_computes(v) for v in value]
    return value


def target_fingerprint(target) -> str:
    """``"<class> config <12 hex>"``: the target model's class and a SHA-256 of its config, with
    what says how it was saved or is run left out (dtype, transformers version, attention
    implementation, cache use, private ``_`` keys). ``target``: a model with a ``config``
    (transformers or diffusers), or a core view of one (``VLMTarget``: its ``model``)."""
    model = target if hasattr(target, "config") else target.model  # a model, or a core view of one
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
    text = json.dumps(_what_it_computes(config), sort_keys=True, default=str)
    return f"{type(model).__name__} config {hashlib.sha256(text.encode()).hexdigest()[:12]}"


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
        """Use ``target``'s token embedding and LM head (shared, not copied); returns self. A head
        stamped with the target it was trained for (``stamp``: its config's ``_trained_for``) is
        refused for any other target, naming both; an unstamped one is checked on sizes only."""
        for key, value in self._target_config(target).items():
            check(value == self.config[key], "target",
                  f"a {self.target_kind} with {key}={self.config[key]} ({self.whose})", value)
        trained_for = self.config.get("_trained_for")
        if trained_for:
            this = target_fingerprint(target)
            if this != trained_for:
                raise ValueError(f"target: {type(self).__name__} was trained for {trained_for}, this target is "
                                 f"{this}; train one for it ('mmspec train', --target)")
        self._bound_to = (target,)
        return self

    def stamp(self, target):
        """Record ``target_fingerprint(target)`` in the config as ``_trained_for`` (saved with the
        head; ``from_target`` does it); returns self."""
        self.register_to_config(_trained_for=target_fingerprint(target))
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
