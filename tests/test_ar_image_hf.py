"""Image-token views of transformers' Emu3, Janus and Chameleon in the speculation core."""


import pytest
import torch
from transformers import (ChameleonConfig, ChameleonForConditionalGeneration, Emu3Config, Emu3ForCausalLM,
                          Emu3ForConditionalGeneration, JanusConfig, JanusForConditionalGeneration,
                          LlamaConfig, LlamaForCausalLM)

from mmspec.adapters.ar_image_hf import (Emu3ImageTarget, chameleon_prompts, emu3_prompts, image_target,
                                         janus_prompts)
from mmspec.core import JacobiDrafter, LogitsProcessor, ModelTreeDrafter, SpeculativeDecoder
from tiny import noisy_copy, spread

K = 32  # codebook size
TEXT = 32  # ordinary text ids 0..TEXT-1; special and image tokens follow
H, W = 3, 4  # Emu3 grid: H rows of W codes, each row closed by an EOL token
JANUS_TOKENS = 16  # Janus generates vision_config.num_image_tokens codes
NEW_TOKENS = {"emu3": H * (W + 1), "emu3-plain": 16, "janus": JANUS_TOKENS, "chameleon": 16}
TEXTS = [[3, 5, 7], [11, 2, 19, 23, 1, 8], [30]]  # unequal lengths: padded rows, cache holes
LAYERS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
TINY_VQ = dict(latent_channels=4, base_channels=32, channel_multiplier=[1, 1], num_res_blocks=1)


def shuffled_ids(base: int, seed: int) -> list[int]:
    """Model ids of codebook indices 0..K-1, deliberately out of codebook order."""
    return [base + i for i in torch.randperm(K, generator=torch.Generator().manual_seed(seed)).tolist()]






def tiny_emu3() -> Emu3ForConditionalGeneration:
    specials = ["<|extra_203|>", "<|extra_204|>", "<|endoftext|>", "<|image start|>", "<|image end|>",
                "<|image token|>", "<|extra_200|>", "<|extra_201|>", "<image>"]
    vocab = {f"t{i}": i for i in range(TEXT)} | {s: TEXT + j for j, s in enumerate(specials)}
    base = len(vocab)
    vocab |= {f"<|visual token {c:06d}|>": i for c, i in enumerate(shuffled_ids(base, 1))}
    config = Emu3Config(
        vq_config=dict(codebook_size=K, embed_dim=4, hidden_size=8, attn_resolutions=[], **TINY_VQ),
        text_config=dict(vocab_size=base + K, bos_token_id=TEXT, eos_token_id=TEXT + 1, pad_token_id=TEXT + 2,
                         attention_dropout=0.0, **LAYERS),
        vocabulary_map=vocab, attn_implementation="sdpa")
    torch.manual_seed(0)
    return spread(Emu3ForConditionalGeneration(config))


def tiny_janus() -> JanusForConditionalGeneration:
    bos, pad, boi = TEXT, TEXT + 1, TEXT + 2
    config = JanusConfig(
        text_config=dict(model_type="llama", vocab_size=TEXT + 8, bos_token_id=bos, pad_token_id=pad,
                         eos_token_id=TEXT + 3, **LAYERS),
        vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                           patch_size=16, projection_dim=32, num_image_tokens=JANUS_TOKENS, depth=1),
        vq_config=dict(embed_dim=4, num_embeddings=K, projection_dim=32, image_token_embed_dim=32, **TINY_VQ),
        image_token_id=TEXT + 4, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = spread(JanusForConditionalGeneration(config))
    model.generation_config.bos_token_id = bos
    model.generation_config.pad_token_id = pad
    model.generation_config.generation_kwargs = {"boi_token_id": boi}
    return model


def tiny_chameleon() -> ChameleonForConditionalGeneration:
    specials = ["<s>", "</s>", "<pad>", "<image>", "<racm3:break>", "<eoss>"]
    vocab = {f"t{i}": i for i in range(TEXT)} | {s: TEXT + j for j, s in enumerate(specials)}
    base = len(vocab)
    letters = ["".join(chr(ord("A") + int(d)) for d in str(c)) for c in range(K)]  # IMGIMG<digits as A-J>Z
    vocab |= {f"IMGIMG{letters[c]}Z": i for c, i in enumerate(shuffled_ids(base, 2))}
    config = ChameleonConfig(
        vocab_size=base + K, bos_token_id=TEXT, eos_token_id=TEXT + 1, pad_token_id=TEXT + 2,
        vq_config=dict(embed_dim=4, num_embeddings=K, resolution=32, attn_resolutions=[], **TINY_VQ),
        vocabulary_map=vocab, attn_implementation="sdpa", **LAYERS)
    torch.manual_seed(0)
    return spread(ChameleonForConditionalGeneration(config), std=1.0, seed=1)  # its norms need more spread


def emu3_size_ids() -> list[int]:
    return [H, TEXT - 1, W]  # stands for the tokenised "3*4" (no tokenizer offline)


# family -> (model, cond/uncond prompts in the model's vocabulary, view options)
FAMILIES = {
    "emu3": lambda: (tiny_emu3(), lambda m: emu3_prompts(m, TEXTS, emu3_size_ids(), negative=[4]),
                     {"width": W}),
    "emu3-plain": lambda: (tiny_emu3(), lambda m: emu3_prompts(m, TEXTS, emu3_size_ids()), {}),  # no EOLs
    "janus": lambda: (tiny_janus(), lambda m: janus_prompts(m, TEXTS), {}),
    "chameleon": lambda: (tiny_chameleon(), lambda m: chameleon_prompts(m, TEXTS), {}),
}


@torch.no_grad()
def reference_grid(family: str, model, cond: list[int], uncond: list[int], n: int) -> list[int]:
    """The model's own greedy decoding of image tokens, as core ids (codebook indices, EOL = K)."""
    ids = torch.tensor([cond])
    if family.startswith("emu3"):
        # generate() with Emu3's prefix constraint: visual tokens, and EOL after every W of them
        mapping = model.model.vocabulary_mapping
        visual = [mapping.img2bpe[c] for c in range(K)]
        wrapper = mapping.vocab_map["<|image token|>"]

        def allowed(batch_id, input_ids):
            offset = input_ids.shape[0] - int(torch.nonzero(input_ids == wrapper)[0, 0])
            return [mapping.eol_token_id] if family == "emu3" and offset % (W + 1) == 0 else visual

        # with guidance, generate() runs the uncond prompt beside (UnbatchedClassifierFreeGuidance);
        # it merges log-softmaxes, which shifts each row by a constant: the argmax is the core's
        guidance = {} if GUIDANCE[family] is None else dict(guidance_scale=GUIDANCE[family],
                                                             negative_prompt_ids=torch.tensor([uncond]))
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             prefix_allowed_tokens_fn=allowed, pad_token_id=TEXT + 2, **guidance)
        to_core = {b: c for c, b in enumerate(visual)} | {mapping.eol_token_id: K}
        return [to_core[t] for t in out[0, len(cond):].tolist()]
    if family == "janus":
        # Janus's own image mode, which builds its uncond prompt itself; it needs guidance_scale > 1
        # (without the CFG processor its doubled batch does not fit its output)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_mode="image",
                             do_sample=False, guidance_scale=GUIDANCE["janus"])
        return out[0].tolist()
    # Chameleon's forward masks image tokens out of its logits and nothing in transformers generates
    # them: a cache-free loop over the model's decoder and LM head, restricted to the image tokens
    image_ids = torch.tensor([model.model.vocabulary_mapping.img2bpe[c] for c in range(K)])
    context, grid = list(cond), []
    for _ in range(n):
        hidden = model.model(input_ids=torch.tensor([context])).last_hidden_state[0, -1]
        code = int(model.lm_head(hidden)[image_ids].argmax())
        grid.append(code)
        context.append(int(image_ids[code]))
    return grid


GUIDANCE = {"emu3": 3.0, "emu3-plain": None, "janus": 3.0, "chameleon": None}  # greedy runs
DRAFTERS = {
    "sjd": lambda target, model, options: JacobiDrafter(target.vocab_size, window=6),
    "eagle": lambda target, model, options: ModelTreeDrafter(image_target(noisy_copy(model), **options),
                                                             top_k=3, depth=3, total_tokens=10),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_the_models_own_decoding(family, drafter):
    model, prompts, options = FAMILIES[family]()
    cond, uncond = prompts(model)
    n = NEW_TOKENS[family]
    expected = [reference_grid(family, model, c, u, n) for c, u in zip(cond, uncond)]
    assert all(len(set(row)) > 3 for row in expected), "the model's greedy grid is trivially constant"

    target = image_target(model, **options)
    guided = GUIDANCE[family] is not None
    decoder = SpeculativeDecoder(target, DRAFTERS[drafter](target, model, options),
                                 processor=LogitsProcessor(temperature=0, guidance_scale=GUIDANCE[family]))
    out = decoder.generate(target.encode_prompt(cond), n,
                           uncond_input_ids=target.encode_prompt(uncond) if guided else None)

    assert out.sequences.tolist() == expected
    if drafter == "eagle":  # a close draft model must save target passes (Jacobi guesses at random)
        assert out.stats.target_forwards < n
    if family == "emu3":
        assert (out.sequences.view(len(TEXTS), H, W + 1)[..., -1] == K).all()


@pytest.mark.parametrize("family", ["emu3", "janus", "chameleon"])
def test_sampled_sjd_with_guidance_is_seeded_and_valid(family):
    model, prompts, options = FAMILIES[family]()
    cond, uncond = prompts(model)
    target = image_target(model, **options)
    n = NEW_TOKENS[family]

    def run(seed):
        decoder = SpeculativeDecoder(target, JacobiDrafter(target.vocab_size, window=6),
                                     processor=LogitsProcessor(temperature=1.0, guidance_scale=2.0))
        return decoder.generate(target.encode_prompt(cond), n, uncond_input_ids=target.encode_prompt(uncond),
                                generator=torch.Generator().manual_seed(seed)).sequences

    grid = run(0)
    assert grid.shape == (len(TEXTS), n)
    assert torch.equal(grid, run(0))
    assert not torch.equal(grid, run(1))
    if family == "emu3":  # codes in every row, the EOL token closing it
        rows = grid.view(len(TEXTS), H, W + 1)
        assert (rows[..., -1] == K).all() and (rows[..., :-1] < K).all() and (rows[..., :-1] >= 0).all()
    else:
        assert ((grid >= 0) & (grid < K)).all()


def test_prompts_are_shifted_past_the_codebook():
    model = tiny_janus()
    target = image_target(model)
    cond, uncond = janus_prompts(model, [[3, 5]])
    assert cond == [[TEXT, 3, 5, TEXT + 2]] and uncond == [[TEXT, TEXT + 1, TEXT + 1, TEXT + 2]]
    assert target.encode_prompt(cond) == [[K + TEXT, K + 3, K + 5, K + TEXT + 2]]
    assert torch.equal(target.encode_prompt(torch.tensor(cond)), torch.tensor(target.encode_prompt(cond)))
    assert image_target(tiny_emu3(), width=W).vocab_size == K + 1  # codes, then EOL


def test_bad_input():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=TEXT, **LAYERS))
    with pytest.raises(ValueError, match="model must be an image generator.*got 'LlamaForCausalLM'"):
        image_target(llama)
    emu3 = tiny_emu3()
    text_only = Emu3ForCausalLM(emu3.config.text_config)
    with pytest.raises(ValueError, match="model must be an image generator.*got 'Emu3ForCausalLM'"):
        image_target(text_only)
    with pytest.raises(ValueError, match="model must be"):
        janus_prompts(emu3, TEXTS)
    with pytest.raises(ValueError, match="width must be an int >= 1"):
        Emu3ImageTarget(emu3, width=0)
    target = image_target(emu3, width=W)
    with pytest.raises(ValueError, match="prompts must be ids of the model's vocabulary"):
        target.encode_prompt([[3, 10_000]])
    decoder = SpeculativeDecoder(target, processor=LogitsProcessor(temperature=0))
    with pytest.raises(ValueError, match="input_ids must be prompts that contain"):
        decoder.generate(target.encode_prompt([[TEXT, 3, 5]]), 4)  # no <|image token|>
    chameleon = tiny_chameleon()
    chameleon.config.vq_config.num_embeddings = K + 1  # one codebook entry without an image token
    with pytest.raises(ValueError, match="model.config.vocabulary_map must be an image token for every"):
        image_target(chameleon)
    janus = tiny_janus()
    janus.generation_config.generation_kwargs = {}
    with pytest.raises(ValueError, match="boi_token_id"):
        janus_prompts(janus, TEXTS)
