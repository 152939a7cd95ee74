"""Record the Wan parity fixtures (``tests/fixtures/wan_parity/``) from the reference code itself.

    python scripts/wan_parity_fixtures.py --self-forcing PATH/Self-Forcing --longlive PATH/LongLive \
        --causvid PATH/CausVid

PATH/...: checkouts of guandeh17/Self-Forcing (33593df), NVlabs/LongLive (branch v1.0, e52d9ef)
and tianweiy/CausVid (ca21150). Nothing of them is copied here or committed: each case builds a
tiny ``CausalWanModel`` with the repository's own class, streams a few chunks through the
repository's own inference pipeline (``CausalInferencePipeline.inference``, LongLive's
``InteractiveCausalInferencePipeline.inference`` for the prompt switch, CausVid's
``InferencePipeline.inference``) on the CPU in float32, and
writes the facts: the weights (original key layout), the prompt embeddings, the initial noise, the
re-noising draws, and for every transformer call its input latents, timesteps, start frame, flow
prediction and x0. ``tests/test_wan_parity.py`` replays them through ``load_original_wan`` and
``StreamingVideoPipeline``.

What is replaced, and why (nothing that computes a result):
- the text encoder (UMT5-XXL) and the VAE: the fixture's prompt embeddings stand for the encoder's
  output, the VAE is the identity (the latents are compared, not pixels);
- ``demo_utils.memory`` / ``utils.memory``, ``torch.cuda.current_device``: they ask CUDA for its
  device at import (``wan/modules/t5.py`` as a default argument);
- the sizes the pipelines hard-code for Wan2.1-1.3B (30 blocks, 1560 tokens a frame, caches of
  12 x 128 heads, 512 text tokens, the 32760-token = 21-frame default cache): set to the tiny
  model's, the 21 frames kept;
- ``WanDiffusionWrapper.__init__`` (it loads ``wan_models/`` from disk), and CausVid's
  ``InferencePipeline.__init__`` (it builds that wrapper): their bodies are repeated around the
  tiny model (``_wrapper``, ``_causvid_pipeline``);
- CausVid's re-noising call asks for ``device="cuda"`` (``torch.ones([batch_size],
  device="cuda")`` in ``causal_inference.py``): ``torch.ones`` makes that tensor on the CPU;
- attention: both repositories call flash-attn in bfloat16, or without it ``attention()``'s
  SDPA fallback with its default ``dtype=torch.bfloat16``; here every attention call
  (``wan.modules.model.flash_attention``, ``wan.modules.causal_model.attention``) is that same
  fallback with ``dtype=torch.float32``, so the whole reference runs in float32;
- ``torch.randn_like`` during ``inference``: draws from a seeded ``torch.Generator`` so the
  re-noising noise is reproducible (recorded too).

Each repository runs in its own subprocess (both have top-level ``wan``, ``utils``, ``pipeline``).
Needs ``easydict``, ``ftfy``, ``einops``, ``omegaconf`` importable (the repositories' imports).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "wan_parity"
# the tiny CausalWanModel (its own constructor's names)
MODEL = dict(model_type="t2v", patch_size=(1, 2, 2), text_len=16, in_dim=4, dim=32, ffn_dim=64, freq_dim=32,
             text_dim=24, out_dim=4, num_heads=2, num_layers=2, qk_norm=True, cross_attn_norm=True, eps=1e-6)
# the same model as a diffusers WanTransformer3DModel config (load_original_wan's ``config``)
DIFFUSERS = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                 text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
LATENT = (4, 4, 6)  # channels, h, w: 2 x 3 = 6 tokens a frame
FRAME_TOKENS = 6
REFERENCE_CACHE_FRAMES = 21  # 32760 tokens / 1560 a frame: both pipelines' default cache
WARPED_STEPS = [1000, 750, 500, 250]  # configs/self_forcing_dmd.yaml, configs/longlive_inference.yaml

# name -> (repository, sink_size, local_attn_size, chunks, switch frame or None)
CASES = {
    "self_forcing": ("self-forcing", 0, -1, 3, None),  # as released: a 21-frame cache, no sink, no roll
    "self_forcing_evict": ("self-forcing", 1, 6, 5, None),  # rolls from the third chunk on
    "longlive": ("longlive", 3, 12, 6, None),  # as released: sink 3, 12 frames, rolls from the fifth chunk
    # prompt switches with LongLive's re-cache (global sink): at frame 15 the re-cached frames 3 .. 14
    # lie past the sink, which keeps its K/V; at frame 12 they are frames 0 .. 11, the sink included
    "longlive_switch": ("longlive", 3, 12, 7, 15),
    "longlive_switch_early": ("longlive", 3, 12, 5, 12),
    "causvid": ("causvid", 0, -1, 3, None),  # as released: a 21-frame cache, 3 steps at shift 8
}


def _stub_memory(name: str) -> None:
    """The repositories' memory helpers call ``torch.cuda.current_device()`` at import."""
    stub = types.ModuleType(name)
    stub.gpu = torch.device("cpu")
    stub.get_cuda_free_memory_gb = lambda *a, **k: 0.0
    stub.move_model_to_device_with_memory_preservation = lambda *a, **k: None
    stub.log_gpu_memory = lambda *a, **k: None
    stub.DynamicSwapInstaller = object
    sys.modules[name] = stub


def _wrapper(model, shift: float):
    """``WanDiffusionWrapper(is_causal=True, timestep_shift=shift)`` around ``model``: its
    ``__init__`` without the ``from_pretrained`` (same attributes, same scheduler)."""
    from utils.scheduler import FlowMatchScheduler
    from utils.wan_wrapper import WanDiffusionWrapper

    w = WanDiffusionWrapper.__new__(WanDiffusionWrapper)
    torch.nn.Module.__init__(w)
    w.model = model.eval()
    w.uniform_timestep = False
    w.scheduler = FlowMatchScheduler(shift=shift, sigma_min=0.0, extra_one_step=True)
    w.scheduler.set_timesteps(1000, training=True)
    w.seq_len = REFERENCE_CACHE_FRAMES * FRAME_TOKENS
    w.post_init()
    return w


def _causvid_wrapper(model):
    """CausVid's ``CausalWanDiffusionWrapper()`` around ``model``: ``WanDiffusionWrapper.__init__``
    (causvid/models/wan/wan_wrapper.py) without the ``from_pretrained``: shift 8, 1,000 steps."""
    from causvid.models.wan.flow_match import FlowMatchScheduler
    from causvid.models.wan.wan_wrapper import CausalWanDiffusionWrapper

    w = CausalWanDiffusionWrapper.__new__(CausalWanDiffusionWrapper)
    torch.nn.Module.__init__(w)
    w.model = model.eval()
    w.uniform_timestep = False
    w.scheduler = FlowMatchScheduler(shift=8.0, sigma_min=0.0, extra_one_step=True)
    w.scheduler.set_timesteps(1000, training=True)
    w.seq_len = REFERENCE_CACHE_FRAMES * FRAME_TOKENS
    w.post_init()
    return w


def _causvid_pipeline(generator, text_encoder, vae):
    """CausVid's ``InferencePipeline(args)`` with configs/wan_causal_dmd.yaml's settings
    (``denoising_step_list [1000, 757, 522, 0]``, the trailing 0 dropped; no warp; 3 frames a
    block): its ``__init__`` around the given parts."""
    from causvid.models.wan.causal_inference import InferencePipeline

    pipe = InferencePipeline.__new__(InferencePipeline)
    torch.nn.Module.__init__(pipe)
    pipe.generator, pipe.text_encoder, pipe.vae = generator, text_encoder, vae
    pipe.denoising_step_list = torch.tensor([1000, 757, 522, 0], dtype=torch.long)[:-1]
    pipe.scheduler = generator.get_scheduler()
    pipe.kv_cache1 = pipe.kv_cache2 = None
    pipe.args = None
    pipe.num_frame_per_block = 3
    pipe.local_attn_size = -1  # for _tiny_caches: CausVid's cache is always the 21-frame one
    generator.model.num_frame_per_block = 3
    return pipe


def _tiny_caches(pipe, heads: int, head_dim: int, text_len: int) -> None:
    """The pipeline's cache builders with the tiny model's sizes (theirs hard-code 12 x 128 heads,
    512 text tokens and 32760 tokens for ``local_attn_size == -1``)."""

    def kv(self, batch_size, dtype, device, kv_cache_size_override=None):
        size = kv_cache_size_override
        if size is None:
            frames = REFERENCE_CACHE_FRAMES if self.local_attn_size == -1 else self.local_attn_size
            size = frames * self.frame_seq_length
        self.kv_cache1 = [{"k": torch.zeros([batch_size, size, heads, head_dim], dtype=dtype, device=device),
                           "v": torch.zeros([batch_size, size, heads, head_dim], dtype=dtype, device=device),
                           "global_end_index": torch.tensor([0], dtype=torch.long, device=device),
                           "local_end_index": torch.tensor([0], dtype=torch.long, device=device)}
                          for _ in range(self.num_transformer_blocks)]

    def cross(self, batch_size, dtype, device):
        self.crossattn_cache = [{"k": torch.zeros([batch_size, text_len, heads, head_dim], dtype=dtype, device=device),
                                 "v": torch.zeros([batch_size, text_len, heads, head_dim], dtype=dtype, device=device),
                                 "is_init": False} for _ in range(self.num_transformer_blocks)]

    pipe._initialize_kv_cache = types.MethodType(kv, pipe)
    pipe._initialize_crossattn_cache = types.MethodType(cross, pipe)


def _max_attention(model, local_attn_size: int) -> None:
    """``max_attention_size``: 32760 (21 frames) for -1, else ``local_attn_size * 1560``, in the
    tiny model's tokens."""
    frames = REFERENCE_CACHE_FRAMES if local_attn_size == -1 else local_attn_size
    for m in model.modules():
        if hasattr(m, "max_attention_size"):
            m.max_attention_size = frames * FRAME_TOKENS


def record(name: str, repo: str, weights: Path) -> None:
    """Run one case inside ``repo`` (this process has it first on ``sys.path``) and write
    ``OUT / f"{name}.safetensors"``."""
    flavour, sink, local, chunks, switch = CASES[name]
    sys.path.insert(0, repo)
    _stub_memory("demo_utils.memory")
    _stub_memory("utils.memory")
    torch.cuda.current_device = lambda: 0  # wan/modules/t5.py's default argument, never used here
    from omegaconf import OmegaConf

    if flavour == "causvid":
        from causvid.models.wan.causal_model import CausalWanModel
        from causvid.models.wan.wan_base.modules import attention as attention_module, model as wan_model

        causal_model = sys.modules[CausalWanModel.__module__]
        kwargs = {}
    else:
        from wan.modules import attention as attention_module, causal_model, model as wan_model
        from wan.modules.causal_model import CausalWanModel

        kwargs = dict(local_attn_size=local, sink_size=sink)

    def float32_attention(q, k, v, **kwargs):  # attention()'s SDPA fallback, in float32
        kwargs.pop("dtype", None)
        return attention_module.attention(q, k, v, dtype=torch.float32, **kwargs)

    attention_module.FLASH_ATTN_2_AVAILABLE = attention_module.FLASH_ATTN_3_AVAILABLE = False
    wan_model.flash_attention = causal_model.attention = float32_attention

    torch.manual_seed(0)
    model = CausalWanModel(**MODEL, **kwargs)
    if weights.exists():
        model.load_state_dict(load_file(str(weights)), strict=True)
    else:  # Wan's init zeroes the head: random everywhere, so no output is trivially zero
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() < 2 else p.shape[-1] ** -0.5))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    _max_attention(model, local)
    gen = _causvid_wrapper(model) if flavour == "causvid" else _wrapper(model, shift=5.0)
    B, (C, h, w), frames = 1, LATENT, 3 * chunks
    g = torch.Generator().manual_seed(7)
    embeds = [torch.randn(B, MODEL["text_len"], MODEL["text_dim"], generator=g) for _ in range(2)]
    embeds[0][:, 5:] = 0.0  # padding rows are zero, as WanTextEncoder leaves them
    embeds[1][:, 9:] = 0.0
    noise = torch.randn(B, frames, C, h, w, generator=g)

    class TextEncoder(torch.nn.Module):  # the fixture's embeddings by prompt text
        def forward(self, text_prompts):
            return {"prompt_embeds": embeds[int(text_prompts[0][-1])].clone()}

    class VAE(torch.nn.Module):
        def decode_to_pixel(self, latent, use_cache=False):
            return latent

    args = OmegaConf.create(dict(denoising_step_list=WARPED_STEPS, warp_denoising_step=True, num_frame_per_block=3,
                                 independent_first_frame=False, context_noise=0, global_sink=True,
                                 model_kwargs=dict(local_attn_size=local, sink_size=sink, timestep_shift=5.0)))
    if flavour == "causvid":
        pipe = _causvid_pipeline(gen, TextEncoder(), VAE())
    elif switch is None:
        from pipeline.causal_inference import CausalInferencePipeline as Pipe
    else:
        from pipeline.interactive_causal_inference import InteractiveCausalInferencePipeline as Pipe
    if flavour != "causvid":
        pipe = Pipe(args, "cpu", generator=gen, text_encoder=TextEncoder(), vae=VAE())
    pipe.num_transformer_blocks, pipe.frame_seq_length = MODEL["num_layers"], FRAME_TOKENS
    _tiny_caches(pipe, MODEL["num_heads"], MODEL["dim"] // MODEL["num_heads"], MODEL["text_len"])

    calls, flows = [], []
    forward, model_forward = gen.forward, gen.model.forward

    def model_recorded(*a, **k):  # CausVid's wrapper returns x0 alone: the flow is the model's output
        out = model_forward(*a, **k)
        flows.append(out.permute(0, 2, 1, 3, 4).clone())
        return out

    def recorded(*a, **k):
        out = forward(*a, **k)
        flow, x0 = (flows[-1], out) if flavour == "causvid" else out
        x = k["noisy_image_or_video"]
        calls.append(dict(x=x.clone(), t=k["timestep"].to(torch.float64).clone(),
                          start=torch.tensor([k["current_start"] // FRAME_TOKENS]), flow=flow.clone(),
                          x0=x0.clone(), second_prompt=torch.tensor([int(k["conditional_dict"]["prompt_embeds"]
                                                                      .equal(embeds[1]))])))
        return out

    gen.forward, gen.model.forward = recorded, model_recorded
    eps, draws = torch.Generator().manual_seed(11), []
    randn_like = torch.randn_like

    def drawn(t, **_):
        e = torch.randn(t.shape, generator=eps, dtype=t.dtype)
        draws.append(e.clone())
        return e

    ones = torch.ones

    def on_cpu(*a, device=None, **k):  # CausVid's re-noising asks for device="cuda"
        return ones(*a, device="cpu" if str(device).startswith("cuda") else device, **k)

    torch.randn_like, torch.ones = drawn, on_cpu
    try:
        with torch.no_grad():
            if flavour == "causvid":
                _, out = pipe.inference(noise, text_prompts=["p0"], return_latents=True)
            elif switch is None:
                _, out = pipe.inference(noise, text_prompts=["p0"], return_latents=True)
            else:
                _, out = pipe.inference(noise, text_prompts_list=[["p0"], ["p1"]], switch_frame_indices=[switch],
                                        return_latents=True)
    finally:
        torch.randn_like, torch.ones = randn_like, ones
    tensors = {"noise": noise, "output": out, "prompt.0": embeds[0], "prompt.1": embeds[1],
               "timesteps": pipe.denoising_step_list.to(torch.float64)}
    tensors.update({f"eps.{i}": e for i, e in enumerate(draws)})
    for i, c in enumerate(calls):
        tensors.update({f"{key}.{i}": v for key, v in c.items()})
    meta = dict(case=name, repository=flavour, sink_size=str(sink), local_attn_size=str(local), chunks=str(chunks),
                switch_frame=str(-1 if switch is None else switch), eps_seed="11", calls=str(len(calls)),
                config=json.dumps(DIFFUSERS), latent=json.dumps(LATENT), text_len=str(MODEL["text_len"]))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(OUT / f"{name}.safetensors"), metadata=meta)
    print(f"{name}: {len(calls)} transformer calls, {len(draws)} re-noising draws")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--self-forcing", help="a checkout of guandeh17/Self-Forcing")
    ap.add_argument("--longlive", help="a checkout of NVlabs/LongLive (branch v1.0)")
    ap.add_argument("--causvid", help="a checkout of tianweiy/CausVid")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    ap.add_argument("--repo", help=argparse.SUPPRESS)
    a = ap.parse_args()
    weights = OUT / "weights.safetensors"
    if a.case:
        return record(a.case, a.repo, weights)
    OUT.mkdir(parents=True, exist_ok=True)
    repos = {"self-forcing": a.self_forcing, "longlive": a.longlive, "causvid": a.causvid}
    for name, (flavour, *_) in CASES.items():
        if repos[flavour] is None:
            print(f"{name}: skipped (no --{flavour} checkout given)")
            continue
        subprocess.run([sys.executable, __file__, "--case", name, "--repo", os.path.abspath(repos[flavour])],
                       check=True, cwd=repos[flavour])


if __name__ == "__main__":
    main()
