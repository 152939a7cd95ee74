"""``mmspec.commands``: one module per subcommand, lists read from the registry and the recipe
tables (a new method or recipe kind needs no CLI edit), and ``mmspec --help`` without the recipes."""

import subprocess
import sys
import types

from mmspec import commands, methods
from mmspec.commands import bench, common


def _choices(parser, *path):
    """The choices of the option or positional ``path[-1]`` of the subcommand ``path[:-1]``."""
    for name in path[:-1]:
        parser = next(a for a in parser._actions if a.dest in ("command", "kind", "recipe")).choices[name]
    action = next(a for a in parser._actions if path[-1] in a.option_strings or a.dest == path[-1])
    return tuple(action.choices)


def test_every_subcommand_is_a_module_listed_in_help_order():
    assert tuple(commands.COMMANDS) == ("gpu-check", "showcase", "bench", "generate", "train", "demo", "batch")
    for name, module in commands.COMMANDS.items():
        assert module.NAME == name and callable(module.register_subcommand) and callable(module.run)
    top = next(a for a in commands.build_parser()._actions if a.dest == "command")
    assert tuple(top.choices) == tuple(commands.COMMANDS)


def test_method_choices_come_from_the_registry(monkeypatch):
    vlm = methods.modality("vlm")
    monkeypatch.setitem(vlm.methods, "toy", methods.Method("toy", "sd"))  # what register_method adds
    parser = commands.build_parser()
    assert _choices(parser, "generate", "vlm", "--method") == ("auto",) + methods.names("vlm")
    assert "toy" in _choices(parser, "generate", "vlm", "--method")
    generate = next(a for a in parser._actions if a.dest == "command").choices["generate"]
    ar = next(a for a in generate._actions if a.dest == "kind").choices["ar-image"]
    method = next(a for a in ar._actions if "--method" in a.option_strings)
    assert ", ".join(methods.names("ar-image")) in method.help


def test_recipe_choices_are_the_recipe_tables(monkeypatch):
    from mmspec.models import vlm
    from mmspec.training.recipes import continuous

    parser = commands.build_parser()
    assert _choices(parser, "train", "continuous-tokenizer", "--kind") == continuous.TOKENIZER_KINDS
    assert _choices(parser, "train", "vlm", "--size") == tuple(vlm.SIZES)
    monkeypatch.setattr(continuous, "TOKENIZER_KINDS", continuous.TOKENIZER_KINDS + ("toy",))
    args = commands.build_parser().parse_args(["train", "continuous-tokenizer", "--kind", "toy", "--out", "x"])
    assert args.kind == "toy"  # ar-draft's and vlm-draft's choices: tests/test_train_registered.py


def test_every_train_recipe_has_defaults_and_a_subcommand():
    from mmspec.commands import train

    assert tuple(train.RECIPES) == tuple(train.TRAIN_DEFAULTS)
    assert _choices(commands.build_parser(), "train", "recipe") == tuple(train.RECIPES) + tuple(methods.recipes())


def test_bench_names_and_video_groups_are_one_table_each():
    from mmspec.bench import video

    parser = commands.build_parser()
    assert _choices(parser, "bench", "name") == tuple(bench.BENCHES)
    assert _choices(parser, "bench", "--groups") == tuple(bench.VIDEO_GROUPS)
    cfg = video.VideoBenchConfig.quick()
    for field, _ in bench.VIDEO_GROUPS.values():
        assert hasattr(cfg, field), field


def test_bench_runs_the_table_entry_of_its_name(monkeypatch, capsys):
    monkeypatch.setitem(bench.BENCHES, "core", lambda args: ({"bench": "core", "rows": [{"method": args.name}]},
                                                             [("method", "method")]))
    assert commands.main(["bench", "core", "--quiet"]) == 0
    assert "core" in capsys.readouterr().out


def test_table_choices_read_the_table_once_and_only_when_asked(monkeypatch):
    loads = []
    table = types.SimpleNamespace(KINDS=("a", "b"))
    monkeypatch.setattr(common.importlib, "import_module", lambda name: loads.append(name) or table)
    choices = common.TableChoices("some.module", "KINDS")
    assert loads == []
    assert "a" in choices and "c" not in choices and tuple(choices) == ("a", "b") and len(choices) == 2
    assert loads == ["some.module"]


def test_help_does_not_import_the_recipes():
    code = ("import sys; from mmspec import commands; p = commands.build_parser(); p.parse_args(['bench', 'core']); "
            "print('mmspec.training.recipes' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_python_m_mmspec_runs_the_commands():
    out = subprocess.run([sys.executable, "-m", "mmspec", "train", "vlm-draft", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("usage: mmspec train vlm-draft") and "{eagle,specvlm,vispec,medusa}" in out
