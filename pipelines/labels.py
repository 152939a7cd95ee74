"""Class names for class-conditioned pipelines: prompt text -> class id, from the transformer
config's ``id2label`` (each id's names comma-separated, as diffusers' DiT keeps them)."""

from __future__ import annotations

from ..core.errors import check


def _normal(label: str) -> str:
    return " ".join(str(label).lower().split())


class ClassLabelsMixin:
    """``labels`` and ``get_label_ids`` for a pipeline whose ``transformer.config`` has
    ``num_classes`` and (optionally) ``id2label``."""

    @property
    def labels(self) -> dict[str, int]:
        """Every class name (lower case, single spaces) -> its id, from the transformer config's
        ``id2label`` (each id's names comma-separated, DiT's convention); sorted by name."""
        id2label = getattr(self.transformer.config, "id2label", None) or {}
        table = {_normal(name): int(i) for i, names in id2label.items() for name in names.split(",") if name.strip()}
        return dict(sorted(table.items()))

    def get_label_ids(self, label: str | list[str], name: str = "label") -> list[int]:
        """Class ids of class names or prompts (``"a red circle"``, ``"Red  Circle"``): case and
        whitespace do not matter. An unknown name raises ``ValueError`` listing the classes."""
        labels, table = [label] if isinstance(label, str) else list(label), self.labels
        id2label = getattr(self.transformer.config, "id2label", None)
        check(bool(id2label), name, "class_labels: this transformer's config has no id2label to map names", label)
        first = [id2label[str(i)].split(",")[0].strip() for i in range(self.transformer.config.num_classes)]
        for text in labels:
            check(_normal(text) in table, name, f"one of the class prompts: {', '.join(first)}", text)
        return [table[_normal(text)] for text in labels]
