"""The bundled targets: each loads its pipeline, runs a row's call, watches its models and builds
their probes. A served modality names its class in ``ModalitySpec.cost_target``; the drafting
components are watched as the registry says (``watch_components``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ... import methods
from ...core.types import ModelOutput
from .config import TARGET, CostBenchConfig
from .curves import Probe, cached_probe
from .timing import PassTimer


def watch_components(timer: PassTimer, pipe, roles: set[str]) -> None:
    """Every drafting component in ``roles`` (pipeline attribute names) timed as its registry
    ``Component.timing`` says (``PassTimer.watch_component``)."""
    timings = {c.name: c.timing for c in methods.components(pipe.modality)}
    for role in sorted(roles):
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
        prefix, probes = _native_probes(model, {TARGET: model, "draft_model": self.pipe.draft_model},
                                        self.pipe.eagle_head, roles, width, prefix=1 + model.num_image_tokens // 2,
                                        seed=self.cfg.seed)
        if "medusa_head" in roles:  # no cache: one call on T features, two rows (a CFG pair) when drafting
            heads = self.pipe.medusa_head
            g = torch.Generator().manual_seed(self.cfg.seed)
            H, K = heads.config.dim, heads.num_heads

            def call(T, tree):
                inputs = {"above": torch.randint(model.vocab_size, (2, T, K), generator=g),
                          "column": torch.randint(model.config.grid_size, (2, T, K), generator=g)}
                return heads(torch.randn(2, T, H, generator=g), torch.randint(model.vocab_size, (2, T), generator=g),
                             inputs)

            probes["medusa_head"] = call
        return prefix, probes


def _native_probes(model, models: dict, head, roles: set[str], width: int, prefix: int, seed: int):
    """Probes of LlamaGen-style models (token ids, or continuous tokens of ``model.token_shape``)
    and an EAGLE head, two rows (a CFG pair: the class and the null class) on a ``prefix``-long cache."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(getattr(model, "token_shape", ()))

    def tokens(T: int) -> torch.Tensor:
        if shape:
            return torch.randn((2, T) + shape, generator=g)
        return torch.randint(model.vocab_size, (2, T), generator=g)

    prompt = tokens(prefix)
    prompt[:, 0] = torch.tensor([0, model.null_class]).view(2, *(1,) * len(shape)).to(prompt.dtype)
    positions = torch.arange(prefix).expand(2, prefix)
    probes = {}
    for role, m in models.items():
        if role in roles:
            cache = m.new_cache(2, prefix + width + 1)
            m(prompt, positions, cache)
            probes[role] = cached_probe(m, cache, prefix, prefix, lambda T: (tokens(T),))
    if "eagle_head" in roles:
        H = head.fc.weight.shape[0]
        cache = head.new_cache(2, prefix + width + 1)
        head(torch.randn(2, prefix - 1, H, generator=g), prompt[:, 1:], positions[:, 1:], cache)  # entries 1..prefix-1
        probes["eagle_head"] = cached_probe(head, cache, prefix, prefix - 1,
                                            lambda T: (torch.randn(2, T, H, generator=g), tokens(T)))
    return prefix, probes


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
        return _native_probes(model, {TARGET: model, "draft_model": self.pipe.draft_model}, None, roles, width,
                              prefix=1 + model.num_image_tokens // 2, seed=self.cfg.seed)


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
        target, draft = self.pipe.views()
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
        probes, first = {}, None
        for role, view in ((TARGET, target), ("draft_model", draft)):
            if role in roles:
                cache = view.new_cache(1, prefix + width + 1)
                out = view(prompt, torch.arange(S)[None], cache, **conditioning)
                more = view(ext, S + torch.arange(E)[None], cache)
                if role == TARGET:
                    first, hidden = out, torch.cat([out.hidden, more.hidden], 1)
                probes[role] = cached_probe(view, cache, prefix, prefix, lambda T: (tokens(T),))
        if "medusa_head" in roles:  # no cache: one call on T features (one per row when drafting)
            heads = self.pipe.medusa_head.bind(target)
            image = heads.image_feature(prompt, first.prompt_embeds, torch.tensor([S]))
            H = heads.config.hidden_size
            probes["medusa_head"] = lambda T, tree: heads(torch.randn(1, T, H, generator=g), tokens(T), image)
        for role in sorted(roles - {TARGET, "draft_model", "medusa_head"}):
            head = getattr(self.pipe, role).bind(target)
            H = head.fc.weight.shape[0]
            cache = head.new_cache(1, prefix + width + 1)
            prefill = ModelOutput(logits=None, hidden=first.hidden, prompt_embeds=first.prompt_embeds)
            head.start(cache, SimpleNamespace(prefill=prefill, tokens=seq, prompt_lengths=torch.tensor([S])))
            head(hidden[:, : prefix - 1], seq[:, 1:], torch.arange(1, prefix)[None], cache)  # entries 1..prefix-1
            probes[role] = cached_probe(head, cache, prefix, prefix - 1,
                                        lambda T: (torch.randn(1, T, H, generator=g), tokens(T)))
        return prefix, probes

