"""Train a VLM draft head (``mmspec.models.vlm_draft.VLMDraftHead``: ``eagle``, ``specvlm`` or
``vispec``; or ``medusa``: ``mmspec.models.medusa.MedusaHeads``) by online-logit distillation from
a trained VLM target (SpecVLM, Huang et al., 2025): every batch runs the frozen target on the fly
for its features, merged input embeddings and logits; nothing is stored offline. Loss
``1.0 * SmoothL1(features) + 0.1 * CE(target probs)`` on the answer positions (the paper's
weights; EAGLE's loss with online teacher targets). ``vispec`` adds ViSpec's anti-shortcut
rollout (``rollout_steps=2``: the second step feeds the draft its own predicted features).
``medusa``: each head's cross-entropy to the target's distribution of its token, weighted
``0.8 ** k`` (``MedusaHeads.distill_loss``).

Runs the recipes' loop (``mmspec.training.loop``) on ``accelerate``: ``mmspec train vlm-draft ...``
runs in one process, and ``accelerate launch --num_processes 2 -m mmspec train vlm-draft ...``
splits every batch across processes (gloo on the CPU, gradients all-reduced); process 0
evaluates and saves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from ...adapters.vlm import VLMTarget
from ...core.errors import check, check_choice
from ...models.medusa import MedusaHeads
from ...models.vlm_draft import BRANCHES, METHODS as HEAD_METHODS, VLMDraftHead
from ..data.scene_qa import SceneQADataset
from ..loop import new_accelerator, shard, train_loop
from .common import batch_indices, check_checkpoint_dir, check_run_args, heldout_seed, save_atomically, warmup_cosine
from .vlm import collate, encode

METHODS = HEAD_METHODS + ("medusa",)
# rollout steps per method: ViSpec trains on its own predictions, the others teacher-forced
DEFAULT_ROLLOUT = {"eagle": 1, "specvlm": 1, "vispec": 2, "medusa": 1}


def load_target(target_dir: str | Path):
    """The trained VLM in ``target_dir`` (fp32, frozen, eval) as a ``VLMTarget``."""
    from transformers import LlavaForConditionalGeneration

    path = Path(target_dir)
    check(path.is_dir() and (path / "config.json").is_file(), "target_dir",
          "a folder written by 'mmspec train vlm'", str(target_dir))
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32, use_safetensors=True).eval()
    model.requires_grad_(False)
    return VLMTarget(model)


@torch.no_grad()
def teacher(target: VLMTarget, ids, mask, pixels):
    """The target's features (last hidden, normed), merged input embeddings and logits."""
    embeds = target.input_embeds(ids, **target.vision_inputs(pixels))
    out = target.model(inputs_embeds=embeds, attention_mask=mask, output_hidden_states=True)
    return out.hidden_states[-1], embeds, out.logits


def answer_mask(ids: torch.Tensor, prompt_lens, lengths: torch.Tensor) -> torch.Tensor:
    """(R, S) positions p whose next token p + 1 is an answer token (the drafted region)."""
    p = torch.arange(ids.shape[1])
    starts = torch.as_tensor(prompt_lens)[:, None] - 1
    return (p >= starts) & (p <= lengths[:, None] - 2)


def distill(head: VLMDraftHead | MedusaHeads, ids, mask, pixels, prompt_lens, rollout_steps: int) -> dict:
    """The head's ``distill_loss`` on a batch, its teacher (the frozen target) run on the fly."""
    feats, embeds, logits = teacher(head.target, ids, mask, pixels)
    lengths = mask.sum(1)
    return head.distill_loss(feats, ids, embeds, logits, lengths, answer_mask(ids, prompt_lens, lengths),
                             rollout_steps=rollout_steps)


@torch.no_grad()
def heldout_top1(head: VLMDraftHead | MedusaHeads, held, pad_id: int, batch_size: int = 32) -> float | list[float]:
    """Teacher-forced top-1 agreement with the target's next token on the held-out answers
    (``MedusaHeads``: one figure per head, head k against the target's token k + 1 after the root)."""
    head.eval()
    pixels, seqs, prompt_lens = held
    hits = total = 0.0
    for i in range(0, len(seqs), batch_size):
        ids, mask, _ = collate(seqs[i : i + batch_size], prompt_lens[i : i + batch_size], pad_id)
        logs = distill(head, ids, mask, pixels[i : i + batch_size], prompt_lens[i : i + batch_size], 1)
        if isinstance(head, MedusaHeads):
            n = logs["count"].double()
            hits, total = hits + logs["top1"].double().nan_to_num() * n, total + n
            continue
        n = int(answer_mask(ids, prompt_lens[i : i + batch_size], mask.sum(1)).sum())
        hits, total = hits + float(logs["step0_top1"]) * n, total + n
    if isinstance(head, MedusaHeads):
        return [round(x, 4) for x in (hits / total).tolist()]
    return hits / total


def train_vlm_draft(out_dir: str | Path, *, method: str, target_dir: str | Path, steps: int, batch_size: int,
                    lr: float, seed: int = 0, dataset_size: int, heldout_size: int = 64, log_every: int = 50,
                    warmup: int = 50, rollout_steps: int | None = None, medusa_heads: int = 6,
                    log: Callable[[str], None] = print) -> dict:
    """Train ``VLMDraftHead(method)`` (``MedusaHeads`` for ``"medusa"``) for the VLM in ``target_dir`` on ``SceneQADataset(dataset_size,
    seed)`` and save it to ``out_dir`` (fp16 safetensors, atomically) with ``train_log.json``, whose
    dict is returned: ``recipe``, ``method``, ``seed``, ``steps``, ``config``, ``train``,
    ``final_loss``, ``heldout_top1`` (teacher-forced agreement with the target's next token on
    held-out answers), ``branch_counts`` (SpecVLM: training picks per branch), ``parameters``
    (the head's own, the shared embedding and LM head excluded), ``processes``, ``wall_time_s``.

    ``batch_size`` is the global batch: under ``accelerate launch`` each of the N processes takes
    ``batch_size / N`` of it. ``medusa_heads``: K for ``method="medusa"`` (ignored otherwise)."""
    check_choice("method", method, METHODS)
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                         dataset_size=dataset_size, heldout_size=heldout_size, log_every=log_every,
                         log=log, warmup=warmup)
    check_checkpoint_dir(target_dir, "target_dir", "a folder written by 'mmspec train vlm'", processor=True)
    rollout_steps = DEFAULT_ROLLOUT[method] if rollout_steps is None else rollout_steps
    check(isinstance(rollout_steps, int) and rollout_steps >= 1, "rollout_steps", "an int >= 1", rollout_steps)
    check(isinstance(medusa_heads, int) and medusa_heads >= 1, "medusa_heads", "an int >= 1", medusa_heads)
    # SpecVLM's gate leaves the unchosen branches without gradients
    accelerator = new_accelerator("train_vlm_draft", distributed=True, find_unused_parameters=method == "specvlm")
    procs = accelerator.num_processes
    check(batch_size % procs == 0, "batch_size", f"a multiple of the process count ({procs})", batch_size)
    main = accelerator.is_main_process
    say = log if main else (lambda msg: None)
    start = time.perf_counter()

    target = load_target(target_dir)
    processor_dir = Path(target_dir)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(processor_dir)
    pad_id = processor.tokenizer.pad_token_id
    pixels, seqs, prompt_lens = encode(processor, SceneQADataset(dataset_size, seed))
    held = encode(processor, SceneQADataset(heldout_size, heldout_seed(seed)))

    torch.manual_seed(seed)
    if method == "medusa":
        head = MedusaHeads.from_target(target, num_heads=medusa_heads)
    else:
        head = VLMDraftHead.from_target(target, method=method)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup=warmup, steps=steps))
    torch.manual_seed(seed + 1 + accelerator.process_index)  # pruning and Gumbel draws differ per process

    generator = torch.Generator().manual_seed(seed)  # the same batch order on every process

    def batches():
        for batch in batch_indices(len(seqs), batch_size, steps, generator):
            idx = shard(batch, accelerator).tolist()
            ids, mask, _ = collate([seqs[i] for i in idx], [prompt_lens[i] for i in idx], pad_id)
            yield ids, mask, pixels[idx], [prompt_lens[i] for i in idx]

    branch_counts = [0] * len(BRANCHES)

    def loss(head, batch):
        logs = distill(head, *batch, rollout_steps)
        for b in logs.get("branches", ()):
            if b >= 0:
                branch_counts[b] += 1
        return logs

    loss_value = train_loop(head, optimizer, batches(), loss, steps=steps, accelerator=accelerator,
                            schedule=schedule, grad_clip=0.5, name=f"vlm-draft {method}", log=say, log_every=log_every)

    accelerator.wait_for_everyone()
    record = None
    if main:
        top1 = heldout_top1(head, held, pad_id)
        say(f"vlm-draft {method} held-out top-1 agreement {top1}")
        record = dict(recipe="vlm-draft", method=method, seed=seed, steps=steps, config=dict(head.config),
                      train=dict(batch_size=batch_size, lr=lr, dataset_size=dataset_size, warmup=warmup,
                                 rollout_steps=rollout_steps, target_dir=str(target_dir)),
                      final_loss=loss_value, heldout_top1=top1,
                      branch_counts=dict(zip(BRANCHES, branch_counts)) if method == "specvlm" else None,
                      parameters=sum(p.numel() for p in head.parameters()), processes=procs,
                      wall_time_s=round(time.perf_counter() - start, 1))
        record["config"] = {k: v for k, v in record["config"].items() if not k.startswith("_")}
        save_atomically(head.eval(), out, record)
    accelerator.wait_for_everyone()
    return record
