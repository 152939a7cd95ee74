"""The contract every registered lossless method keeps, from parametrised tests over the registry
(``methods.names(modality)``, ``methods.resolve(modality, name).lossless``): a method added to the
registry is tested here without a line of test code.

Greedy half (``test_greedy_equals_none``): greedy decoding equals ``method="none"`` token for
token, for the modalities with greedy decoding:

- ``ar-image``: tiny random components built here (a one-layer LlamaGen target and draft, random
  EAGLE and Medusa heads: a method that needs a trained component gets a random one);
- ``vlm``: the bundled tiny VLM (``assets/vlm``, every head present);
- ``continuous`` has no greedy decoding (its heads sample densities): sampled half only.

Sampled half (``test_sampled_law_is_the_targets``, ``statistical``): every lossless method of
``ar-image``, ``vlm`` and ``continuous``, ``"none"`` included, samples through its *pipeline*
(``pipe(..., method=name)``, one batched call, one ``torch.Generator`` seeded 0) and the output's
law is tested against the target's exact law, a correct method passing at p >= 1e-3
(``P_THRESHOLD``):

- ``ar-image``: N = 2,000 images of class 1 (``contract_util.tiny_ar_pipeline``: 12 codes, 3x3
  grids), temperature 1, with CFG (scale 2) and without; Pearson chi-square of the first 3
  tokens against their exact joint law, enumerated by full forwards of the target on every
  prefix (``contract_util.exact_law``), cells expecting < 5 samples pooled;
- ``vlm``: N = 2,000 answers to one question about one image on a tiny random LLaVA
  (``contract_util.tiny_vlm_pipeline``; the bundled VLM costs ~18 ms a sample and its first
  answer tokens are nearly certain), temperature 1, EOS on: the same test on the first 3 tokens
  (an answer ending in EOS is a cell of its own);
- ``continuous`` (the toy density pair of ``tests/test_continuous_core.py`` as the pipeline's
  transformer and draft): N = 4,000 images (classes i % 3), CFG 2 (linear), temperature 1, all 4
  tokens. Mixture-head methods: the Rosenblatt (PIT) test of the latents under the exact
  processed target, as ``tests/test_continuous_jacobi.py`` runs it (KS per coordinate,
  Bonferroni over 8, and a chi-square on the 3**4-cell grid of every token's first coordinate;
  the smaller p-value counts, so a correct method fails with probability <= 2e-3); the pipeline returns latents only, so a spy on ``pipe.decode`` keeps the decoded tokens
  (state and latent) the transform needs. Diffusion-head methods (``none-diffusion``, ``path``)
  have no closed-form density: two-sample test (``two_sample_pvalue``, first 2 tokens) against
  N target-only samples drawn by the core with seed 1.

The EAGLE-style trees run at a small size (``SMALL_TREES``: top-k 4, depth 3, 10 tokens) so the
sampled half fits its time; the law does not depend on the tree's size.

Broken controls (``test_a_broken_rule_fails_the_same_test``): per modality a copy of ``sd``
registered for the test only (the registry restored afterwards) with a broken rule, sampled by the
same function at the same seed and N, must give p < 1e-3: corrections drawn from p instead of the
residual (``contract_util.NoResidual``; p <= 2e-9 over seeds 0-2, measured) for ``ar-image``
(with CFG) and ``vlm``, every draft accepted (``contract_util.AcceptAll``) for ``continuous``
(``BROKEN`` says why).
"""

from pathlib import Path

import pytest
import torch

from contract_util import AcceptAll, NoKnobs, NoResidual, VLM_QUESTION, exact_law, tiny_ar_pipeline, tiny_vlm_pipeline
from mmspec import methods
from mmspec.core import DensityProcessor, LogitsProcessor
from mmspec.core.exactness import P_THRESHOLD, grid_chisquare_pvalue, ks_uniform_pvalue, two_sample_pvalue
from mmspec.models.eagle import EagleDraftHead
from mmspec.models.llamagen import LlamaGenModel
from mmspec.models.medusa import GridMedusaHeads
from mmspec.models.vq import TinyVQModel
from mmspec.pipelines import SpeculativeARImagePipeline, SpeculativeContinuousARPipeline, SpeculativeVLMPipeline
from test_continuous_core import generate, rosenblatt, toy_draft, toy_target

VLM_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "vlm"
MODALITIES = ("ar-image", "vlm")  # the modalities with greedy decoding
CASES = [(m, name) for m in MODALITIES for name in methods.names(m)
         if name != "none" and methods.resolve(m, name).lossless]


def _ar(seed, vq):
    torch.manual_seed(seed)
    return LlamaGenModel(vocab_size=vq.config.codebook_size, grid_size=vq.grid_size, num_classes=16, dim=32,
                         n_layers=1, n_heads=2, mlp_hidden=64, initializer_range=0.3).eval()


def _ar_pipe():
    torch.manual_seed(0)
    vq = TinyVQModel().eval()
    target = _ar(1, vq)
    eagle = EagleDraftHead.from_target(target).eval()
    medusa = GridMedusaHeads.from_target(target, num_heads=3).eval()
    with torch.no_grad():  # random heads: zero-initialised ones would all propose the root's argmax
        for p in [*eagle.parameters(), *medusa.parameters()]:
            p.normal_(0, 0.3)
    return SpeculativeARImagePipeline(transformer=target, vqvae=vq, draft_model=_ar(2, vq), eagle_head=eagle,
                                      medusa_head=medusa)


def _vlm_pipe():
    return SpeculativeVLMPipeline.from_pretrained(VLM_ASSETS)


def _vlm_inputs():
    g = torch.Generator().manual_seed(0)
    return dict(images=[torch.rand(3, 32, 32, generator=g) for _ in range(2)],
                prompts=["describe the image in detail .", "what colour is the circle ?"], max_new_tokens=24)


CALLS = {  # modality -> (pipeline builder, greedy call kwargs, the generated tokens of an output)
    "ar-image": (_ar_pipe, lambda: dict(class_labels=[3, 7], temperature=0.0, output_type="latent"),
                 lambda out: out.tokens),
    "vlm": (_vlm_pipe, lambda: dict(_vlm_inputs(), temperature=0.0), lambda out: out.tokens),
}
_PIPES: dict = {}


def _pipe_and_reference(modality):
    if modality not in _PIPES:
        build, kwargs, tokens = CALLS[modality]
        pipe = build()
        pipe.set_progress_bar_config(disable=True)
        _PIPES[modality] = (pipe, tokens(pipe(**kwargs(), method="none")))
    return _PIPES[modality]


@pytest.mark.parametrize("modality, method", CASES)
def test_greedy_equals_none(modality, method):
    pipe, reference = _pipe_and_reference(modality)
    _, kwargs, tokens = CALLS[modality]
    out = pipe(**kwargs(), method=method)
    got = tokens(out)
    assert (torch.equal(got, reference) if isinstance(got, torch.Tensor) else got == reference), method


# -- the sampled half ---------------------------------------------------------------------------------
SAMPLED_MODALITIES = ("ar-image", "vlm", "continuous")
SAMPLED_CASES = [(m, name) for m in SAMPLED_MODALITIES for name in methods.names(m)
                 if methods.resolve(m, name).lossless]
N_SAMPLES = {"ar-image": 2_000, "vlm": 2_000, "continuous": 4_000}
N_TOKENS = {"ar-image": 3, "vlm": 3, "continuous": 4}
SEED = 0
SMALL_TREES = {"eagle_top_k": 4, "eagle_depth": 3, "eagle_total_tokens": 10,
               "tree_top_k": 4, "tree_depth": 3, "tree_total_tokens": 10}
AR_CLASS, AR_GUIDANCE = 1, (None, 2.0)
CONTINUOUS = dict(guidance_scale=2.0, guidance_schedule="linear", temperature=1.0)
BROKEN = {"ar-image": ("sd", NoResidual), "vlm": ("sd", NoResidual), "continuous": ("sd", AcceptAll)}
"""Per modality: the method its broken control copies (a chain drafter with drafted q) and the
broken rule. On densities the no-residual control needs N = 20,000 (``tests/test_continuous_core.py``
runs it there; at this N, CFG on, it gave p = 0.05 and 2e-4 over seeds 0-1), so here it accepts
every draft."""


def _knobs(modality, method):
    accepted = methods.knobs(modality, method)
    return {k: v for k, v in SMALL_TREES.items() if k in accepted} or None


class _Sampler:
    """One modality's pipeline, its exact law and the law test of a method's batched samples."""

    def __init__(self, modality):
        self.modality, self.N, self.n = modality, N_SAMPLES[modality], N_TOKENS[modality]
        self.pipe = {"ar-image": tiny_ar_pipeline, "vlm": tiny_vlm_pipeline, "continuous": _continuous_pipe}[modality]()
        self.laws: dict = {}

    def pvalue(self, method, guidance=None) -> tuple[float, dict]:
        return getattr(self, self.modality.replace("-", "_"))(method, guidance)

    def gen(self):
        return torch.Generator().manual_seed(SEED)

    # ar-image: chi-square of the first tokens against the enumerated joint law
    def ar_image(self, method, guidance):
        pipe = self.pipe
        out = pipe(class_labels=AR_CLASS, num_images_per_prompt=self.N, method=method, temperature=1.0,
                   guidance_scale=guidance, generator=self.gen(), output_type="latent", method_knobs=_knobs(
                       self.modality, method))
        if guidance not in self.laws:
            logits = LogitsProcessor(temperature=1.0, guidance_scale=guidance)
            model = pipe.transformer

            def score(prefixes):
                ids = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), -1)
                rows = [torch.cat([torch.full((len(ids), 1), c), ids], 1)
                        for c in ([AR_CLASS] if guidance is None else [AR_CLASS, model.null_class])]
                with torch.no_grad():
                    return logits(torch.cat([model(r).logits[:, -1] for r in rows]))

            self.laws[guidance] = exact_law(score, self.n, self.N)
        return self.laws[guidance].pvalue(out.tokens.flatten(1).tolist()), out.stats

    # vlm: the same, the answer's EOS a cell of its own
    def vlm(self, method, guidance):
        pipe = self.pipe
        image = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))
        out = pipe(images=[image] * self.N, prompts=[VLM_QUESTION] * self.N, method=method, temperature=1.0,
                   max_new_tokens=self.n, generator=self.gen(), method_knobs=_knobs(self.modality, method))
        if "law" not in self.laws:
            from mmspec.adapters.vlm import VLMTarget

            ids, vision = pipe.prepare_inputs(image, VLM_QUESTION)
            logits = LogitsProcessor(temperature=1.0)
            with torch.no_grad():  # the prompt's embeddings, image features in place; generated ids are text
                prompt = VLMTarget(pipe.target).input_embeds(torch.tensor(ids), **vision)

            def score(prefixes):
                ids = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), -1)
                embeds = torch.cat([prompt.expand(len(ids), -1, -1), pipe.target.get_input_embeddings()(ids)], 1)
                with torch.no_grad():
                    return logits(pipe.target(inputs_embeds=embeds).logits[:, -1])

            eos = pipe.target.generation_config.eos_token_id
            self.laws["law"] = exact_law(score, self.n, self.N, eos=eos)
        return self.laws["law"].pvalue(out.tokens), out.stats

    # continuous: Rosenblatt (mixture head) or two-sample against the target alone (diffusion head)
    def continuous(self, method, guidance):
        pipe = self.pipe
        labels = torch.arange(self.N) % 3
        out = pipe(class_labels=labels.tolist(), method=method, generator=self.gen(), output_type="latent",
                   **CONTINUOUS)
        tokens = pipe.decoded.sequences  # (N, n, 2, d): state and latent of every token
        head = methods.continuous.head_for(methods.resolve(self.modality, method))
        density = DensityProcessor(head=head, **CONTINUOUS)
        if head == "mixture":
            u = rosenblatt(pipe.transformer, tokens, labels, density, self.n).view(self.N, self.n, -1)
            return min(ks_uniform_pvalue(u.flatten(1)), grid_chisquare_pvalue(u[..., 0])), out.stats
        if head not in self.laws:
            ref = generate(pipe.transformer, None, density, labels, self.n, SEED + 1)
            self.laws[head] = ref.sequences[:, :2, 1].flatten(1)
        return two_sample_pvalue(self.laws[head], tokens[:, :2, 1].flatten(1)), out.stats


def _continuous_pipe():
    """The toy density pair of ``tests/test_continuous_core.py`` in the pipeline (2x2 tokens of
    d = 2, float64), a fitted PCA tokenizer of the same grid; ``pipe.decoded`` keeps the last
    decode's output (the tokens behind the returned latents)."""
    from mmspec.models.continuous_tokenizer import PatchPCATokenizer

    torch.manual_seed(0)
    tokenizer = PatchPCATokenizer(sample_size=8, patch_size=4, latent_dim=2).fit(torch.rand(4, 3, 8, 8) * 2 - 1)
    target = toy_target()
    pipe = SpeculativeContinuousARPipeline(tokenizer=tokenizer, transformer=target, draft_model=toy_draft(target))
    pipe.set_progress_bar_config(disable=True)
    decode = pipe.decode

    def spy(*args, **kwargs):
        pipe.decoded = decode(*args, **kwargs)
        return pipe.decoded

    pipe.decode = spy
    return pipe


_SAMPLERS: dict = {}


def _sampler(modality) -> _Sampler:
    if modality not in _SAMPLERS:
        _SAMPLERS[modality] = _Sampler(modality)
    return _SAMPLERS[modality]


def _sampled_cases():
    for modality, method in SAMPLED_CASES:
        for guidance in (AR_GUIDANCE if modality == "ar-image" else (None,)):
            label = f"{modality}-{method}" + ("" if guidance is None else f"-cfg{guidance:g}")
            yield pytest.param(modality, method, guidance, id=label)


@pytest.mark.statistical
@pytest.mark.parametrize("modality, method, guidance", list(_sampled_cases()))
def test_sampled_law_is_the_targets(modality, method, guidance):
    """A lossless method's samples through its pipeline follow the target's exact law (p >= 1e-3);
    a method with drafts accepted some (tau > 1: the test compares something)."""
    p, stats = _sampler(modality).pvalue(method, guidance)
    assert p >= P_THRESHOLD, f"{modality} {method}: p={p:.2e}"
    assert method in ("none", "none-diffusion") or stats["tau"] > 1.0, stats["tau"]


@pytest.fixture
def broken_method(monkeypatch):
    """Register, for this test only, ``<base>-broken``: the base method's parts plus the broken rule
    part of ``BROKEN``; the modality's registry is restored after."""

    def register(modality: str) -> str:
        mod = methods.modality(modality)
        for attr in ("parts", "methods"):
            monkeypatch.setattr(mod, attr, dict(getattr(mod, attr)))
        base, rule = BROKEN[modality]
        methods.register_part(name="broken", kind="rule", config=NoKnobs, build=lambda cfg, c: rule(),
                              doc=f"broken on purpose: {rule.__doc__}", modalities=(modality,))
        name = f"{base}-broken"
        methods.register_method(name, f"{mod.methods[base].parts}+broken", modalities=(modality,),
                                doc="broken on purpose (test only)")
        return name

    return register


@pytest.mark.statistical
@pytest.mark.parametrize("modality", SAMPLED_MODALITIES)
def test_a_broken_rule_fails_the_same_test(modality, broken_method):
    name = broken_method(modality)
    assert methods.resolve(modality, name).lossless  # it claims to be: only the test can tell
    guidance = AR_GUIDANCE[-1] if modality == "ar-image" else None
    p, _ = _sampler(modality).pvalue(name, guidance)
    assert p < P_THRESHOLD, f"{modality} {name}: p={p:.2e}"


def test_the_broken_method_is_gone_after_its_test():
    for modality in SAMPLED_MODALITIES:
        assert "broken" not in methods.parts(modality)
        assert not any(n.endswith("-broken") for n in methods.names(modality))
