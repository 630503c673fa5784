"""SimpleTuner configs mean here what SimpleTuner's code makes of them: learning-rate schedules, optimizer
defaults and keys, settings its model classes force per family and flavour, validation cadence and seed.

Expected values are figures computed once from SimpleTuner's source at the dialect's commit (bc8e6ab7,
``facts.SIMPLETUNER_COMMIT``), recorded with the file and line they come from. The schedule figures
come from running its ``Cosine`` class and ``get_polynomial_decay_schedule_with_warmup``
(simpletuner/helpers/training/custom_schedule.py:102-153, 193-265) stepped as its trainer steps them: built
with ``T_0 = lr_warmup_steps * processes`` (custom_schedule.py:574-584), wrapped by Accelerate, which steps a
prepared scheduler once per process per optimizer step (trainer.py:4512, 7293).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from simpletuner.configuration.loader import validate_config
from simpletuner.configuration.simpletuner import translate as dialect
from simpletuner.training.optim import build_lr_scheduler, build_optimizer

# SimpleTuner's Cosine at learning_rate 1e-4, lr_end 4e-7 (its default), lr_warmup_steps 100: the learning rate
# in force at each optimizer step. Equal for 1 and 2 processes (T_0 and the steps per optimizer step both double).
ST_COSINE_W100 = {
    0: 1e-4,
    1: 9.9975e-05,
    10: 9.7562e-05,
    50: 5.02e-05,
    99: 4.24e-07,
    100: 4e-07,
    150: 5.0199e-05,
    200: 1e-4,
    250: 5.02e-05,
    500: 4e-07,
    999: 9.9975e-05,
}
# lr_warmup_steps 0: T_0 falls back to 1000 scheduler steps (custom_schedule.py:222-227), which is 1000 optimizer
# steps on one process and 500 on two.
ST_COSINE_W0 = {
    1: {0: 1e-4, 250: 8.5413e-05, 500: 5.02e-05, 1000: 4e-07, 1500: 5.0199e-05, 2000: 1e-4},
    2: {0: 1e-4, 250: 5.02e-05, 500: 4e-07, 1000: 1e-4},
}
# Its polynomial decay, learning_rate 1e-4, warm-up 100 of 1000 steps, lr_end 4e-7 and power 0.8 (its registry
# defaults, field_registry/sections/advanced.py:921 and training.py:787).
ST_POLYNOMIAL = {
    0: 0.0,
    50: 5e-05,
    100: 1e-4,
    500: 6.263595159386259e-05,
    900: 1.7573757684663318e-05,
    999: 8.313852890613764e-07,
    1000: 4e-07,
    1005: 4e-07,
}


def _translate(tmp_path: Path, config: dict) -> tuple[dict, dialect.Report]:
    base = {"--model_family": "sd1x", "--pretrained_model_name_or_path": str(tmp_path)}
    return dialect.translate({**base, **config}, cwd=tmp_path)


def _native(make_config, **keys):
    return validate_config(make_config(**keys), check_files=False)


def _lrs(scheduler, optimizer, steps) -> dict[int, float]:
    out = {}
    for step in range(max(steps) + 1):
        if step in steps:
            out[step] = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
    return out


def _schedule_of(make_config, native: dict, total: int = 1000, processes: int = 1):
    keys = {k: native[k] for k in ("lr_scheduler", "lr_warmup_steps", "lr_end", "lr_power") if k in native}
    cfg = _native(make_config, learning_rate=1e-4, **keys)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    return build_lr_scheduler(cfg, optimizer, total, processes), optimizer


@pytest.mark.parametrize("name", ["cosine", "cosine_with_warmup"])
@pytest.mark.parametrize("processes", [1, 2])
def test_cosine_is_simpletuners_own_class(tmp_path, make_config, name, processes):
    native, report = _translate(tmp_path, {"--lr_scheduler": name, "--lr_warmup_steps": 100})
    assert native["lr_scheduler"] == "simpletuner_cosine" and native["lr_end"] == 4e-7
    assert any("simpletuner_cosine" in line for line in report.mapped)
    scheduler, optimizer = _schedule_of(make_config, native, processes=processes)
    got = _lrs(scheduler, optimizer, ST_COSINE_W100)
    assert got == pytest.approx(ST_COSINE_W100, rel=1e-12, abs=0)


@pytest.mark.parametrize("processes", [1, 2])
def test_cosine_without_warmup_has_simpletuners_fallback_period(tmp_path, make_config, processes):
    native, _ = _translate(tmp_path, {"--lr_scheduler": "cosine"})
    scheduler, optimizer = _schedule_of(make_config, native, processes=processes)
    expected = ST_COSINE_W0[processes]
    assert _lrs(scheduler, optimizer, expected) == pytest.approx(expected, rel=1e-12, abs=0)


def test_cosine_floor_is_the_configs_lr_end(tmp_path, make_config):
    # SimpleTuner's Cosine at learning_rate 2e-5, lr_end 1e-6, warm-up 100 (eta_min = lr_end, custom_schedule.py:583).
    native, _ = _translate(tmp_path, {"--lr_scheduler": "cosine", "--lr_warmup_steps": 100, "--lr_end": "1e-6"})
    keys = {k: native[k] for k in ("lr_scheduler", "lr_warmup_steps", "lr_end")}
    cfg = _native(make_config, learning_rate=2e-5, **keys)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    expected = {0: 2e-05, 25: 1.7217e-05, 100: 1e-06, 175: 1.7217e-05}
    got = _lrs(build_lr_scheduler(cfg, optimizer, 1000), optimizer, expected)
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_polynomial_takes_simpletuners_end_and_power(tmp_path, make_config):
    native, report = _translate(tmp_path, {"--lr_scheduler": "polynomial", "--lr_warmup_steps": 100})
    assert (native["lr_end"], native["lr_power"]) == (4e-7, 0.8)
    assert any("`lr_power: 0.8`" in line for line in report.defaults)
    scheduler, optimizer = _schedule_of(make_config, native)
    assert _lrs(scheduler, optimizer, ST_POLYNOMIAL) == pytest.approx(ST_POLYNOMIAL, rel=1e-12, abs=1e-20)


def test_simpletuners_own_defaults_written_explicitly_are_accepted(tmp_path):
    native, report = _translate(tmp_path, {"--lr_scheduler": "constant", "--lr_end": 4e-7, "--lr_power": 0.8})
    assert "lr_end" not in native and "lr_power" not in native
    assert any("`lr_end`" in line and "not read" in line for line in report.ignored)
    native, _ = _translate(tmp_path, {"--lr_scheduler": "polynomial", "--lr_end": "1e-6", "--lr_power": 2})
    assert (native["lr_end"], native["lr_power"]) == (1e-6, 2)


def test_constant_with_warmup_ramps_as_simpletuner_rewrites_it(tmp_path, make_config):
    # cli_utils.py:64-65: `constant` with lr_warmup_steps > 0 becomes `constant_with_warmup` (diffusers' shape,
    # custom_schedule.py:598-606): a linear ramp from 0 over the warm-up, then the peak.
    native, report = _translate(tmp_path, {"--lr_scheduler": "constant", "--lr_warmup_steps": 100})
    assert native["lr_scheduler"] == "constant_with_warmup"
    assert any("cli_utils.py:64-65" in line for line in report.mapped)
    scheduler, optimizer = _schedule_of(make_config, native)
    expected = {0: 0.0, 10: 1e-5, 50: 5e-5, 100: 1e-4, 400: 1e-4}
    assert _lrs(scheduler, optimizer, expected) == pytest.approx(expected, rel=1e-12, abs=1e-20)
    native, _ = _translate(tmp_path, {"--lr_scheduler": "constant"})
    assert native["lr_scheduler"] == "constant"


def test_cosine_with_restarts_stops_saying_what_simpletuner_did(tmp_path):
    with pytest.raises(dialect.DialectError) as err:
        _translate(tmp_path, {"--lr_scheduler": "cosine_with_restarts", "--lr_warmup_steps": 10})
    text = str(err.value)
    assert "`lr_scheduler: cosine_with_restarts`" in text and "never leaves the peak" in text and "`constant`" in text


def test_native_schedules_keep_diffusers_shapes_and_refuse_unread_keys(make_config):
    cfg = _native(make_config, lr_scheduler="cosine", lr_warmup_steps=10, learning_rate=1e-4)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    got = _lrs(build_lr_scheduler(cfg, optimizer, 110), optimizer, {0, 5, 10, 60, 110})
    assert got == pytest.approx({0: 0.0, 5: 5e-5, 10: 1e-4, 60: 5e-5, 110: 0.0}, abs=1e-12)
    cfg = _native(make_config, lr_scheduler="polynomial", lr_warmup_steps=0, learning_rate=1e-4)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    got = _lrs(build_lr_scheduler(cfg, optimizer, 100), optimizer, {50, 100})  # diffusers' 1e-7 and power 1.0
    assert got == pytest.approx({50: 1e-7 + (1e-4 - 1e-7) * 0.5, 100: 1e-7}, rel=1e-12)
    from simpletuner.configuration.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _native(make_config, lr_scheduler="cosine", lr_end=1e-6, lr_power=2.0)
    assert "lr_end 1e-06 is not read by lr_scheduler 'cosine'" in str(err.value)
    assert "lr_power 2.0 is not read" in str(err.value)
    with pytest.raises(ConfigError, match="lr_end 0.001 is not below learning_rate"):
        _native(make_config, lr_scheduler="polynomial", lr_end=1e-3, learning_rate=1e-4)


# --- optimizers -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, expected",
    [
        # (value, optimizer_param.py line) as in facts.SIMPLETUNER_OPTIMIZER_DEFAULTS
        ("adamw_bf16", {"adam_epsilon": 1e-6}),  # :196; betas (0.9, 0.999) and weight decay 1e-2 are ours too
        ("prodigy", {"adam_beta2": 0.99, "weight_decay": 0.0}),  # :735, :737
        ("optimi-adamw", {"adam_beta2": 0.99, "adam_epsilon": 1e-6, "weight_decay": 0.0}),  # :318-320
        ("optimi-adam", {"adam_beta2": 0.99, "adam_epsilon": 1e-6, "weight_decay": 0.0}),  # :385-387
        ("optimi-sgd", {"optimizer_config": {"momentum": 0.0}, "weight_decay": 0.0}),  # :398-399
    ],
)
def test_each_optimizer_gets_simpletuners_own_defaults(tmp_path, name, expected):
    native, report = _translate(tmp_path, {"--optimizer": name})
    for key, value in expected.items():
        assert native[key] == value, key
    assert any(f"SimpleTuner's {name} default" in line for line in report.defaults)


def test_adam_keys_are_ignored_as_simpletuner_reads_them_only_for_deepspeed(tmp_path):
    config = {"--optimizer": "adamw_bf16", "--adam_beta2": 0.95, "--adam_epsilon": 1e-10, "--adam_weight_decay": 0.3}
    native, report = _translate(tmp_path, config)
    assert (native["adam_beta2"], native["adam_epsilon"], native["weight_decay"]) == (0.999, 1e-6, 1e-2)
    for key in ("adam_beta2", "adam_epsilon", "adam_weight_decay"):
        assert any(line.startswith(f"`{key}` (SimpleTuner reads it only for DeepSpeed") for line in report.ignored)


def test_optimizer_config_and_betas_take_simpletuners_precedence(tmp_path):
    native, _ = _translate(tmp_path, {"--optimizer": "adamw_bf16", "--optimizer_config": "eps=1e-8,weight_decay=0.0"})
    assert (native["adam_epsilon"], native["weight_decay"]) == (1e-8, 0.0)
    config = {"--optimizer_config": "betas=[0.8, 0.9]", "--optimizer_beta1": 0.7, "--optimizer_beta2": 0.75}
    native, report = _translate(tmp_path, {**config, "--optimizer_config": {"betas": [0.8, 0.9]}})
    assert (native["adam_beta1"], native["adam_beta2"]) == (0.7, 0.75)  # optimizer_param.py:905-907 win
    with pytest.raises(dialect.DialectError, match="`optimizer_beta1` and `optimizer_beta2` are read together"):
        _translate(tmp_path, {"--optimizer_beta1": 0.8})


def test_optimi_sgd_builds_sgd_without_momentum(tmp_path, make_config):
    optimi = pytest.importorskip("optimi", reason="the optimi extra is not installed")
    native, _ = _translate(tmp_path, {"--optimizer": "optimi-sgd"})
    cfg = _native(make_config, optimizer=native["optimizer"], optimizer_config=native["optimizer_config"])
    optimizer = build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(optimizer, optimi.SGD) and optimizer.defaults["momentum"] == 0.0  # optimizer_param.py:395-408
    native_sgd = build_optimizer(_native(make_config, optimizer="sgd"), [torch.nn.Parameter(torch.zeros(2))])
    assert native_sgd.defaults["momentum"] == 0.9


# --- settings SimpleTuner's model classes force ------------------------------------------------------------------
def test_wan22_i2v_a14b_gets_the_flavours_shift_steps_and_guidance(tmp_path):
    # helpers/models/wan/model.py:369-386 (WAN_STAGE_OVERRIDES) applied at 988-990 whatever the config says.
    config = {
        "--model_family": "wan",
        "--model_flavour": "i2v-14b-2.2-high",
        "--pretrained_model_name_or_path": str(tmp_path),
        "--flow_schedule_shift": 3.0,
        "--validation_prompt": "a cat",
        "--validation_guidance": 5.0,
    }
    native, report = dialect.translate(config, cwd=tmp_path)
    assert native["flow_shift"] == 5.0 and native["train_stages"] == "high"
    assert native["validation_num_inference_steps"] == 40 and native["validation_guidance_scale"] == 3.5
    assert native["aspect_bucket_alignment"] == 32  # wan/model.py:1529-1535
    forced = "\n".join(report.overridden)
    assert "`flow_schedule_shift: 3.0` -> 5.0" in forced and "`validation_guidance: 5.0` -> 3.5" in forced
    native, report = dialect.translate({**config, "--model_flavour": "ti2v-5b-2.2"}, cwd=tmp_path)
    assert native["aspect_bucket_alignment"] == 64 and native["flow_shift"] == 3.0  # SimpleTuner's generic default


@pytest.mark.parametrize(
    "family, alignment",
    [("sd1x", 64), ("sd2x", 64), ("sdxl", 64), ("sd3", 64), ("flux", 64), ("wan", 32), ("qwen_image", 32)],
)
def test_bucket_alignment_is_the_one_simpletuner_forces_per_family(tmp_path, family, alignment):
    native, report = dialect.translate(
        {"--model_family": family, "--pretrained_model_name_or_path": str(tmp_path), "--aspect_bucket_alignment": 16},
        cwd=tmp_path,
    )
    assert native["aspect_bucket_alignment"] == alignment
    assert any(f"`aspect_bucket_alignment: 16` -> {alignment}" in line for line in report.overridden)


def test_sd2x_trains_with_zero_terminal_snr_as_simpletuner_forces(tmp_path, make_config):
    from simpletuner.models import get_model_spec

    native, report = dialect.translate(
        {"--model_family": "sd2x", "--pretrained_model_name_or_path": str(tmp_path), "--rescale_betas_zero_snr": False}
    )
    assert native["rescale_betas_zero_snr"] is True  # sd1x/model.py:395-400, whatever the config says
    assert any("`rescale_betas_zero_snr: False` -> True" in line for line in report.overridden)
    spec = get_model_spec(_native(make_config, rescale_betas_zero_snr=True))
    assert float(spec.load_noise_scheduler().alphas_cumprod[-1]) < 1e-12  # the training schedule ends at pure noise
    plain = get_model_spec(_native(make_config)).load_noise_scheduler()
    assert float(plain.alphas_cumprod[-1]) > 1e-4


def test_libreflux_stops_naming_attention_masking(tmp_path):
    config = {"--model_family": "flux", "--model_flavour": "libreflux", "--pretrained_model_name_or_path": "."}
    with pytest.raises(dialect.DialectError, match="attention-masked"):
        dialect.translate(config, cwd=tmp_path)


# --- validation cadence and seed -----------------------------------------------------------------------------------
def test_validation_every_100_steps_and_the_seed_said(tmp_path):
    native, report = _translate(tmp_path, {"--validation_prompt": "a cat"})
    assert native["validation_steps"] == 100  # field_registry/sections/validation.py:18-27
    assert "seed" not in native and any("`seed` is not set" in line for line in report.notes)
    native, _ = _translate(tmp_path, {"--validation_prompt": "a cat", "--validation_step_interval": 7, "--seed": 0})
    assert native["validation_steps"] == 7 and native["seed"] == 0
    native, _ = _translate(tmp_path, {})
    assert "validation_steps" not in native


def test_convert_writes_only_what_loads(tmp_path, tiny_sd, monkeypatch, capsys):
    from simpletuner.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    datasets = [{"id": "a", "type": "local", "instance_data_dir": "data", "crop": True, "crop_style": "centre"}]
    (tmp_path / "mdb.json").write_text(json.dumps(datasets))
    base = {
        "--model_family": "sd1x",
        "--pretrained_model_name_or_path": str(tiny_sd),
        "--data_backend_config": "mdb.json",
    }
    (tmp_path / "c.json").write_text(json.dumps(base))
    assert main(["convert", "c.json", "--out", "n.json"]) == 0
    assert json.loads((tmp_path / "n.json").read_text())["datasets"][0]["crop_style"] == "center"
    assert validate_config(json.loads((tmp_path / "n.json").read_text()), check_files=False)
    datasets[0]["crop_style"] = "face"
    (tmp_path / "mdb.json").write_text(json.dumps(datasets))
    assert main(["convert", "c.json", "--out", "face.json"]) == 2
    assert "`crop_style`: 'face' is not supported here" in capsys.readouterr().err
    datasets[0]["crop_style"] = "random"
    (tmp_path / "mdb.json").write_text(json.dumps(datasets))
    (tmp_path / "c.json").write_text(json.dumps({**base, "--train_batch_size": 0}))
    assert main(["convert", "c.json", "--out", "bad.json"]) == 2
    err = capsys.readouterr().err
    assert "train_batch_size" in err and "nothing written" in err and not (tmp_path / "bad.json").exists()


def test_min_snr_weights_stay_finite_at_zero_terminal_snr(make_config):
    from simpletuner.models import get_model_spec
    from simpletuner.models.noise import min_snr_weights

    scheduler = get_model_spec(_native(make_config, rescale_betas_zero_snr=True)).load_noise_scheduler()
    last = torch.tensor([scheduler.config.num_train_timesteps - 1, 10])
    eps = min_snr_weights(last, scheduler, 5.0, "epsilon")
    assert torch.isfinite(eps).all() and eps[0] == 1.0  # min(snr, gamma) / snr -> 1 as snr -> 0
    assert min_snr_weights(last, scheduler, 5.0, "v_prediction")[0] == 0.0


def test_sd3_prompts_have_simpletuners_t5_length(tmp_path, zoo_config):
    from simpletuner.models import get_model_spec
    from simpletuner.training.validation import pipeline_arguments

    base = {"--model_family": "sd3", "--pretrained_model_name_or_path": str(tmp_path)}
    native, report = dialect.translate(base, cwd=tmp_path)
    assert native["t5_max_length"] == 154  # sd3/model.py:853-855
    native, report = dialect.translate({**base, "--tokenizer_max_length": 300}, cwd=tmp_path)
    assert native["t5_max_length"] == 154 and any("-> 154" in line for line in report.overridden)
    native, _ = dialect.translate({**base, "--tokenizer_max_length": 300, "--i_know_what_i_am_doing": True})
    assert native["t5_max_length"] == 300
    native, report = dialect.translate({**base, "--model_family": "flux", "--tokenizer_max_length": 300})
    assert "t5_max_length" not in native and any("tokenizer_max_length" in line for line in report.ignored)

    default = get_model_spec(validate_config(zoo_config("sd3"), check_files=False))
    short = get_model_spec(validate_config(zoo_config("sd3", t5_max_length=154), check_files=False))
    encoders = short.load_text_encoders(torch.device("cpu"), torch.float32)
    embeds = short.encode_prompts(encoders, ["a red cube"])[0]["prompt_embeds"]
    clip_length = encoders["tokenizer"].model_max_length
    assert embeds.shape[0] == clip_length + 154
    assert default.encode_prompts(encoders, ["a red cube"])[0]["prompt_embeds"].shape[0] == clip_length + 256
    assert short.text_encoder_identity() != default.text_encoder_identity()  # a cache made at 256 is a miss
    kwargs = pipeline_arguments("sd3", short.config, 64, 64)
    assert kwargs["max_sequence_length"] == 154
    assert "max_sequence_length" not in pipeline_arguments("sd3", default.config, 64, 64)


def test_qwen_alignment_is_lifted_by_the_switch_as_in_simpletuner(tmp_path):
    config = {"--model_family": "qwen_image", "--pretrained_model_name_or_path": str(tmp_path)}
    native, _ = dialect.translate({**config, "--aspect_bucket_alignment": 64}, cwd=tmp_path)
    assert native["aspect_bucket_alignment"] == 32
    native, _ = dialect.translate({**config, "--aspect_bucket_alignment": 64, "--i_know_what_i_am_doing": True})
    assert native["aspect_bucket_alignment"] == 64


def test_aspect_bucket_rounding_2_is_not_also_an_approximation(tmp_path):
    _, report = _translate(tmp_path, {"--aspect_bucket_rounding": 2})
    assert not [line for line in report.approximated if "aspect_bucket_rounding" in line]
    assert any("aspect_bucket_rounding" in line for line in report.ignored)
    _, report = _translate(tmp_path, {"--aspect_bucket_rounding": 3})
    assert len([line for line in report.approximated if "aspect_bucket_rounding" in line]) == 1


def test_dataset_placeholders_are_filled_as_simpletuner_fills_them(tmp_path, monkeypatch):
    # data_backend/factory.py:1194-1218 and configuration/template_vars.py:13-28
    monkeypatch.setenv("ST_DATA", "pictures")
    (tmp_path / "mdb.json").write_text(
        json.dumps(
            [
                {
                    "id": "cats",
                    "type": "local",
                    "instance_data_dir": "{env:ST_DATA}/{id}",
                    "cache_dir_vae": "{output_dir}/vae/{model_family}/{id}",
                }
            ]
        )
    )
    native, _ = _translate(tmp_path, {"--data_backend_config": "mdb.json", "--output_dir": "out"})
    (ds,) = native["datasets"]
    assert ds["instance_data_dir"] == str(tmp_path / "pictures" / "cats")
    assert ds["cache_dir_vae"] == str(tmp_path / "out" / "vae" / "sd1x" / "cats")


def test_dataset_switches_written_as_strings_stop(tmp_path):
    # SimpleTuner's dataset reader takes bool(value) (factory.py:1175): "false" would be on there
    (tmp_path / "mdb.json").write_text(
        json.dumps([{"id": "a", "type": "local", "instance_data_dir": ".", "crop": "false"}])
    )
    with pytest.raises(dialect.DialectError, match=r"crop` = 'false': SimpleTuner's dataset reader takes any"):
        _translate(tmp_path, {"--data_backend_config": "mdb.json"})


def test_ema_cpu_only_wins_over_ema_device(tmp_path):
    native, report = _translate(tmp_path, {"--use_ema": True, "--ema_device": "accelerator", "--ema_cpu_only": True})
    assert native["ema_device"] == "cpu" and any("`ema_cpu_only` wins" in line for line in report.overridden)


@pytest.mark.parametrize("flavour, why", [("schnell", "256-token T5"), ("libreflux", "attention-masked")])
def test_flux_flavours_trained_with_settings_not_here_stop(tmp_path, flavour, why):
    config = {"--model_family": "flux", "--model_flavour": flavour, "--pretrained_model_name_or_path": str(tmp_path)}
    with pytest.raises(dialect.DialectError, match=why):
        dialect.translate(config, cwd=tmp_path)


def test_prodigy_is_never_clipped_and_lycoris_file_needs_lycoris(tmp_path):
    native, report = _translate(tmp_path, {"--optimizer": "prodigy", "--max_grad_norm": 1.0, "--learning_rate": 1.0})
    assert native["max_grad_norm"] is None and any("never clips" in line for line in report.overridden)
    native, report = _translate(tmp_path, {"--lycoris_config": "config/lycoris_config.json"})  # absent: not read
    assert "lycoris" not in native and any("lycoris_config" in line for line in report.ignored)


def test_top_level_multiline_switch_is_skipped_as_simpletuners_reader_skips_it(tmp_path):
    (tmp_path / "mdb.json").write_text(json.dumps([{"id": "a", "type": "local", "instance_data_dir": "."}]))
    native, report = _translate(tmp_path, {"--disable_multiline_split": True, "--data_backend_config": "mdb.json"})
    assert "disable_multiline_split" not in native and "disable_multiline_split" not in native["datasets"][0]
    assert any(
        line.startswith("`disable_multiline_split` (SimpleTuner's config reader skips") for line in report.ignored
    )


# --- convert -> load, for every value SimpleTuner spells -----------------------------------------------------------
def _value_rows():
    from simpletuner.configuration.simpletuner.facts import VALUE_TABLES

    return [(key, value, ours) for key, table in VALUE_TABLES.items() for value, ours in table.items()]


#: What a value needs beside it to be a config SimpleTuner would run (its other rules), by (key, value).
_NEEDS = {
    ("caption_strategy", "parquet"): {"parquet": {"path": "captions.jsonl"}},
    ("caption_strategy", "instanceprompt"): {"instance_prompt": "sks"},
    ("caption_strategy", "instance_prompt"): {"instance_prompt": "sks"},
    ("caption_strategy", "huggingface"): {"type": "huggingface", "dataset_name": "org/set"},
}


@pytest.mark.parametrize("key, value, ours", _value_rows(), ids=lambda v: str(v))
def test_convert_writes_a_loadable_config_or_stops_naming_the_value(tmp_path, monkeypatch, capsys, key, value, ours):
    from simpletuner.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    top = {"--model_type": "lora", "--pretrained_model_name_or_path": "model", "--learning_rate": 1e-4}
    entry = {"id": "a", "type": "local", "instance_data_dir": "data"}
    if key == "model_family":
        top["--model_family"] = value
    else:
        top["--model_family"] = "sd1x"
    if key in ("caption_strategy", "crop_style"):
        entry.update({key: value, **_NEEDS.get((key, value), {})})
    elif key != "model_family":
        top[f"--{key}"] = value
    if key == "optimizer" and value == "prodigy":
        top["--learning_rate"] = 1.0
    (tmp_path / "mdb.json").write_text(json.dumps([entry]))
    (tmp_path / "c.json").write_text(json.dumps({**top, "--data_backend_config": "mdb.json"}))
    code = main(["convert", "c.json", "--out", "n.json"])
    err = capsys.readouterr().err
    if ours is None:
        assert code == 2 and not (tmp_path / "n.json").exists()
        assert f"`{key}`" in err or f"{key}:" in err, err
        return
    assert code == 0, err
    validate_config(json.loads((tmp_path / "n.json").read_text()), check_files=False)


def test_native_examples_are_not_converted_and_load(capsys):
    from simpletuner.cli import main
    from simpletuner.configuration import load_config

    examples = sorted((Path(__file__).resolve().parents[1] / "config" / "examples").glob("*.json"))
    assert examples
    for path in examples:
        assert main(["convert", str(path)]) == 2
        assert "already a native config" in capsys.readouterr().err
        load_config(path, check_files=False)


@pytest.mark.parametrize(
    "theirs, ours",
    [("int8-quanto", "qint8"), ("int4-quanto", "qint4"), ("int2-quanto", "qint2"), ("fp8wo-torchao", "fp8_torchao")],
)
def test_base_model_precision_keeps_the_kind_and_says_which_layers_differ(tmp_path, theirs, ours):
    """The quantisation kind is SimpleTuner's (quantisation/__init__.py:417-420, 720-725); which layers get it is
    not (its per-family exclude lists and Conv2d layers, quantisation/__init__.py:474-540): approximated, said."""
    native, report = _translate(tmp_path, {"--base_model_precision": theirs})
    assert native["base_model_precision"] == ours
    assert any("every Linear layer outside the model's `_keep_in_fp32_modules`" in line for line in report.approximated)
