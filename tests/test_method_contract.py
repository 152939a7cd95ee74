"""The contract every registered lossless method keeps, from one parametrised test: greedy
decoding equals ``method="none"`` token for token, for every modality with a tiny pipeline.

- ``ar-image``: tiny random components built here (a one-layer LlamaGen target and draft, random
  EAGLE and Medusa heads: a method that needs a trained component gets a random one);
- ``vlm``: the bundled tiny VLM (``assets/vlm``, every head present);
- ``continuous`` is not parametrised here: its heads sample densities, so there is no greedy
  decoding to compare; its methods' exactness is the seeded distribution (PIT) tests with broken
  controls of ``tests/test_continuous_core.py`` and ``tests/test_continuous_jacobi.py``.

The sampled half of the contract (a distribution test that a deliberately broken rule fails)
lives beside each family's decoder: ``tests/test_exactness.py`` and ``tests/test_vlm_pipeline.py``.
"""

from pathlib import Path

import pytest
import torch

from mmspec import methods
from mmspec.models.eagle import EagleDraftHead
from mmspec.models.llamagen import LlamaGenModel
from mmspec.models.medusa import GridMedusaHeads
from mmspec.models.vq import TinyVQModel
from mmspec.pipelines import SpeculativeARImagePipeline, SpeculativeVLMPipeline

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
