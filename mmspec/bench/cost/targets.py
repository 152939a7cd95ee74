"""The bundled targets: each loads its pipeline, runs a row's call, watches its models and builds
their probes. A served modality names its class in ``ModalitySpec.cost_target``; the drafting
components are watched as the registry says (``watch_components``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch

from ... import methods
from ...adapters.vlm import VLMTarget
from ...core.errors import check
from ...core.types import ModelOutput
from .config import TARGET, CostBenchConfig
from .curves import Probe, cached_probe
from .timing import PassTimer


def watch_components(timer: PassTimer, pipe, roles: set[str]) -> None:
    """Every drafting component in ``roles`` (pipeline attribute names) timed as its registry
    ``Component.timing`` says (``PassTimer.watch_component``)."""
    timings = {c.name: c.timing for c in methods.components(pipe.modality)}
    for role in sorted(roles):
        check(role in timings, "role", f"a registered component of {pipe.modality} ({', '.join(timings)})", role)
        timer.watch_component(role, getattr(pipe, role), timings[role])


class ARImageCost:
    """``assets/ar-image``: image i of class i % 16 with seed + i, CFG (two rows per pass)."""

    def __init__(self, cfg: CostBenchConfig):
        from ...pipelines import SpeculativeARImagePipeline

        self.cfg = cfg
        self.pipe = SpeculativeARImagePipeline.from_pretrained(cfg.ar_image_dir)
        self.pipe.set_progress_bar_config(disable=True)

    def component(self, role: str):
        return getattr(self.pipe, role, None)

    def call(self, method: str, knobs: dict, i: int) -> int:
        cfg = self.cfg
        out = self.pipe(class_labels=[i % self.pipe.num_classes], method=method, method_knobs=knobs,
                        guidance_scale=cfg.ar_guidance_scale, temperature=cfg.temperature,
                        generator=torch.Generator().manual_seed(cfg.seed + i), output_type="latent")
        return out.tokens.numel()

    def watch(self, timer: PassTimer, roles: set[str]) -> None:
        timer.watch(TARGET, self.pipe.transformer, 0, 3)
        watch_components(timer, self.pipe, roles)

    def probes(self, roles: set[str], width: int) -> tuple[int, dict[str, Probe]]:
        model = self.pipe.transformer
        native = _NativeProbes(model, prefix=1 + model.num_image_tokens // 2, width=width, seed=self.cfg.seed)
        return native.prefix, component_probes(self.pipe, roles, lambda: native.tokens(model), tokens=native.tokens,
                                               features=native.features, heads=native.heads)


def component_probes(pipe, roles: set[str], target: Callable[[], Probe], **builders: Callable) -> dict[str, Probe]:
    """The probes of ``roles``: the target's (``target()``, built first) and each drafting
    component's, built by ``builders[timing](module)`` for its registry ``Component.timing``
    (``methods.TIMINGS``), so a new component is probed by how it is called, not by its name."""
    timings = {c.name: c.timing for c in methods.components(pipe.modality)}
    probes = {TARGET: target()} if TARGET in roles else {}
    for role in sorted(roles - {TARGET}):
        build = builders.get(timings.get(role))
        check(build is not None, f"the component {role!r}", f"one whose timing this target probes "
              f"({', '.join(sorted(builders))})", timings.get(role))
        probes[role] = build(getattr(pipe, role))
    return probes


class _NativeProbes:
    """Probes of LlamaGen-style models (token ids, or continuous tokens of ``model.token_shape``)
    and their heads, two rows (a CFG pair: the class and the null class) on a ``prefix``-long cache
    of ``model``'s prompt."""

    def __init__(self, model, prefix: int, width: int, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.shape = tuple(getattr(model, "token_shape", ()))
        self.model, self.vocab, self.prefix, self.width = model, model.vocab_size, prefix, width
        self.prompt = self.ids(prefix)
        self.prompt[:, 0] = torch.tensor([0, model.null_class]).view(2, *(1,) * len(self.shape)).to(self.prompt.dtype)
        self.positions = torch.arange(prefix).expand(2, prefix)

    def ids(self, T: int) -> torch.Tensor:
        if self.shape:
            return torch.randn((2, T) + self.shape, generator=self.g)
        return torch.randint(self.vocab, (2, T), generator=self.g)

    def tokens(self, m) -> Probe:
        """``timing="tokens"``: a model (the target, a draft model) on its own cache of the prompt."""
        cache = m.new_cache(2, self.prefix + self.width + 1)
        m(self.prompt, self.positions, cache)
        return cached_probe(m, cache, self.prefix, self.prefix, lambda T: (self.ids(T),))

    def features(self, head) -> Probe:
        """``timing="features"``: an EAGLE head, its entries 1 .. prefix - 1 cached."""
        H = head.fc.weight.shape[0]
        cache = head.new_cache(2, self.prefix + self.width + 1)
        head(torch.randn(2, self.prefix - 1, H, generator=self.g), self.prompt[:, 1:], self.positions[:, 1:], cache)
        return cached_probe(head, cache, self.prefix, self.prefix - 1,
                            lambda T: (torch.randn(2, T, H, generator=self.g), self.ids(T)))

    def heads(self, heads) -> Probe:
        """``timing="heads"``: parallel heads (no cache): one call on T features, two rows."""
        g, H, K = self.g, heads.config.dim, heads.num_heads

        def call(T, tree):
            inputs = {"above": torch.randint(self.vocab, (2, T, K), generator=g),
                      "column": torch.randint(self.model.config.grid_size, (2, T, K), generator=g)}
            return heads(torch.randn(2, T, H, generator=g), torch.randint(self.vocab, (2, T), generator=g), inputs)

        return call


class ContinuousCost(ARImageCost):
    """``assets/continuous``: as the AR image target, CFG as ``mmspec bench continuous``."""

    def __init__(self, cfg: CostBenchConfig):
        from ...pipelines import SpeculativeContinuousARPipeline

        self.cfg = cfg
        self.pipe = SpeculativeContinuousARPipeline.from_pretrained(cfg.continuous_dir)
        self.pipe.set_progress_bar_config(disable=True)

    def call(self, method: str, knobs: dict, i: int) -> int:
        cfg = self.cfg
        out = self.pipe(class_labels=[i % self.pipe.num_classes], method=method, method_knobs=knobs,
                        guidance_scale=cfg.continuous_guidance_scale,
                        guidance_schedule=cfg.continuous_guidance_schedule, temperature=cfg.temperature,
                        generator=torch.Generator().manual_seed(cfg.seed + i), output_type="latent")
        return out.latents.shape[0] * out.latents.shape[1]

    def probes(self, roles: set[str], width: int) -> tuple[int, dict[str, Probe]]:
        model = self.pipe.transformer
        native = _NativeProbes(model, prefix=1 + model.num_image_tokens // 2, width=width, seed=self.cfg.seed)
        return native.prefix, component_probes(self.pipe, roles, lambda: native.tokens(model), tokens=native.tokens)


class VLMCost:
    """``assets/vlm``: held-out scene i with a description question, greedy, batch 1."""

    def __init__(self, cfg: CostBenchConfig):
        from ...pipelines import SpeculativeVLMPipeline
        from ..vlm import bench_prompts

        self.cfg = cfg
        self.pipe = SpeculativeVLMPipeline.from_pretrained(cfg.vlm_dir)
        self.pipe.set_progress_bar_config(disable=True)
        self.images, self.prompts = bench_prompts(cfg.prompts)

    def component(self, role: str):
        return getattr(self.pipe, role, None)

    def call(self, method: str, knobs: dict, i: int) -> int:
        out = self.pipe(images=[self.images[i]], prompts=[self.prompts[i]], method=method,
                        max_new_tokens=self.cfg.vlm_max_new_tokens, method_knobs=knobs or None)
        return len(out.tokens[0])

    def watch(self, timer: PassTimer, roles: set[str]) -> None:
        model = self.pipe.target
        timer.watch_span(TARGET, model.get_input_embeddings(), model.get_output_embeddings(), model.base_model)
        watch_components(timer, self.pipe, roles)

    def probes(self, roles: set[str], width: int) -> tuple[int, dict[str, Probe]]:
        """Prompt 0 (with its image) plus half the new tokens on every cache; the heads are started
        on the target's prompt pass as ``EagleTreeDrafter`` starts them (images planned/compressed)."""
        target, _ = self.pipe.views()
        ids, vision = self.pipe.prepare_inputs(self.images[:1], self.prompts[:1])
        conditioning = target.vision_inputs(**vision)
        prompt = torch.tensor(ids)
        S, E = prompt.shape[1], self.cfg.vlm_max_new_tokens // 2
        prefix = S + E
        g = torch.Generator().manual_seed(self.cfg.seed)

        def tokens(T: int) -> torch.Tensor:
            x = torch.randint(target.vocab_size, (1, T), generator=g)
            return x.masked_fill(x == target.image_token_id, 0)  # text only after the prompt

        ext = tokens(E)
        seq = torch.cat([prompt, ext], 1)
        first = {}

        def span(view) -> Probe:  # the target (first) or a draft VLM's view: prompt and half the answer cached
            cache = view.new_cache(1, prefix + width + 1)
            out = view(prompt, torch.arange(S)[None], cache, **conditioning)
            more = view(ext, S + torch.arange(E)[None], cache)
            if not first:
                first.update(out=out, hidden=torch.cat([out.hidden, more.hidden], 1))
            return cached_probe(view, cache, prefix, prefix, lambda T: (tokens(T),))

        def heads(module) -> Probe:  # no cache: one call on T features (one per row when drafting)
            bound = module.bind(target)
            image = bound.image_feature(prompt, first["out"].prompt_embeds, torch.tensor([S]))
            H = bound.config.hidden_size
            return lambda T, tree: bound(torch.randn(1, T, H, generator=g), tokens(T), image)

        def features(module) -> Probe:  # started on the target's prompt pass, entries 1 .. prefix - 1 cached
            head = module.bind(target)
            H = head.fc.weight.shape[0]
            cache = head.new_cache(1, prefix + width + 1)
            out = first["out"]
            prefill = ModelOutput(logits=None, hidden=out.hidden, prompt_embeds=out.prompt_embeds)
            head.start(cache, SimpleNamespace(prefill=prefill, tokens=seq, prompt_lengths=torch.tensor([S])))
            head(first["hidden"][:, : prefix - 1], seq[:, 1:], torch.arange(1, prefix)[None], cache)
            return cached_probe(head, cache, prefix, prefix - 1,
                                lambda T: (torch.randn(1, T, H, generator=g), tokens(T)))

        return prefix, component_probes(self.pipe, roles | {TARGET}, lambda: span(target),
                                        span=lambda m: span(VLMTarget(m)), heads=heads, features=features)

