"""``ep-runtime train``'s options: config files and presets, flags over them, errors that name
what the user typed, and a ``--help`` that states every default."""

import argparse
import dataclasses

import pytest

from ep_runtime.config import ModelConfig, TrainConfig
from ep_runtime.config_files import preset, preset_names, preset_path
from ep_runtime.options import job_config_from_args, train_parser
from launch.cli import launch_arguments


def config(*flags):
    return job_config_from_args(train_parser().parse_args(list(flags)))


def test_the_presets_are_the_files_in_configs():
    assert preset_names() == ["small", "tiny", "v3-layer", "v4"]
    for name in preset_names():
        from_flag = config("--model", name)
        from_file = config("--config", str(preset_path(name)))
        assert from_flag.model == from_file.model
        written = preset(name).model  # the file as written: no defaults derived from [train]
        assert from_flag.model == dataclasses.replace(written, max_seq_len=from_flag.model.max_seq_len, moe=dataclasses.replace(
            written.moe, max_tokens_per_rank=from_flag.train.batch_size * from_flag.train.seq_len))
        assert from_flag.train.name == name
    assert config("--model", "v3-layer").model.hidden == 7168
    assert config("--model", "v3-layer").train.lr == 3e-4  # the preset's own, not TrainConfig's
    assert config("--model", "v4").model.engram.layers == (0, 2)
    assert config() == config("--model", "tiny")  # no --model, no --config: tiny


def test_flags_override_the_file_and_defaults_follow(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[model]\nhidden = 32\nnum_heads = 2\n[model.moe]\nnum_experts = 4\n'
                    '[model.moe.router]\ntopk = 1\n[parallel]\npp = 2\n[train]\nsteps = 7\nbatch_size = 4\n')
    cfg = config("--config", str(path), "--steps", "9", "--seq-len", "100")
    assert (cfg.model.hidden, cfg.model.moe.num_experts, cfg.model.moe.router.topk) == (32, 4, 1)
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.name) == (9, 4, "mine")
    assert cfg.parallel.microbatches == 4  # 2 x pp, as with the flag
    assert cfg.model.max_seq_len == 100 and cfg.model.moe.max_tokens_per_rank == 4 * 100
    assert cfg.train.lr == TrainConfig.lr and cfg.model.vocab_size == ModelConfig.vocab_size  # keys left out


@pytest.mark.parametrize("text, message", [
    ("[model]\nhiden = 32\n", r"^model\.hiden of .*bad\.toml: unknown key \(expected one of vocab_size, hidden,"),
    ("[train]\nsteps = \"ten\"\n", r"^train\.steps of .*bad\.toml: expected an int, got 'ten'"),
    ("[model.moe]\nrouter = 3\n", r"^model\.moe\.router of .*bad\.toml: expected a table, got 3"),
    ("[model.engram]\nlayers = [0, 0]\n", r"^model\.engram\.layers of .*bad\.toml: expected distinct ints"),
    ("[model\n", r"^--config .*bad\.toml: not valid TOML"),
])
def test_a_bad_file_is_named_with_its_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        config("--config", str(path))


def test_an_error_names_the_flag_when_a_flag_set_the_value():
    with pytest.raises(ValueError, match=r"^--experts: expected >= 1, got 0$"):
        config("--model", "small", "--experts", "0")
    with pytest.raises(ValueError, match=r"^--topk: expected <= 16 experts"):
        config("--model", "small", "--topk", "17")
    # The key the check is about came from the preset: it is named with its source.
    with pytest.raises(ValueError, match=r"^model\.moe\.router\.num_groups of the v3-layer preset: expected a "
                                         r"divisor of num_experts=12, got 8$"):
        config("--model", "v3-layer", "--experts", "12")


def test_help_states_every_default():
    parser = launch_arguments(train_parser())
    undocumented = [action.option_strings[0] for action in parser._actions
                    if action.option_strings and not isinstance(action, argparse._HelpAction)
                    and "default" not in (action.help or "")]
    assert not undocumented, undocumented
    text = parser.format_help()
    for field in dataclasses.fields(TrainConfig):
        if field.name in ("min_lr_ratio", "resume", "overwrite", "profile", "name", "out_dir"):  # said in words
            continue
        assert f"(default {field.default}" in text, field.name


def test_e2m1_dispatch_only_where_the_dispatcher_carries_it(tmp_path):
    """``all_to_all`` carries FP4 tokens of an even width; ``nvlink`` and ``deepep`` are refused
    them before any process starts."""
    odd = tmp_path / "odd.toml"
    odd.write_text("[model]\nnum_heads = 1\n")
    assert config("--dispatch-format", "e2m1").model.moe.dispatch_format == "e2m1"
    for dispatcher in ("nvlink", "deepep"):
        with pytest.raises(ValueError, match=rf"^--dispatch-format: expected bf16 or e4m3 with the {dispatcher} "
                                             r"dispatcher \(e2m1 travels over all_to_all only\), got 'e2m1'$"):
            config("--dispatcher", dispatcher, "--dispatch-format", "e2m1")
    with pytest.raises(ValueError, match=r"^--hidden: expected an even size with e2m1 dispatch"):
        config("--config", str(odd), "--dispatch-format", "e2m1", "--hidden", "63")
    with pytest.raises(SystemExit):  # argparse's choices
        config("--dispatch-format", "fp4")


def test_fp8_experts_align_segments_to_128_rows_unless_told(tmp_path):
    cfg = config("--model", "small", "--fp8-experts")
    assert cfg.model.moe.fp8_experts and cfg.model.moe.alignment == 128
    assert config("--model", "small").model.moe.alignment == 8 and not config("--model", "small").model.moe.fp8_experts
    mine = tmp_path / "mine.toml"
    mine.write_text("[model.moe]\nalignment = 8\n")
    with pytest.raises(ValueError, match=r"^model\.moe\.alignment of .*mine\.toml: expected a multiple of 128 with "
                                         r"fp8_experts \(an FP8 GEMM tile's rows\), got 8$"):
        config("--config", str(mine), "--fp8-experts")
