"""GLM-Image's AR prior as a core target and ``SpeculativeGlmImagePipeline``, on the tiny random
configs of ``mmspec.bench.glm_image`` (no downloads; the processor is a stand-in that writes the
prompt layout and target grids exactly as ``GlmImageProcessor`` does)."""

import pytest
import torch

from mmspec.adapters.glm_image import GlmImagePriorTarget, prior_logits, prior_prompts
from mmspec.bench.glm_image import VISION_VOCAB as V  # vision_vocab_size: the image tokens the prior samples
from mmspec.bench.glm_image import TinyGlmProcessor, tiny_glm_image_components, tiny_prior
from mmspec.core import JacobiDrafter, SpeculativeDecoder


@pytest.fixture(scope="module")
def prior():
    return tiny_prior()


def prompt_inputs(model, texts=("a photo of a cat",), size=32):
    proc = TinyGlmProcessor(model.config.image_start_token_id)
    msgs = [[{"role": "user", "content": [{"type": "text", "text": t}]}] for t in texts]
    return proc.apply_chat_template(msgs, padding=len(texts) > 1, target_h=size, target_w=size)


def max_new_tokens(inputs):
    return int(inputs["image_grid_thw"].prod(-1).sum()) + 1  # _compute_generation_params, text-to-image


def hf_greedy(model, inputs, n):
    out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[:, inputs["input_ids"].shape[1]:]


def mmspec_decode(model, inputs, n, drafter=None, logits=None, generator=None):
    target = GlmImagePriorTarget(model)
    rows, conditioning = prior_prompts(inputs)
    decoder = SpeculativeDecoder(target, drafter, processor=logits if logits is not None else prior_logits(model, False))
    return decoder.generate(rows, n, conditioning=conditioning, generator=generator,
                            eos_token_id=model.generation_config.eos_token_id)


def test_greedy_prior_matches_transformers_generate(prior):
    inputs = prompt_inputs(prior)
    n = max_new_tokens(inputs)
    assert n == 1 + 256 + 1  # a 1x1 target grid after the 16x16 preview, then one more token
    expected = hf_greedy(prior, inputs, n)
    out = mmspec_decode(prior, inputs, n)
    assert out.sequences.shape == expected.shape
    assert torch.equal(out.sequences, expected)
    assert out.stats.target_forwards == n


def test_greedy_prior_matches_generate_at_a_larger_target_grid(prior):
    inputs = prompt_inputs(prior, size=64)  # a 2x2 target grid: its own height/width rotary positions
    n = max_new_tokens(inputs)
    assert torch.equal(mmspec_decode(prior, inputs, n).sequences, hf_greedy(prior, inputs, n))


@pytest.mark.parametrize("coupling", ["independent", "maximal"])
def test_greedy_jacobi_prior_equals_the_baseline(prior, coupling):
    inputs = prompt_inputs(prior)
    n = max_new_tokens(inputs)
    base = mmspec_decode(prior, inputs, n)
    out = mmspec_decode(prior, inputs, n, drafter=JacobiDrafter(V, window=8, coupling=coupling))
    assert torch.equal(out.sequences, base.sequences)


def test_prompts_without_the_image_start_token_are_refused(prior):
    target = GlmImagePriorTarget(prior)
    decoder = SpeculativeDecoder(target, processor=prior_logits(prior, False))
    inputs = prompt_inputs(prior)
    with pytest.raises(ValueError, match="input_ids"):
        decoder.generate([[16000, 16001]], 4, conditioning={"image_grid_thw": inputs["image_grid_thw"]})


def test_prior_logits_mirror_generate_defaults(prior):
    logits = prior_logits(prior)
    assert (logits.temperature, logits.top_k, logits.top_p) == (1.0, 50, None)


# -- the pipeline -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipes():
    from diffusers import GlmImagePipeline

    from mmspec.pipelines.glm_image import SpeculativeGlmImagePipeline

    components = tiny_glm_image_components()
    ours, theirs = SpeculativeGlmImagePipeline(**components), GlmImagePipeline(**components)
    for pipe in (ours, theirs):
        pipe.set_progress_bar_config(disable=True)
    return ours, theirs


CALL = {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 1.5, "max_sequence_length": 16,
        "output_type": "pt"}


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("method", ["sjd", "mcsjd"])
def test_greedy_lossless_methods_draw_the_baseline_prior(pipes, method):
    ours, _ = pipes
    base = ours("a cat", **CALL, method="none", prior_temperature=0, generator=seeded())
    out = ours("a cat", **CALL, method=method, prior_temperature=0, generator=seeded(),
               method_knobs={f"{method}_window": 8})
    assert torch.equal(out.images, base.images)
    assert out.stats["nfe"] <= base.stats["nfe"]
    # the greedy prior itself equals transformers' generate at the pipeline's inputs
    from mmspec.pipelines.glm_image import check_method

    ours._prior_call = {"recipe": check_method(method, None), "temperature": 0, "generator": None, "stats": {}}
    try:
        tokens = ours.generate_prior_tokens("a cat", 32, 32)[0]
    finally:
        ours._prior_call = None
    inputs = prompt_inputs(ours.vision_language_encoder, ("a cat",))
    expected = hf_greedy(ours.vision_language_encoder, inputs, max_new_tokens(inputs))[:, 256:257]
    assert torch.equal(tokens, ours._upsample_token_ids(expected, 1, 1))


def test_same_prior_tokens_give_diffusers_own_image(pipes):
    ours, theirs = pipes
    out = ours("a cat", **CALL, method="sjd", generator=seeded(3))
    tokens = ours.generate_prior_tokens("a cat", 32, 32, generator=seeded(3))[0]  # method none: same seed, same prior
    theirs_out = theirs("a cat", **CALL, prior_token_ids=tokens, generator=seeded(3))
    assert out.images.shape == (1, 3, 32, 32)
    assert torch.equal(out.images, theirs_out.images)


def test_prior_is_drawn_by_the_method_and_shared_with_diffusers_post_prior_code(pipes, monkeypatch):
    ours, theirs = pipes
    fixed = torch.tensor([[5, 5, 5, 5]])  # token 5 at the 1x1 target grid, upsampled 2x
    monkeypatch.setattr(type(theirs), "generate_prior_tokens", lambda self, **kw: (fixed, None, None))
    monkeypatch.setattr("mmspec.pipelines.glm_image.SpeculativeDecoder.generate",
                        lambda self, rows, n, **kw: type("O", (), {
                            "sequences": torch.cat([torch.zeros(1, 256, dtype=torch.long),
                                                    torch.tensor([[5, 0]])], 1),
                            "lengths": torch.tensor([258]),
                            "stats": type("S", (), {"as_dict": lambda s: {"nfe": 1}})()})())
    a = ours("a cat", **CALL, method="gsd", generator=seeded(1))
    b = theirs("a cat", **CALL, generator=seeded(1))
    assert torch.equal(a.images, b.images) and a.stats == {"nfe": 1}


def test_generator_contracts(pipes):
    ours, _ = pipes
    one = ours("a cat", **CALL, method="sjd", generator=seeded(7))
    two = ours("a cat", **CALL, method="sjd", generator=seeded(7))
    assert torch.equal(one.images, two.images)
    many = ours("a cat", **CALL, method="sjd", num_images_per_prompt=2, generator=[seeded(7), seeded(8)])
    assert many.images.shape == (2, 3, 32, 32)
    # image 0 draws its prior and latents from generator 0's seed (batch-2 DiT numerics: allclose)
    assert torch.allclose(many.images[:1], one.images, atol=1e-5)
    with pytest.raises(ValueError, match="generator"):
        ours("a cat", **CALL, num_images_per_prompt=2, generator=[seeded(7)])


def test_gsd_draws_a_prior_in_range_with_fewer_passes(pipes):
    ours, _ = pipes
    base = ours("a cat", **CALL, method="none", generator=seeded(2))
    out = ours("a cat", **CALL, method="gsd", generator=seeded(2), method_knobs={"sjd_window": 8})
    assert out.images.shape == (1, 3, 32, 32) and torch.isfinite(out.images).all()
    assert out.stats["nfe"] < base.stats["nfe"] == 258


@pytest.mark.parametrize("method, arg", [("zipar", "method"), ("lantern", "method"), ("sd", "method")])
def test_unsupported_methods_are_refused(pipes, method, arg):
    ours, _ = pipes
    with pytest.raises(ValueError, match=arg):
        ours("a cat", **CALL, method=method)


# -- exactness: sampled lossless methods draw the prior's own joint distribution -------------------
from mmspec.core import LogitsProcessor  # noqa: E402
from mmspec.core.acceptance import SpeculativeSampling  # noqa: E402
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue, total_variation  # noqa: E402

N_SAMPLES, N_TOKENS, TOP_K = 3000, 3, 3
SAMPLING = LogitsProcessor(temperature=1.0, top_k=TOP_K)


class SharpenedRule:
    """Broken control: speculative sampling verified against p**2 instead of p."""

    def __init__(self):
        self.rule = SpeculativeSampling()

    def __call__(self, draft, p_all, generator=None):
        sharp = p_all ** 2
        return self.rule(draft, sharp / sharp.sum(-1, keepdim=True), generator)

    def sample(self, p, generator=None):
        return self.rule.sample(p, generator)


@pytest.fixture(scope="module")
def flat_prior():
    model = tiny_prior(seed=1)
    with torch.no_grad():
        model.lm_head.weight.div_(50.0 / 4)  # logits spread enough that all top-3 continuations occur
    return model


def exact_joint_glm(model, inputs):
    """{(t1..tn): probability} of the first N_TOKENS under SAMPLING, by teacher forcing each prefix
    through the target (one prefill of prompt + prefix: the view's own rotary table)."""
    target = GlmImagePriorTarget(model)
    prompt, conditioning = prior_prompts(inputs)
    joint = {(): 1.0}
    for _ in range(N_TOKENS):
        nxt = {}
        for prefix, mass in joint.items():
            ids = torch.tensor([prompt[0] + list(prefix)])
            out = target(ids, torch.arange(ids.shape[1])[None], target.new_cache(1, ids.shape[1]), **conditioning)
            p = SAMPLING(out.logits[:, -1])[0]
            for t in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (t,)] = mass * float(p[t])
        joint = nxt
    return joint


def sampled_pvalue(model, inputs, drafter, rule=None):
    rows, conditioning = prior_prompts(inputs)
    grid = inputs["image_grid_thw"]
    out = SpeculativeDecoder(GlmImagePriorTarget(model), drafter, rule=rule, processor=SAMPLING).generate(
        rows * N_SAMPLES, N_TOKENS, conditioning={"image_grid_thw": grid.repeat(N_SAMPLES, 1),
                                                  "images_per_sample": conditioning["images_per_sample"].repeat(
                                                      N_SAMPLES)},
        generator=torch.Generator().manual_seed(0))
    joint = exact_joint_glm(model, inputs)
    cells = {seq: i for i, seq in enumerate(joint)}
    probs = torch.tensor(list(joint.values()) + [0.0], dtype=torch.float64)
    idx = torch.tensor([cells.get(tuple(s), len(cells)) for s in out.sequences.tolist()])
    return chisquare_pvalue(idx, probs), total_variation(idx, probs), out.stats


@pytest.mark.statistical
@pytest.mark.parametrize("coupling", ["independent", "maximal"])
def test_sampled_jacobi_prior_is_exact(flat_prior, coupling):
    inputs = prompt_inputs(flat_prior)
    pval, tv, stats = sampled_pvalue(flat_prior, inputs, JacobiDrafter(V, window=3, init="repeat", coupling=coupling))
    assert pval >= P_THRESHOLD, (pval, tv)
    assert stats.tau > 1.05  # drafts were accepted: the test saw speculation, not the baseline


@pytest.mark.statistical
def test_baseline_prior_is_exact(flat_prior):
    pval, tv, _ = sampled_pvalue(flat_prior, prompt_inputs(flat_prior), None)
    assert pval >= P_THRESHOLD, (pval, tv)


@pytest.mark.statistical
def test_broken_rule_is_caught(flat_prior):
    pval, tv, _ = sampled_pvalue(flat_prior, prompt_inputs(flat_prior), JacobiDrafter(V, window=3, init="repeat"),
                                 rule=SharpenedRule())
    assert pval < P_THRESHOLD, (pval, tv)
