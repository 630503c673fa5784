"""The estimator's two budgets per managed_memory mode: the arithmetic on hand-made breakdowns, the
picking order, GB10's single budget, the ratio bound, and `simpletuner estimate` end to end."""

from __future__ import annotations

import json

import pytest

from simpletuner.cli import main
from simpletuner.hardware import machine as hardware
from simpletuner.memory.advice import VALIDATION_MODELS
from simpletuner.memory.autoconfig import Estimate
from simpletuner.memory.estimator import GiB, MemoryBreakdown
from simpletuner.memory.managed_plan import Budgets, FrozenLayout, cheapest, machine_budgets, mode_rows

MiB = 1 << 20


def breakdown(weights: int, trainable: int, total: int) -> MemoryBreakdown:
    """A breakdown whose only meaningful fields are the weights, the trainable part and the total."""
    return MemoryBreakdown(
        weights=weights,
        trainable_weights=trainable,
        gradients=trainable,
        optimizer_state=0,
        activations=total - weights,
        batch_data=0,
        framework_overhead=0,
        total=total,
        optimizer_transient=0,
        backward_peak=0,
        not_live_at_once=0,
        cuda_context=0,
        workspaces=0,
        fragmentation=0,
        model_family="sd",
        micro_batch_size=1,
        resolution=64,
        latent_shape=(4, 8, 8),
        weight_dtype="bfloat16",
        trainable_dtype="float32",
        adapter="lora r16",
        optimizer="adamw",
        gradient_checkpointing=False,
        mixed_precision="bf16",
        device_kind="cuda",
        num_parameters=1,
        num_trainable_parameters=1,
    )


def estimate(weights: int, trainable: int, total: int, validation: int = 0) -> Estimate:
    extras = {VALIDATION_MODELS: validation} if validation else {}
    return Estimate(1, False, breakdown(weights, trainable, total), extras, 0.0)


def budgets(usable=100 * GiB, margin=0.85, integrated=False, cpu=400 * GiB, pool=500 * GiB, problem=None) -> Budgets:
    return Budgets(usable, margin, integrated, cpu, "test", pool, "test", problem)


LAYOUT = FrozenLayout(num_units=40, largest_unit_bytes=512 * MiB, prefetch_blocks_ahead=1)


def by_mode(rows):
    return {r.mode: r for r in rows}


def test_each_mode_places_exact_bytes():
    # 60 GiB of weights of which 1 GiB trains, 2 GiB of validation models, 90 GiB in all.
    est = estimate(60 * GiB, 1 * GiB, 88 * GiB, validation=2 * GiB)
    rows = by_mode(mode_rows(est, LAYOUT, budgets()))
    assert (rows["caches"].hbm_bytes, rows["caches"].grace_bytes) == (90 * GiB, 0)
    grace = 59 * GiB + 2 * GiB  # frozen weights + validation models
    assert rows["frozen_weights"].grace_bytes == grace
    assert rows["frozen_weights"].hbm_bytes == 90 * GiB - grace + 2 * 512 * MiB  # + (1 + 1) largest blocks
    assert (rows["all"].hbm_bytes, rows["all"].grace_bytes) == (90 * GiB, 0)
    assert [r.status for r in rows.values()] == ["tight", "fits", "fits"]  # 90 GiB: over the 85 GiB margin


def test_caches_over_the_margin_is_tight_and_over_usable_is_no():
    tight = by_mode(mode_rows(estimate(10 * GiB, GiB, 90 * GiB), LAYOUT, budgets()))["caches"]
    assert tight.status == "tight" and "over the 85% margin" in tight.why and not tight.fits
    over = by_mode(mode_rows(estimate(10 * GiB, GiB, 101 * GiB), LAYOUT, budgets()))["caches"]
    assert over.status == "no" and "HBM over usable" in over.why


def test_all_spills_beyond_usable_and_is_bounded_by_the_pool():
    est = estimate(60 * GiB, GiB, 300 * GiB)
    row = by_mode(mode_rows(est, LAYOUT, budgets()))["all"]
    assert (row.hbm_bytes, row.grace_bytes, row.status) == (100 * GiB, 200 * GiB, "fits")
    row = by_mode(mode_rows(est, LAYOUT, budgets(pool=299 * GiB)))["all"]
    assert row.status == "no" and "over its 299.00 GiB bound" in row.why
    row = by_mode(mode_rows(est, LAYOUT, budgets(cpu=199 * GiB)))["all"]
    assert row.status == "no" and "Grace 200.00 GiB over the 199.00 GiB CPU memory budget" in row.why


def test_picking_order_is_caches_then_frozen_weights_then_all():
    assert cheapest(mode_rows(estimate(60 * GiB, GiB, 80 * GiB), LAYOUT, budgets())) == "caches"
    assert cheapest(mode_rows(estimate(60 * GiB, GiB, 120 * GiB), LAYOUT, budgets())) == "frozen_weights"
    assert cheapest(mode_rows(estimate(10 * GiB, GiB, 200 * GiB), LAYOUT, budgets())) == "all"
    assert cheapest(mode_rows(estimate(10 * GiB, GiB, 600 * GiB), LAYOUT, budgets())) is None
    # A refused mode is skipped with its reason.
    rows = mode_rows(estimate(60 * GiB, GiB, 120 * GiB), LAYOUT, budgets(), {"frozen_weights": "quantised base"})
    assert by_mode(rows)["frozen_weights"].why == "refused: quantised base" and cheapest(rows) == "all"


def test_gb10_counts_both_sides_against_one_budget():
    # One 100 GiB memory: frozen_weights moves nothing off it, so its HBM + Grace (total + window) must fit.
    shared = budgets(integrated=True, cpu=90 * GiB, pool=90 * GiB)
    rows = by_mode(mode_rows(estimate(60 * GiB, GiB, 80 * GiB), LAYOUT, shared))
    assert rows["frozen_weights"].hbm_bytes + rows["frozen_weights"].grace_bytes == 81 * GiB
    assert rows["caches"].fits and rows["frozen_weights"].fits
    rows = by_mode(mode_rows(estimate(80 * GiB, GiB, 89 * GiB + 768 * MiB), LAYOUT, shared))
    assert rows["caches"].status == "tight"  # within the 90 GiB budget, over the 85 GiB margin
    assert rows["frozen_weights"].status == "no" and "one shared memory" in rows["frozen_weights"].why
    # The same numbers with a separate CPU memory (GH200): frozen weights leave HBM.
    assert by_mode(mode_rows(estimate(80 * GiB, GiB, 89 * GiB + 768 * MiB), LAYOUT, budgets()))["frozen_weights"].fits


def test_budgets_from_the_table_and_the_ratio_bound():
    gh200 = hardware.hardware_for_gpu("gh200")
    b = machine_budgets(gh200, gh200.usable_memory_bytes, 0.85)
    assert b.cpu_budget == int(480 * GiB * 0.9) and "the GPU table's figure" in b.cpu_source
    assert b.pool_bound == int((480 + 96) * GiB * 0.9) and not b.integrated
    b = machine_budgets(gh200, gh200.usable_memory_bytes, 0.85, ratio=2.0)
    assert b.pool_bound == 192 * GiB and b.pool_problem is None
    b = machine_budgets(gh200, gh200.usable_memory_bytes, 0.85, ratio=6.0)
    assert "oversubscription_ratio 6 bounds the pool at 576.00 GiB" in b.pool_problem
    row = by_mode(mode_rows(estimate(10 * GiB, GiB, 50 * GiB), LAYOUT, b))["all"]
    assert row.status == "no" and row.why.startswith("refused: oversubscription_ratio 6")

    gb10 = hardware.hardware_for_gpu("gb10")
    b = machine_budgets(gb10, gb10.usable_memory_bytes, 0.85)
    assert b.integrated and b.cpu_budget == int(119 * GiB * 0.9) and b.pool_bound == int(119 * GiB * 0.9)


# --- end to end -----------------------------------------------------------------------------------------
@pytest.fixture
def lora_cfg(tmp_path, make_config):
    """The tiny SD config as a LoRA run with a gh200_optimizations section of its own."""
    raw = make_config(
        train_batch_size=2,
        mixed_precision="no",
        training_type="lora",
        gh200_optimizations={"prefetch_blocks_ahead": 0, "enable_batch_size_rampup": False},
    )
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw, indent=2))
    return path


def _json(capsys, argv) -> tuple[int, dict]:
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def _between_caches_and_frozen(capsys, cfg) -> str:
    """A --gpu-memory (GiB) that holds the tiny run with frozen weights in CPU memory, and not without."""
    code, data = _json(capsys, ["estimate", "--config", str(cfg), "--gpu", "gh200", "--json"])
    rows = {r["mode"]: r for r in data["managed_memory"]["rows"]}
    assert code == 0 and data["managed_memory"]["cheapest"] == "caches"
    caches, frozen = rows["caches"]["hbm_bytes"], rows["frozen_weights"]["hbm_bytes"]
    assert frozen < caches  # the tiny base moves to CPU memory
    return repr((caches + frozen) / 2 / GiB)


def test_estimate_names_the_mode_that_fits_and_apply_writes_it(lora_cfg, capsys):
    memory = _between_caches_and_frozen(capsys, lora_cfg)
    argv = ["estimate", "--config", str(lora_cfg), "--gpu", "gh200", "--gpu-memory", memory, "--safety-margin", "1"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "managed_memory caches does not fit" in out and "managed_memory frozen_weights does" in out
    assert "--apply` (with the same --gpu / --gpu-memory) writes" in out
    assert "<- the config's mode" in out and "<- cheapest that fits" in out

    code, data = _json(capsys, [*argv, "--json"])
    table = data["managed_memory"]
    assert code == 1 and data["fits"] is False
    assert table["config_mode"] == "caches" and table["cheapest"] == "frozen_weights"
    assert [r["mode"] for r in table["rows"]] == ["caches", "frozen_weights", "all"]
    assert [r["status"] for r in table["rows"]][:2] == ["no", "fits"]

    assert main([*argv, "--apply"]) == 0
    out = capsys.readouterr().out
    written = json.loads(lora_cfg.read_text())
    assert written["gh200_optimizations"] == {
        "prefetch_blocks_ahead": 0,
        "enable_batch_size_rampup": False,
        "managed_memory": "frozen_weights",
    }
    assert "auto-config planned the batch for managed_memory frozen_weights (was caches)" in out
    assert '"managed_memory": "frozen_weights"' in out  # the diff
    assert main(argv) == 0  # the config's mode now fits
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  frozen_weights ")]
    assert row.endswith("<- the config's mode  <- cheapest that fits")


def test_discrete_card_gets_a_note_and_no_table(lora_cfg, capsys):
    code, data = _json(capsys, ["estimate", "--config", str(lora_cfg), "--gpu", "h100", "--json"])
    assert code == 0 and data["managed_memory"]["unified"] is False
    assert "need unified memory" in data["managed_memory"]["note"] and "rows" not in data["managed_memory"]
    assert main(["estimate", "--config", str(lora_cfg), "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "need unified memory (GH200, GB10)" in out and "HBM GiB" not in out
