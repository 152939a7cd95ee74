"""``mmspec train`` dispatches the trained drafters through the registry.

Every trained component of every modality has its ``TrainingRecipe`` (registered with its part),
and each recipe is an ``mmspec train`` subcommand. ``ar-draft --kind K``, ``vlm-draft --method M``
and ``continuous-draft`` are aliases: their choices are the registered recipes naming them, they
run the same recipe with the same options (the same record and weights on a few steps), and they
refuse what the chosen recipe lacks or requires with the messages they always gave.
"""

from __future__ import annotations

import json

import pytest
import torch

from mmspec import commands, methods
from mmspec.commands import train
from mmspec.methods import registry

TINY = ["--steps", "2", "--batch-size", "2", "--dataset-size", "8", "--log-every", "100", "--threads", "1"]


def _train_parser(parser, name=None):
    sub = next(a for a in parser._actions if a.dest == "command").choices["train"]
    recipes = next(a for a in sub._actions if a.dest == "recipe")
    return recipes.choices if name is None else recipes.choices[name]


def _option_choices(name: str, flag: str) -> tuple:
    p = _train_parser(commands.build_parser(), name)
    return tuple(next(a for a in p._actions if flag in a.option_strings).choices)


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_every_trained_component_has_a_registered_recipe_and_subcommand(capsys):
    trained = {}
    for modality in methods.modalities():
        for component in methods.components(modality):
            recipe = methods.recipe_for(modality, component.name)
            assert recipe is not None, f"{modality}'s {component.name} has no training recipe"
            assert methods.recipes()[recipe.name] is recipe and recipe.doc
            trained[recipe.name] = (modality, component.name)
    assert set(trained) == {"ar-sd", "ar-eagle", "ar-medusa", "vlm-sd", "vlm-eagle", "vlm-specvlm", "vlm-vispec",
                            "vlm-medusa", "continuous-sd"}
    assert set(methods.recipes()) == set(trained)  # no recipe trains nothing
    subcommands = tuple(_train_parser(commands.build_parser()))
    assert subcommands == tuple(train.RECIPES) + tuple(methods.recipes())
    with pytest.raises(SystemExit) as exit_:
        commands.main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in subcommands)


def test_alias_choices_and_defaults_are_the_registered_recipes():
    from mmspec.training.recipes import ar_draft, vlm_draft

    assert _option_choices("ar-draft", "--kind") == ("chain", "eagle", "medusa")
    assert set(_option_choices("ar-draft", "--kind")) == set(ar_draft.KINDS)  # the training table takes each
    assert _option_choices("vlm-draft", "--method") == vlm_draft.METHODS
    for alias, recipes in (("ar-draft", ("ar-sd", "ar-eagle", "ar-medusa")), ("continuous-draft", ("continuous-sd",)),
                           ("vlm-draft", ("vlm-eagle", "vlm-specvlm", "vlm-vispec", "vlm-medusa"))):
        assert tuple(r.name for r in train._aliased(alias).values()) == recipes
        assert all(dict(methods.recipes()[r].defaults) == train.TRAIN_DEFAULTS[alias] for r in recipes)
        p = _train_parser(commands.build_parser(), alias)
        steps = next(a for a in p._actions if "--steps" in a.option_strings)
        assert steps.default == train.TRAIN_DEFAULTS[alias]["steps"]


def _alias_pairs(d):
    """(alias command line, registered command line) that must run the same recipe the same way."""
    ar, vq, vlm, tok, cont = (str(d / n) for n in ("ar", "vq", "vlm", "tok", "cont"))
    out = ["--out", str(d / "out"), "--seed", "3"]
    return [
        (["ar-draft", "--kind", "chain", "--vq", vq], ["ar-sd", "--vq", vq]),
        (["ar-draft", "--kind", "chain", "--vq", vq, "--target", ar], ["ar-sd", "--vq", vq, "--target", ar]),
        (["ar-draft", "--kind", "eagle", "--target", ar, "--vq", vq], ["ar-eagle", "--target", ar, "--vq", vq]),
        (["ar-draft", "--kind", "medusa", "--target", ar, "--vq", vq, "--heads", "3"],
         ["ar-medusa", "--target", ar, "--vq", vq, "--heads", "3"]),
        (["ar-draft", "--kind", "medusa", "--target", ar, "--vq", vq], ["ar-medusa", "--target", ar, "--vq", vq]),
        *[(["vlm-draft", "--method", m, "--target", vlm, "--rollout-steps", "2"],
           [f"vlm-{m}", "--target", vlm, "--rollout-steps", "2"]) for m in ("eagle", "specvlm", "vispec", "medusa")],
        (["vlm-draft", "--method", "medusa", "--target", vlm, "--heads", "2"],
         ["vlm-medusa", "--target", vlm, "--heads", "2"]),
        (["continuous-draft", "--tokenizer", tok], ["continuous-sd", "--tokenizer", tok]),
        (["continuous-draft", "--tokenizer", tok, "--target", cont, "--distill", "0.5", "--input-noise", "0.1"],
         ["continuous-sd", "--tokenizer", tok, "--target", cont, "--distill", "0.5", "--input-noise", "0.1"]),
    ], out


def test_an_alias_runs_its_registered_recipe_with_the_same_options(tmp_path):
    for name in ("ar", "vq", "vlm", "tok", "cont"):
        (tmp_path / name).mkdir()
    pairs, out = _alias_pairs(tmp_path)
    parser = commands.build_parser()
    for alias, registered in pairs:
        calls = [train._registered_call(parser.parse_args(["train", *argv, *out])) for argv in (alias, registered)]
        assert calls[0][0] is calls[1][0] and calls[0][1] == calls[1][1], (alias, calls)
        a, b = (vars(parser.parse_args(["train", *argv, *out])) for argv in (alias, registered))
        common = ("steps", "batch_size", "lr", "seed", "dataset_size", "log_every", "threads")
        assert {k: a[k] for k in common} == {k: b[k] for k in common}
    recipe, options = train._registered_call(parser.parse_args(["train", *pairs[3][0], *out]))
    assert recipe.name == "ar-medusa" and options == {"target": str(tmp_path / "ar"), "vq": str(tmp_path / "vq"),
                                                      "data": None, "n_head": None, "image_size": None, "heads": 3}
    assert train._registered_call(parser.parse_args(["train", "vq", "--out", "x"])) is None  # a built-in recipe


@pytest.mark.parametrize("argv, message", [
    (["ar-draft", "--kind", "eagle", "--vq", "{d}"], "--kind eagle needs --target DIR (the AR model it drafts for)"),
    (["ar-draft", "--kind", "medusa", "--vq", "{d}"], "--kind medusa needs --target DIR (the AR model it drafts for)"),
    (["ar-draft", "--kind", "chain", "--heads", "3", "--vq", "{d}"], "--heads is for --kind medusa only, got --kind chain"),
    (["vlm-draft", "--method", "vispec", "--heads", "3", "--target", "{d}"],
     "--heads is for --method medusa only, got --method vispec"),
    (["ar-draft", "--kind", "hydra", "--vq", "{d}"], "argument --kind: invalid choice: 'hydra' (choose from"),
    (["continuous-draft", "--tokenizer", "{d}", "--distill", "0.5"],
     "--distill needs --target DIR (the continuous AR model it distills from)"),
    (["continuous-sd", "--tokenizer", "{d}", "--distill", "0.5"],
     "--distill needs --target DIR (the continuous AR model it distills from)"),
    (["ar-eagle", "--vq", "{d}"], "the following arguments are required: --target"),
    (["vlm-medusa", "--target", "{d}", "--heads", "x"], "argument --heads: invalid int value: 'x'"),
])
def test_refused_before_anything_loads(tmp_path, capsys, argv, message):
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        commands.main(["train", *argv, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"mmspec train {argv[0]}: error: " in err and message in err, err
    assert not (tmp_path / "out").exists()


def _fake(calls, alias="ar-draft --kind fake", **defaults):
    def train_fake(out_dir, **kwargs):
        calls.append((out_dir, kwargs))
        return {"heldout_top1": 0.25, "note": "fake"}

    return methods.TrainingRecipe("ar-fake", train_fake, "heldout_top1", alias=alias,
                                  options=(("--vq", str, methods.REQUIRED, "the VQ"), ("--extra", int, 7, "a number")),
                                  defaults={**train.TRAIN_DEFAULTS["ar-draft"], **defaults})


def test_a_recipe_registered_with_an_alias_joins_its_choices(monkeypatch, tmp_path, capsys, threads):
    calls = []
    monkeypatch.setitem(registry._RECIPES, "ar-fake", _fake(calls))
    assert _option_choices("ar-draft", "--kind") == ("chain", "eagle", "medusa", "fake")
    assert commands.main(["train", "ar-draft", "--kind", "fake", "--vq", str(tmp_path), "--out", str(tmp_path / "o"),
                          *TINY]) == 0
    assert calls == [(str(tmp_path / "o"), dict(vq=str(tmp_path), extra=7, steps=2, batch_size=2, lr=1e-3, seed=0,
                                                 dataset_size=8, log_every=100, log=print))]
    assert capsys.readouterr().out.strip() == f"saved {tmp_path / 'o'}: heldout_top1 0.2500"
    assert commands.main(["train", "ar-fake", "--vq", str(tmp_path), "--extra", "2", "--out", str(tmp_path / "o"),
                          *TINY]) == 0
    assert calls[1][1]["extra"] == 2


def test_an_alias_whose_recipes_disagree_on_defaults_is_refused(monkeypatch):
    monkeypatch.setitem(registry._RECIPES, "ar-fake", _fake([], steps=5))
    with pytest.raises(ValueError, match=r"the registered recipes of 'mmspec train ar-draft' \(ar-sd, ar-eagle, "
                                         r"ar-medusa, ar-fake\) must share their defaults"):
        commands.build_parser()


def test_a_recipe_returning_none_prints_nothing(monkeypatch, tmp_path, capsys, threads):
    """The other processes of an ``accelerate launch`` return None from the VLM heads' recipes."""
    quiet = methods.TrainingRecipe("ar-quiet", lambda out, **kw: None, "heldout_top1")
    monkeypatch.setitem(registry._RECIPES, "ar-quiet", quiet)
    assert commands.main(["train", "ar-quiet", "--out", str(tmp_path / "o"), *TINY]) == 0
    assert capsys.readouterr().out == ""


# -- the same record through the alias and the registered subcommand, on a few steps ------------------
TINY_RUN = dict(steps=2, batch_size=2, lr=1e-3, dataset_size=8, heldout_size=4, log_every=100, log=lambda m: None)


@pytest.fixture(scope="module")
def ar_dirs(tmp_path_factory):
    from mmspec.training.recipes import train_ar_image, train_vq

    root = tmp_path_factory.mktemp("ar")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_vq(root / "vq", **TINY_RUN)
        train_ar_image(root / "ar", vq_dir=root / "vq", model_config=dict(dim=32, n_layers=1, n_heads=2, mlp_hidden=64),
                       **TINY_RUN)
    finally:
        torch.set_num_threads(threads)
    return root


@pytest.mark.parametrize("alias, registered, extra", [
    (["ar-draft", "--kind", "medusa"], ["ar-medusa"], ["--target", "{ar}", "--heads", "2"]),
    (["ar-draft", "--kind", "chain"], ["ar-sd"], []),
])
def test_alias_and_registered_subcommand_give_the_same_record(ar_dirs, tmp_path, capsys, threads, alias, registered,
                                                              extra):
    extra = [a.replace("{ar}", str(ar_dirs / "ar")) for a in extra] + ["--vq", str(ar_dirs / "vq")]
    logs, weights, printed = [], [], []
    for i, argv in enumerate((alias, registered)):
        out = tmp_path / str(i)
        assert commands.main(["train", *argv, *extra, "--out", str(out), *TINY]) == 0
        logs.append({k: v for k, v in json.loads((out / "train_log.json").read_text()).items() if k != "wall_time_s"})
        weights.append(sorted((p.name, p.read_bytes()) for p in out.glob("*.safetensors")))
        printed.append(capsys.readouterr().out.strip().splitlines()[-1].replace(str(out), "OUT"))
    assert logs[0] == logs[1] and logs[0]["recipe"] == "ar-draft"
    assert weights[0] == weights[1] and weights[0]
    kind = alias[2]
    metric = "held-out loss" if kind == "chain" else "held-out top-1 agreement"
    assert printed[0].startswith(f"saved OUT: {metric} ") and printed[0].split(", ")[:-1] == printed[1].split(", ")[:-1]
