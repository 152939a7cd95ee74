"""``mmspec bench glm-image``: ``SpeculativeGlmImagePipeline`` on a tiny random GLM-Image, and the
builder of that pipeline (the tests use it too).

The pipeline is built from constructors under a seed (nothing downloaded): a tiny
``GlmImageForConditionalGeneration`` prior (``VISION_VOCAB`` image tokens, its ``lm_head`` scaled
up so that random weights do not give near-uniform logits), a two-layer T5 glyph encoder with
``ByT5Tokenizer``, a tiny ``GlmImageTransformer2DModel`` and ``AutoencoderKL``, and
``TinyGlmProcessor``, a stand-in for ``GlmImageProcessor`` that writes the same prompt layout and
target grids from a toy byte tokenizer. At 32 x 32 pixels the prior decodes 1 + 256 + 1 tokens (a
16 x 16 preview grid, a 1 x 1 target grid, one more token).

The bench: rows ``none``, ``sjd``, ``mcsjd``, ``gsd`` (the registry's default knobs, the prior's
own sampling: temperature 1, top-k 50), images outer and rows inner (image ``i``: prompt ``i``,
seed ``seed + i``, the same for every row), after one untimed warm-up call per row. Per row:
prior passes per image (the decode's ``nfe``), ``x`` fewer passes than ``none``, ``tau`` (and
``alpha`` where the decode reports it), the prior's wall seconds per image (``generate_prior_tokens``
timed alone) and its ratio to ``none``'s, and the whole pipeline's seconds per image. The weights
are RANDOM: acceptance (``tau``, ``alpha``, passes) is not representative of GLM-Image's; the
rows measure that the methods run end to end in diffusers' pipeline and what a pass costs here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..core.errors import check, check_int

VISION_VOCAB = 128  # the prior's vision_vocab_size: the image tokens it samples
NOTE = ("GLM-Image, tiny and RANDOM weights (nothing downloaded): acceptance (tau, alpha, passes) is not "
        "representative of the real model; wall times are this machine's")


def tiny_prior(seed: int = 0):
    """A random ``GlmImageForConditionalGeneration`` (hidden size 32, two layers, ``VISION_VOCAB``
    image tokens), eager attention, ``lm_head`` scaled by 50 (sharp logits: no argmax ties)."""
    from transformers import GlmImageConfig, GlmImageForConditionalGeneration

    config = GlmImageConfig(
        text_config={"vocab_size": 16512, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 512,
                     "vision_vocab_size": VISION_VOCAB, "pad_token_id": 16500,
                     "rope_parameters": {"mrope_section": (4, 2, 2)}},
        vision_config={"depth": 2, "hidden_size": 32, "num_heads": 2, "image_size": 32, "patch_size": 8,
                       "intermediate_size": 32},
        vq_config={"embed_dim": 32, "num_embeddings": VISION_VOCAB, "latent_channels": 32})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GlmImageForConditionalGeneration(config).eval()
    with torch.no_grad():  # random weights give near-uniform logits: sharpen them so argmax ties can't happen
        model.lm_head.weight.mul_(50.0)
    return model


class TinyGlmProcessor:
    """``GlmImageProcessor.apply_chat_template``'s text-to-image outputs from a toy byte tokenizer:
    ``text <sop>h w<eop><sop>ph pw<eop><image start>`` and the two target grids."""

    def __init__(self, image_start_token_id, sop=16400, eop=16401):
        self.start, self.sop, self.eop = image_start_token_id, sop, eop

    def _ids(self, text, h, w):
        from transformers.models.glm_image.processing_glm_image import GlmImageProcessor

        th, tw, ph, pw = GlmImageProcessor._get_target_shape(None, h, w)
        body = [16000 + b for b in text.encode()[:60]]
        return body + [self.sop, 16100 + th, 16100 + tw, self.eop, self.sop, 16100 + ph, 16100 + pw, self.eop,
                       self.start], GlmImageProcessor._build_target_image_grid_thw(th, tw, ph, pw, True)

    def apply_chat_template(self, messages, tokenize=True, padding=False, target_h=32, target_w=32,
                            return_dict=True, return_tensors="pt"):
        from transformers import BatchFeature

        texts = [m[0]["content"][-1]["text"] for m in messages]
        rows, grids = zip(*(self._ids(t, target_h, target_w) for t in texts))
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding, as the processor pads
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return BatchFeature({"input_ids": ids, "attention_mask": mask, "image_grid_thw": torch.cat(grids),
                             "images_per_sample": torch.tensor([2] * len(rows))})


def tiny_glm_image_components(seed: int = 0) -> dict:
    """``GlmImagePipeline``'s components, tiny and random under ``seed``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImageTransformer2DModel
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    text_encoder = T5EncoderModel(T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                           relative_attention_num_buckets=8)).eval()
    prior = tiny_prior(seed)
    torch.manual_seed(seed)
    transformer = GlmImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                             attention_head_dim=8, num_attention_heads=2, text_embed_dim=32,
                                             time_embed_dim=16, condition_dim=8,
                                             prior_vq_quantizer_codebook_size=VISION_VOCAB)
    torch.manual_seed(seed)
    vae = AutoencoderKL(block_out_channels=(4, 8, 16, 16), in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                        latent_channels=4, norm_num_groups=4, sample_size=128, latents_mean=[0.0] * 4,
                        latents_std=[1.0] * 4)
    return {"tokenizer": ByT5Tokenizer(), "processor": TinyGlmProcessor(prior.config.image_start_token_id),
            "text_encoder": text_encoder, "vision_language_encoder": prior, "vae": vae, "transformer": transformer,
            "scheduler": FlowMatchEulerDiscreteScheduler()}


def tiny_glm_image_pipeline(seed: int = 0):
    """A ``SpeculativeGlmImagePipeline`` over ``tiny_glm_image_components(seed)``, progress bars off."""
    from ..pipelines.glm_image import SpeculativeGlmImagePipeline

    pipe = SpeculativeGlmImagePipeline(**tiny_glm_image_components(seed))
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -- the bench ----------------------------------------------------------------------------------------
DEFAULT_PROMPTS = ("a red fox in snow", "a lighthouse at dusk", "a bowl of ramen", "a cat on a windowsill",
                   "a neon street sign that reads OPEN", "a paper boat on a pond", "an old map of an island",
                   "a bicycle leaning on a wall")
DEFAULT_METHODS = ("none", "sjd", "mcsjd", "gsd")
CALL = {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 1.5, "max_sequence_length": 16,
        "output_type": "pt"}


@dataclass
class GlmImageBenchConfig:
    """One run; ``quick()`` is the smaller version (two prompts)."""

    methods: tuple = DEFAULT_METHODS  # the first is the baseline the ratios divide by
    images: int = 8  # image i: DEFAULT_PROMPTS[i % 8], seed + i
    seed: int = 0
    model_seed: int = 0

    @classmethod
    def quick(cls, **kw) -> "GlmImageBenchConfig":
        return cls(**{"images": 2, **kw})


def _check(cfg: GlmImageBenchConfig) -> None:
    from ..pipelines.glm_image import check_method

    check_int(cfg.images, "images", 1)
    check(isinstance(cfg.methods, (tuple, list)) and len(cfg.methods) >= 1, "methods", "a non-empty tuple",
          cfg.methods)
    for method in cfg.methods:
        check_method(method, None)


def prior_token_count(pipe, height: int = CALL["height"], width: int = CALL["width"]) -> int:
    """How many tokens the prior decodes per image at ``height`` x ``width`` (the pipeline's own
    ``max_new_tokens``)."""
    msgs = [[{"role": "user", "content": [{"type": "text", "text": "x"}]}]]
    grids = pipe.processor.apply_chat_template(msgs, target_h=height, target_w=width)["image_grid_thw"]
    return int(pipe._compute_generation_params(grids, True)[0])


def run(cfg: GlmImageBenchConfig, progress=None) -> dict:
    _check(cfg)
    say = progress or (lambda msg: None)
    say("building the tiny random GLM-Image pipeline")
    pipe = tiny_glm_image_pipeline(cfg.model_seed)
    prior_seconds = []
    original = pipe.generate_prior_tokens

    def timed_prior(*args, **kwargs):  # diffusers calls self.generate_prior_tokens: the instance attribute wins
        start = time.perf_counter()
        out = original(*args, **kwargs)
        prior_seconds.append(time.perf_counter() - start)
        return out

    pipe.generate_prior_tokens = timed_prior

    def call(method, i):
        prior_seconds.clear()
        start = time.perf_counter()
        out = pipe(DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)], **CALL, method=method,
                   generator=torch.Generator().manual_seed(cfg.seed + i))
        total = time.perf_counter() - start
        check(len(prior_seconds) == 1, "the pipeline", "one prior decode per call", len(prior_seconds))
        return out.stats, prior_seconds[0], total

    for method in cfg.methods:
        say(f"warm-up {method}")
        call(method, cfg.images)  # untimed, an image outside the timed ones
    per = {m: [] for m in cfg.methods}
    for i in range(cfg.images):
        say(f"image {i + 1}/{cfg.images}")
        for method in cfg.methods:
            per[method].append(call(method, i))

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    rows = []
    for method in cfg.methods:
        stats = [s for s, _, _ in per[method]]
        row = {"method": method, "images": cfg.images, "nfe": mean([s["nfe"] for s in stats]),
               "tau": mean([s.get("tau") for s in stats]),
               "prior_s": mean([p for _, p, _ in per[method]]), "pipeline_s": mean([t for _, _, t in per[method]]),
               "decode_wall_s": mean([s.get("wall_seconds") for s in stats])}
        if any("alpha" in s for s in stats):
            row["alpha"] = mean([s.get("alpha") for s in stats])
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["nfe_speedup"] = base["nfe"] / row["nfe"]
        row["wall_speedup"] = base["prior_s"] / row["prior_s"]
    setup = {"note": NOTE, "weights": "random", "acceptance_representative": False,
             "prior_tokens_per_image": prior_token_count(pipe), "vision_vocab": VISION_VOCAB,
             "call": {k: v for k, v in CALL.items() if k != "output_type"}, "baseline": cfg.methods[0],
             "images": cfg.images, "seed": cfg.seed, "model_seed": cfg.model_seed,
             "threads": torch.get_num_threads(), "order": "images outer, methods inner; one untimed warm-up per method",
             "sampling": "the prior's generation config (temperature 1, top-k 50)"}
    return {"bench": "glm-image", "setup": setup, "rows": rows}


GLM_IMAGE_COLUMNS = [
    ("method", "method"), ("nfe", "prior passes/image"), ("nfe_speedup", "x fewer passes"), ("tau", "tau"),
    ("alpha", "alpha"), ("prior_ms", "prior ms/image"), ("wall_speedup", "prior wall x"),
    ("pipeline_ms", "pipeline ms/image"),
]
"""The printed table: times in milliseconds (the JSON rows keep ``prior_s`` and ``pipeline_s``)."""


def format_report(result: dict, columns=None) -> str:
    """The header (random weights), the table and its footnote."""
    from . import report

    setup = result["setup"]
    head = (f"GLM-Image bench on a tiny RANDOM-weight pipeline: {setup['images']} images per method, "
            f"{setup['prior_tokens_per_image']} prior tokens per image, {setup['call']['height']} x "
            f"{setup['call']['width']} px, {setup['threads']} thread(s)")
    foot = (f"random weights: acceptance (tau, alpha, passes) is NOT representative of GLM-Image; "
            f"'x fewer passes' and 'prior wall x' are {setup['baseline']}'s over the row's (higher is better); "
            "prior ms = generate_prior_tokens alone, pipeline ms = the whole call (text encoder, prior, DiT, VAE)")
    rows = [dict(r, prior_ms=1000 * r["prior_s"], pipeline_ms=1000 * r["pipeline_s"]) for r in result["rows"]]
    return "\n".join([head, "", report.format_table(rows, columns or GLM_IMAGE_COLUMNS), "", foot])


__all__ = ["GLM_IMAGE_COLUMNS", "GlmImageBenchConfig", "TinyGlmProcessor", "VISION_VOCAB", "format_report",
           "prior_token_count", "run", "tiny_glm_image_components", "tiny_glm_image_pipeline", "tiny_prior"]
