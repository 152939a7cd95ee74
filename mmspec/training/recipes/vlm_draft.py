"""Train a VLM draft head (``mmspec.models.vlm_draft.VLMDraftHead``: ``eagle``, ``specvlm`` or
``vispec``; or ``medusa``: ``mmspec.models.medusa.MedusaHeads``) by online-logit distillation from
a trained VLM target (SpecVLM, Huang et al., 2025): every batch runs the frozen target on the fly
for its features, merged input embeddings and logits; nothing is stored offline. Loss
``1.0 * SmoothL1(features) + 0.1 * CE(target probs)`` on the answer positions (the paper's
weights; EAGLE's loss with online teacher targets). ``vispec`` adds ViSpec's anti-shortcut
rollout (``rollout_steps=2``: the second step feeds the draft its own predicted features).
``medusa``: each head's cross-entropy to the target's distribution of its token, weighted
``0.8 ** k`` (``MedusaHeads.distill_loss``).

The target is any VLM the adapter takes (``FAMILIES``: LLaVA, Qwen2-VL, Qwen2.5-VL) as a
transformers folder with its processor; the head's sizes come from its config and the saved head
is stamped with it (``BoundToTarget.stamp``). The data is the user's conversations in the LLaVA /
ShareGPT layout (``mmspec.training.data.conversations``), rendered with the target's own
processor and chat template, optionally answered again by the target itself (``regenerate``),
or, for a target written by 'mmspec train vlm', the generated scene questions.

Runs the recipes' loop (``mmspec.training.loop``) on ``accelerate``: ``mmspec train vlm-draft ...``
runs in one process, and ``accelerate launch --num_processes 2 -m mmspec train vlm-draft ...``
splits every batch across processes (gloo on the CPU, gradients all-reduced); process 0
evaluates and saves.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ...adapters.vlm import VLMTarget
from ...core.errors import check, check_choice, check_int, is_int
from ...models import load_checkpoint
from ...models.medusa import MedusaHeads
from ...models.vlm_draft import BRANCHES, METHODS as HEAD_METHODS, VLMDraftHead
from ...models.vlm_distill import Rendered, collate_items, distill
from ..data.conversations import load_image, read_conversations, render
from ..data.scene_qa import SceneQADataset
from ..loop import new_accelerator, shard, train_loop
from .common import batch_indices, check_checkpoint_dir, check_run_args, heldout_seed, save_atomically, warmup_cosine
from .vlm import encode, processor_resolution

METHODS = HEAD_METHODS + ("medusa",)
# rollout steps per method: ViSpec trains on its own predictions, the others teacher-forced
DEFAULT_ROLLOUT = {"eagle": 1, "specvlm": 1, "vispec": 2, "medusa": 1}
FAMILIES = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
            "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
"""The transformers VLM families a head is trained for (``config.json``'s ``model_type``: class)."""
MAX_LENGTH = 2048  # a rendered conversation longer than this (tokens) is skipped and counted
TAU_TOKENS = 32  # new tokens per held-out prompt when the held-out tau is measured


def _is_local(target) -> bool:
    return Path(target).exists() or str(target).startswith((".", "/", "~"))


def load_target(target_dir: str | Path):
    """The VLM at ``target_dir`` (fp32, frozen, eval) as a ``VLMTarget``: a transformers model folder
    (or, where there is a network, a hub id) of a family in ``FAMILIES``."""
    import transformers
    from transformers import AutoConfig

    if _is_local(target_dir):
        path = Path(target_dir).expanduser()
        check(path.is_dir() and (path / "config.json").is_file(), "target",
              "a transformers model folder (config.json and safetensors weights) of a LLaVA, Qwen2-VL or "
              "Qwen2.5-VL model", str(target_dir))
    kind = AutoConfig.from_pretrained(str(target_dir)).model_type
    check(kind in FAMILIES, "target", f"a VLM whose model_type is one of {', '.join(FAMILIES)}",
          f"{target_dir} (model_type {kind!r})")
    cls = getattr(transformers, FAMILIES[kind])
    model = cls.from_pretrained(str(target_dir), dtype=torch.float32, use_safetensors=True).eval()
    model.requires_grad_(False)
    return VLMTarget(model)


def vlm_recipe_log(target_dir) -> dict | None:
    """The ``train_log.json`` of a target written by 'mmspec train vlm' (whose vocabulary the
    generated scene data speaks), else None."""
    try:
        log = json.loads((Path(target_dir) / "train_log.json").read_text())
    except (OSError, ValueError):
        return None
    return log if isinstance(log, dict) and log.get("recipe") == "vlm" else None


def scene_items(processor, dataset) -> list[Rendered]:
    """``SceneQADataset`` items in the target recipe's own frame (``vlm.encode``), as ``Rendered``."""
    pixels, seqs, prompt_lens = encode(processor, dataset)
    return [Rendered(s, [False] * n + [True] * (len(s) - n), {"pixel_values": pixels[i]}, n)
            for i, (s, n) in enumerate(zip(seqs, prompt_lens))]


@torch.no_grad()
def heldout_top1(head: VLMDraftHead | MedusaHeads, held: list[Rendered], pad_id: int,
                 batch_size: int = 32) -> float | list[float]:
    """Teacher-forced top-1 agreement with the target's next token on the held-out answers
    (``MedusaHeads``: one figure per head, head k against the target's token k + 1 after the root)."""
    head.eval()
    hits = total = 0.0
    for i in range(0, len(held), batch_size):
        ids, mask, vision, drafted, prompt_lens = collate_items(held[i : i + batch_size], pad_id)
        logs = distill(head, ids, mask, vision, drafted, prompt_lens, 1)
        if isinstance(head, MedusaHeads):
            n = logs["count"].double()
            hits, total = hits + logs["top1"].double().nan_to_num() * n, total + n
            continue
        n = int(drafted.sum())
        hits, total = hits + float(logs["step0_top1"]) * n, total + n
    if isinstance(head, MedusaHeads):
        return [round(x, 4) for x in (hits / total).tolist()]
    return hits / total


@torch.no_grad()
def heldout_tau(head: VLMDraftHead | MedusaHeads, held: list[Rendered], *, method: str,
                max_new_tokens: int = TAU_TOKENS, eos_token_id=None) -> float:
    """Tokens per target pass (tau) of greedy speculative decoding with ``head`` (the method's
    default tree knobs, ``mmspec.methods``) answering each held-out prompt alone (its ids up to
    the first answer, its image), averaged over prompts."""
    from ... import methods
    from ...core import LogitsProcessor, SpeculativeDecoder

    head.eval()
    target = head.target
    recipe = methods.resolve("vlm", method)
    drafter = methods.build(recipe, {"target": target, f"{method}_head": head}).drafter
    decoder = SpeculativeDecoder(target, drafter, processor=LogitsProcessor(temperature=0))
    taus = []
    for r in held:
        vision = target.vision_inputs(**r.vision) if r.vision else None
        out = decoder.generate([r.ids[: r.prompt_len]], max_new_tokens, conditioning=vision,
                               eos_token_id=eos_token_id)
        taus.append(out.stats.tau)
    return sum(taus) / len(taus)


@torch.no_grad()
def regenerate_items(target: VLMTarget, items: list[Rendered], max_new_tokens: int, eos_token_id=None) -> list[Rendered]:
    """Self-distillation data (EAGLE's and Medusa-2's advice when the original answers are not
    the target's): each item's first prompt answered greedily by the target itself, up to
    ``max_new_tokens`` or its EOS (the core's decode with no drafter: the target alone)."""
    from ...core import LogitsProcessor, SpeculativeDecoder

    decoder = SpeculativeDecoder(target, None, processor=LogitsProcessor(temperature=0))
    out = []
    for r in items:
        prompt = r.ids[: r.prompt_len]
        vision = target.vision_inputs(**r.vision) if r.vision else None
        gen = decoder.generate([prompt], max_new_tokens, conditioning=vision, eos_token_id=eos_token_id)
        answer = gen.sequences[0, : int(gen.lengths[0])].tolist()
        out.append(Rendered(prompt + answer, [False] * len(prompt) + [True] * len(answer), r.vision, len(prompt)))
    return out


def user_items(processor, data, image_folder, *, limit: int, heldout_size: int, seed: int,
               max_length: int = MAX_LENGTH, log=print) -> tuple[list[Rendered], list[Rendered], dict]:
    """The user's conversations (``read_conversations``) rendered by ``processor``: a seeded
    shuffle, the first ``heldout_size`` (at most a fifth) held out, up to ``limit`` for training.
    Records whose image cannot be decoded, whose template is not prefix-stable or longer than
    ``max_length`` tokens are skipped and counted. Returns ``(train, held, data_record)``."""
    convs = read_conversations(data, image_folder)
    check(len(convs.records) >= 2, "data", "at least 2 usable conversations (training and held out)",
          convs.summary())
    order = torch.randperm(len(convs.records), generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = max(1, min(heldout_size, len(order) // 5))
    skipped = list(convs.skipped)

    def take(indices, want):
        got = []
        for i in indices:
            if len(got) == want:
                break
            conv = convs.records[i]
            try:
                image = None if conv.image is None else load_image(conv.image)
                r = render(processor, conv, image)
                if len(r.ids) > max_length:
                    raise ValueError(f"{len(r.ids)} tokens, more than max_length {max_length}")
            except ValueError as err:
                skipped.append((conv.where, str(err)))
                continue
            got.append(r)
        return got

    held = take(order[:n_held], n_held)
    train = take(order[n_held:], limit)
    check(train and held, "data", "conversations that render (training and held out)",
          f"{len(train)} training, {len(held)} held out; {len(skipped)} skipped"
          + (f", first {skipped[0][0]}: {skipped[0][1]}" if skipped else ""))
    if skipped:
        log(f"vlm-draft: skipped {len(skipped)} records (first: {skipped[0][0]}: {skipped[0][1]})")
    record = dict(path=str(data), image_folder=None if image_folder is None else str(image_folder),
                  records=len(convs.records) + len(convs.skipped), train=len(train), heldout=len(held),
                  skipped=len(skipped), skipped_first=[f"{w}: {why}" for w, why in skipped[:5]])
    return train, held, record


def train_vlm_draft(out_dir: str | Path, *, method: str, target_dir: str | Path, steps: int, batch_size: int,
                    lr: float, seed: int = 0, dataset_size: int, heldout_size: int = 64, log_every: int = 50,
                    warmup: int = 50, rollout_steps: int | None = None, medusa_heads: int = 6,
                    data: str | Path | None = None, image_folder: str | Path | None = None,
                    regenerate: int | None = None, tau_tokens: int = TAU_TOKENS,
                    init: str | Path | None = None, log: Callable[[str], None] = print) -> dict:
    """Train ``VLMDraftHead(method)`` (``MedusaHeads`` for ``"medusa"``) for the VLM at
    ``target_dir`` and save it to ``out_dir`` (fp16 safetensors, atomically) with
    ``train_log.json``, whose dict is returned: ``recipe``, ``method``, ``seed``, ``steps``,
    ``config``, ``trained_for`` (the target's fingerprint, also in the head's config: a pipeline
    refuses the head for another target), ``target``, ``data``, ``train``, ``final_loss``,
    ``heldout_top1`` (teacher-forced agreement with the target's next token on held-out answers),
    ``heldout_tau`` (tokens per target pass decoding the held-out prompts greedily with the head,
    ``tau_tokens`` new tokens each; ``tau_tokens=0`` skips it) and ``untrained_tau`` (the same
    for the head before training: the ``init`` head when given), ``heldout_history``
    (``{"step", "top1", "tau"}`` at each checkpoint and at the end: ``--checkpoint-every``),
    ``branch_counts`` (SpecVLM: training picks per branch), ``parameters`` (the head's own, the
    shared embedding and LM head excluded), ``processes``, ``wall_time_s``.

    ``target_dir``: a transformers model folder of a family in ``FAMILIES`` (LLaVA, Qwen2-VL,
    Qwen2.5-VL) with its processor (and chat template), or a hub id where there is a network.
    ``data``: the user's conversations in the LLaVA layout (``mmspec.training.data.conversations``;
    ``image_folder``: where their image paths start, default the data file's folder), rendered by
    the target's processor and chat template; at most ``dataset_size`` train, ``heldout_size``
    (at most a fifth) are held out. Without ``data``, the generated scene questions
    (``SceneQADataset``), which only a target written by 'mmspec train vlm' reads, drawn as its
    recipe drew them: at its resolution, with its images per prompt.
    ``regenerate``: replace every answer by the target's own greedy answer to the first question
    (up to this many tokens; self-distillation).

    ``init``: a head of the same method and sizes saved by this recipe (for another target, e.g.
    the 64 px VLM when training for its 192 px fine-tune) to start from instead of a fresh one;
    the saved head is stamped for ``target_dir``.

    ``batch_size`` is the global batch: under ``accelerate launch`` each of the N processes takes
    ``batch_size / N`` of it. ``medusa_heads``: K for ``method="medusa"`` (ignored otherwise)."""
    check_choice("method", method, METHODS)
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                         dataset_size=dataset_size, heldout_size=heldout_size, log_every=log_every,
                         log=log, warmup=warmup)
    rollout_steps = DEFAULT_ROLLOUT[method] if rollout_steps is None else rollout_steps
    check_int(rollout_steps, "rollout_steps", 1)
    check_int(medusa_heads, "medusa_heads", 1)
    check(regenerate is None or (is_int(regenerate) and regenerate >= 1), "regenerate",
          "None or an int >= 1 (new tokens per regenerated answer)", regenerate)
    check(is_int(tau_tokens) and tau_tokens >= 0, "tau_tokens", "an int >= 0 (0: no held-out tau)", tau_tokens)
    check(init is None or (Path(init) / "config.json").is_file(), "init",
          "None or a folder holding a head saved by this recipe", init)
    if _is_local(target_dir):  # a folder: its model, processor and tokenizer files, before any work
        check_checkpoint_dir(target_dir, "target_dir", "a transformers VLM folder with its processor (LLaVA, "
                             "Qwen2-VL, Qwen2.5-VL; e.g. written by 'mmspec train vlm')", processor=True)
    recipe_log = vlm_recipe_log(target_dir) if data is None and _is_local(target_dir) else None
    if data is None:
        check(recipe_log is not None, "data",
              "conversations in the LLaVA layout (.json / .jsonl) for a target not written by 'mmspec train vlm' "
              "(the generated scene data speaks only that one's vocabulary)", None)
    # SpecVLM's gate leaves the unchosen branches without gradients
    accelerator = new_accelerator("train_vlm_draft", distributed=True, find_unused_parameters=method == "specvlm")
    procs = accelerator.num_processes
    check(batch_size % procs == 0, "batch_size", f"a multiple of the process count ({procs})", batch_size)
    main = accelerator.is_main_process
    say = log if main else (lambda msg: None)
    start = time.perf_counter()

    target = load_target(target_dir)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(target_dir))
    tokenizer = getattr(processor, "tokenizer", None)
    check(tokenizer is not None and getattr(processor, "chat_template", None), "target",
          "a model folder with its processor and chat template (processor.save_pretrained)", str(target_dir))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = target.model.generation_config.eos_token_id
    if data is None:
        res = processor_resolution(processor)  # scenes drawn at the target's own resolution
        K = recipe_log.get("images_per_prompt", 1)  # and images per prompt
        items, held = (scene_items(processor, SceneQADataset(dataset_size, seed, res, images=K)),
                       scene_items(processor, SceneQADataset(heldout_size, heldout_seed(seed), res, images=K)))
        data_record = dict(path=None, generated="SceneQADataset", images_per_prompt=K, train=len(items),
                           heldout=len(held), skipped=0)
    else:
        items, held, data_record = user_items(processor, data, image_folder, limit=dataset_size,
                                              heldout_size=heldout_size, seed=heldout_seed(seed), log=say)
    if regenerate is not None:
        say(f"vlm-draft {method}: the target answers {len(items) + len(held)} prompts itself "
            f"(up to {regenerate} tokens each)")
        items, held = regenerate_items(target, items, regenerate, eos), regenerate_items(target, held, regenerate, eos)
        data_record["regenerated_tokens"] = regenerate
    check(batch_size <= len(items), "batch_size", f"at most the {len(items)} training conversations", batch_size)
    say(f"vlm-draft {method}: {len(items)} training, {len(held)} held-out conversations, longest "
        f"{max(len(r.ids) for r in items)} tokens")

    torch.manual_seed(seed)
    if method == "medusa":
        head = MedusaHeads.from_target(target, num_heads=medusa_heads)
    else:
        head = VLMDraftHead.from_target(target, method=method)
    if init is not None:  # fine-tune: the saved head's weights, this target's stamp
        saved = load_checkpoint(type(head), init)
        mine = {k: v for k, v in dict(head.config).items() if not k.startswith("_")}
        theirs = {k: v for k, v in dict(saved.config).items() if not k.startswith("_")}
        check(mine == theirs, "init", f"a {method} head of this target's sizes ({mine})", theirs)
        head.load_state_dict(saved.state_dict())
    untrained_tau = heldout_tau(head, held, method=method, max_new_tokens=tau_tokens, eos_token_id=eos) \
        if tau_tokens and main else None
    head.train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup=warmup, steps=steps))
    torch.manual_seed(seed + 1 + accelerator.process_index)  # pruning and Gumbel draws differ per process

    generator = torch.Generator().manual_seed(seed)  # the same batch order on every process

    def batches():
        for batch in batch_indices(len(items), batch_size, steps, generator):
            idx = shard(batch, accelerator).tolist()
            yield collate_items([items[i] for i in idx], pad_id)

    branch_counts = [0] * len(BRANCHES)

    def loss(head, batch):
        logs = distill(head, *batch, rollout_steps)
        for b in logs.get("branches", ()):
            if b >= 0:
                branch_counts[b] += 1
        return logs

    def evaluate(head) -> dict:  # at each checkpoint and at the end: the held-out figures
        figures = {"top1": heldout_top1(head, held, pad_id)}
        if isinstance(figures["top1"], list):
            figures["top1"] = figures["top1"][0]  # the first head's (the others are in the final record)
        if tau_tokens:
            figures["tau"] = heldout_tau(head, held, method=method, max_new_tokens=tau_tokens, eos_token_id=eos)
        return figures

    history: list = []
    loss_value = train_loop(head, optimizer, batches(), loss, steps=steps, accelerator=accelerator,
                            schedule=schedule, grad_clip=0.5, name=f"vlm-draft {method}", log=say, log_every=log_every,
                            count=lambda batch: int(batch[3].sum()), evaluate=evaluate, history=history)

    accelerator.wait_for_everyone()
    record = None
    if main:
        top1 = heldout_top1(head, held, pad_id)
        say(f"vlm-draft {method} held-out top-1 agreement {top1}")
        tau = history[-1]["tau"] if tau_tokens else None  # the evaluation after the last step
        if tau_tokens:
            say(f"vlm-draft {method} held-out tau {tau:.3f} ({'the --init' if init else 'untrained'} head "
                f"{untrained_tau:.3f}, "
                f"{len(held)} prompts, {tau_tokens} new tokens each)")
        config = {k: v for k, v in dict(head.config).items() if not k.startswith("_")}
        record = dict(recipe="vlm-draft", method=method, seed=seed, steps=steps, config=config,
                      trained_for=head.config["_trained_for"], target=str(target_dir), data=data_record,
                      train=dict(batch_size=batch_size, lr=lr, dataset_size=dataset_size, warmup=warmup,
                                 rollout_steps=rollout_steps, target_dir=str(target_dir),
                                 init=None if init is None else str(init)),
                      final_loss=loss_value, heldout_top1=top1, heldout_tau=tau, untrained_tau=untrained_tau,
                      tau_tokens=tau_tokens, heldout_history=history,
                      branch_counts=dict(zip(BRANCHES, branch_counts)) if method == "specvlm" else None,
                      parameters=sum(p.numel() for p in head.parameters()), processes=procs,
                      wall_time_s=round(time.perf_counter() - start, 1))
        save_atomically(head.eval(), out, record)
    accelerator.wait_for_everyone()
    return record
