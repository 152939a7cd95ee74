"""A modality in one file: the example of ``docs/guides/add-a-modality.md``.

``toy-seq`` continues integer sequences with a tiny causal LM. Everything the rest of mmspec needs
is declared here, and nothing else in mmspec names it:

- the registry modality and its methods (``none``, and ``jacobi``: the ``text`` modality's Jacobi
  drafter part, registered for this modality too);
- the target model (``ToySeqModel``, a diffusers ``ModelMixin`` around ``TinyCausalLM``) and the
  pipeline (``ToySequencePipeline``, a ``SpeculativePipeline``: the diffusers contract over the
  core's one loop);
- the ``ModalitySpec``: batch jobs (``prompt``: space-separated ints, ``max_new_tokens``; one
  ``.txt`` per job), ``mmspec generate toy-seq`` (``TOY_GENERATE``), a demo tab (``toy_tab``), the GPU
  check's driver (``ToySeqCheck``) and the cost bench's target (``ToySeqCost``).

Importing this module registers it; ``unregister()`` takes it away again
(``tests/test_one_file_modality.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.utils import BaseOutput

from mmspec import methods, serve
from mmspec.bench.cost.config import TARGET
from mmspec.bench.cost.curves import cached_probe
from mmspec.bench.cost.targets import watch_components
from mmspec.bench.gpu_check import PipelineCheck
from mmspec.commands.generate import GenerateCommand
from mmspec.core import LogitsProcessor
from mmspec.core.errors import check, check_int
from mmspec.models import TinyCausalLM, TinyLMConfig
from mmspec.pipelines.base import SpeculativePipeline

KIND = "toy-seq"


# -- the registry modality ------------------------------------------------------------------------
methods.register_modality(KIND, components=("target",), doc="integer sequences from a tiny causal LM (a toy)")
methods.register_part(methods.parts("text")["jacobi"], modalities=(KIND,))
methods.register_method("none", "", doc="target only (baseline)", modalities=(KIND,))
methods.register_method("jacobi", doc="Jacobi window (SJD's drafts, no draft model)", modalities=(KIND,))


# -- the model and the pipeline --------------------------------------------------------------------
class ToySeqModel(ModelMixin, ConfigMixin):
    """``TinyCausalLM`` as a diffusers model (saved and loaded with the pipeline): the core's
    ``Target`` protocol, ``forward(tokens, positions, cache, tree_mask)``."""

    @register_to_config
    def __init__(self, vocab_size: int = 16, dim: int = 16, n_layers: int = 1):
        super().__init__()
        self.lm = TinyCausalLM(TinyLMConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=2,
                                            mlp_hidden=2 * dim, init_std=0.5))

    @property
    def vocab_size(self) -> int:
        return self.lm.vocab_size

    def new_cache(self, *args, **kwargs):
        return self.lm.new_cache(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.lm(*args, **kwargs)


@dataclass
class ToySeqOutput(BaseOutput):
    tokens: list[list[int]]
    stats: dict


class ToySequencePipeline(SpeculativePipeline):
    """``pipe(prompt_ids, method=..., max_new_tokens=...)``: each prompt's continuation."""

    modality = KIND
    model_cpu_offload_seq = "transformer"
    _method_components = {"target": "transformer"}

    def __init__(self, transformer, **components):
        super().__init__()
        self.register_modules(transformer=transformer, **self.method_modules(components))

    def base_components(self, requires: tuple[str, ...]) -> dict:
        return {"target": self.transformer}

    @torch.no_grad()
    def __call__(self, prompt_ids: list[list[int]], *, method: str = "none", max_new_tokens: int = 8,
                 temperature: float = 0.0, generator: torch.Generator | list[torch.Generator] | None = None,
                 method_knobs: dict | None = None, return_dict: bool = True):
        vocab = self.transformer.vocab_size
        check(isinstance(prompt_ids, list) and len(prompt_ids) > 0 and all(
            isinstance(p, list) and len(p) == len(prompt_ids[0]) > 0 and all(
                isinstance(t, int) and 0 <= t < vocab for t in p) for p in prompt_ids), "prompt_ids",
            f"a non-empty list of equally long non-empty lists of ints in [0, {vocab})", prompt_ids)
        check_int(max_new_tokens, "max_new_tokens", 1)
        recipe = self.check_shared_inputs(method=method, method_knobs=method_knobs, batch_size=len(prompt_ids),
                                          generator=generator, return_dict=return_dict, callback_on_step_end=None,
                                          callback_on_step_end_tensor_inputs=())
        rows = len(prompt_ids)
        out = self.decode(recipe, LogitsProcessor(temperature=temperature), torch.tensor(prompt_ids), max_new_tokens,
                          tokens_done=lambda state: sum(max(0, n) for n in state.generated) // rows,
                          generator=generator)
        tokens = [[int(t) for t in row[:max_new_tokens]] for row in out.sequences]
        if not return_dict:
            return (tokens,)
        return ToySeqOutput(tokens=tokens, stats=out.stats.as_dict())


def build_pipeline(folder: str | Path, seed: int = 0) -> Path:
    """A toy pipeline saved in ``folder`` (random weights under ``seed``, spread so greedy outputs vary)."""
    torch.manual_seed(seed)
    model = ToySeqModel().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(0.6 * torch.randn(p.shape, generator=gen))
    ToySequencePipeline(transformer=model).save_pretrained(str(folder))
    return Path(folder)


# -- serving: batch jobs, generate, the demo tab ----------------------------------------------------
def parse_prompt(text: str) -> list[int]:
    """``"3 1 4"`` -> ``[3, 1, 4]``; ``ValueError`` naming ``prompt`` otherwise."""
    words = str(text).split()
    check(len(words) > 0 and all(w.isdigit() for w in words), "prompt", "space-separated ints >= 0, e.g. '3 1 4'",
          text)
    return [int(w) for w in words]


def run_toy(models: serve.Models, prompts: list[str], seeds: list[int], method: str, knobs: dict | None,
            max_new_tokens: int = 8) -> list[serve.Result]:
    pipe = models.pipeline(KIND)
    t0 = time.perf_counter()
    out = pipe([parse_prompt(p) for p in prompts], method=method, method_knobs=dict(knobs or {}),
               max_new_tokens=max_new_tokens, generator=serve.base.generators(seeds))
    stats = serve.base.plain_stats(out.stats, time.perf_counter() - t0, len(prompts))
    return [serve.Result(stats=stats, text=" ".join(map(str, t)), tokens=t) for t in out.tokens]


def _check_job(params: dict, method: str, knobs: dict, base) -> None:
    parse_prompt(params["prompt"])
    check_int(params["max_new_tokens"], "max_new_tokens", 1, 64)


def _run_jobs(models, jobs, seeds, method, knobs):
    return run_toy(models, [j["prompt"] for j in jobs], seeds, method, knobs, jobs[0]["max_new_tokens"])


def _add_generate(kinds) -> None:
    p = kinds.add_parser(KIND, help="continue integer sequences with a toy causal LM")
    p.add_argument("--prompt", required=True, help='space-separated ints, e.g. "3 1 4"')
    p.add_argument("--method", default="none", choices=methods.names(KIND))
    p.add_argument("--knob", action="append", metavar="KEY=VALUE")
    p.add_argument("--model", required=True, metavar="DIR", help="the pipeline folder")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quiet", action="store_true")


def _generate(args) -> int:
    pipe = serve.spec(KIND).load(args.model)
    out = pipe([parse_prompt(args.prompt)], method=args.method, method_knobs=args.method_knobs,
               max_new_tokens=args.max_new_tokens)
    print(" ".join(map(str, out.tokens[0])))
    print(f"-- method {args.method}: {out.stats['nfe']} target passes")
    return 0


TOY_GENERATE = GenerateCommand(_add_generate, _generate)


DEMO_MODELS = serve.Models()
"""The pipelines the toy's demo tab runs (loaded on its first click, shared by every click)."""


def toy_continue(text: str, method: str) -> str:
    """The tab's click: the continuation of ``text`` by ``method``, seed 0."""
    return run_toy(DEMO_MODELS, [text], [0], method, None)[0].text


def toy_tab():
    """The demo tab: a prompt box, a method dropdown, the continuation."""
    import gradio as gr

    prompt = gr.Textbox(label="prompt (ints)", value="3 1 4", elem_id="toy-prompt")
    method = gr.Dropdown(choices=list(methods.names(KIND)), value="none", label="method", elem_id="toy-method")
    answer = gr.Textbox(label="continuation", interactive=False, elem_id="toy-answer")
    go = gr.Button("Continue", elem_id="toy-run")
    go.click(toy_continue, inputs=[prompt, method], outputs=answer, api_name="toy_continue")


# -- the GPU check and the cost bench ---------------------------------------------------------------
class ToySeqCheck(PipelineCheck):
    """The GPU check's driver: greedy identity of ``jacobi``, speed and offload on two prompts."""

    name = KIND
    seconds = 20.0
    methods = ("jacobi",)
    speed_methods = ("none", "jacobi")
    offload_methods = ("none", "jacobi")

    def load(self, dtype, device):
        return ToySequencePipeline.from_pretrained(self.model_dir, dtype=dtype).to(device)

    def call(self, pipe, method, device, seed=0):
        return pipe([[1, 2, 3], [4, 5, 6]], method=method, max_new_tokens=6,
                    generator=torch.Generator(device).manual_seed(seed))

    def output(self, out):
        return torch.tensor(out.tokens)


class ToySeqCost:
    """The cost bench's target: prompt i is ``[i % 16, 1, 2]``, greedy, 8 new tokens."""

    rows = (("none", "none", {}), ("jacobi", "jacobi", {}))

    def __init__(self, cfg):
        self.cfg = cfg
        self.pipe = ToySequencePipeline.from_pretrained(cfg.folder(KIND))
        self.pipe.set_progress_bar_config(disable=True)

    def component(self, role: str):
        return getattr(self.pipe, role, None)

    def call(self, method: str, knobs: dict, i: int) -> int:
        out = self.pipe([[i % 16, 1, 2]], method=method, method_knobs=knobs or None, max_new_tokens=8)
        return len(out.tokens[0])

    def watch(self, timer, roles: set[str]) -> None:
        timer.watch(TARGET, self.pipe.transformer, 0, 3)
        watch_components(timer, self.pipe, roles)

    def probes(self, roles: set[str], width: int):
        model, prefix = self.pipe.transformer, 6
        g = torch.Generator().manual_seed(self.cfg.seed)
        cache = model.new_cache(1, prefix + width + 1)
        model(torch.randint(16, (1, prefix), generator=g), torch.arange(prefix)[None], cache)
        return prefix, {TARGET: cached_probe(model, cache, prefix, prefix,
                                             lambda T: (torch.randint(16, (1, T), generator=g),))}


# -- the one declaration ----------------------------------------------------------------------------
SPEC = serve.register(serve.ModalitySpec(
    KIND, title="Toy sequences", pipeline=f"{__name__}:ToySequencePipeline", batchable=lambda method, t: False,
    run_jobs=_run_jobs, job_fields={"prompt": serve.JobField(str, required=True),
                                    "max_new_tokens": serve.JobField(int, 8)},
    per_job=("prompt",), output_ext=".txt", check_job=_check_job, generate=f"{__name__}:TOY_GENERATE",
    demo_tab=f"{__name__}:toy_tab", device_check=f"{__name__}:ToySeqCheck", cost_target=f"{__name__}:ToySeqCost"))


def unregister() -> None:
    """Take the toy away again (the spec, its methods, its part, the modality)."""
    from mmspec.methods import registry

    serve.unregister(KIND)
    registry._MODALITIES.pop(KIND)

