"""The accelerator row's arithmetic and shapes (benchmarks/accelerator.py), checked on CPU: the FLOPs that MFU
counts, and the real presets' rows built as a TPU would run them."""

from __future__ import annotations

from benchmarks.cost import model_flops_per_token
from training.config import load_config


def test_a_tied_head_is_counted_as_the_matmul_it_is() -> None:
    """Tied or not, the output head is one [vocab, width] matmul a token; only the lookup is free."""
    tied = load_config("llama3.2-1b").model
    untied = tied.model_copy(update={"tie_embeddings": False})
    assert model_flops_per_token(tied) == model_flops_per_token(untied)
    # 6 x every parameter (the one embedding matrix is the head's matmul) + attention's 12 x layers x width x seq
    assert model_flops_per_token(tied) == 6 * 1_235_814_400 + 12 * 16 * 2048 * tied.seq_len


def test_the_rows_of_llama_3_2_1b_train_its_preset_at_their_sequence_and_batch_on_one_device() -> None:
    from benchmarks.shapes import CPU_DEFAULT, SHAPES, TPU_DEFAULT
    from training.mesh import feasible_sizes
    from training.models.attention import resolve

    preset = load_config("llama3.2-1b")
    rows = {"llama3.2-1b": (2048, 2), "llama3.2-1b-b4": (2048, 4), "llama3.2-1b-seq8192": (8192, 1)}
    for name, (seq, batch) in rows.items():
        cfg = SHAPES[name].config()
        assert cfg.model.model_dump(exclude={"seq_len"}) == preset.model.model_dump(exclude={"seq_len"}), name
        assert (cfg.model.seq_len, cfg.optimizer.global_batch, SHAPES[name].vocab) == (seq, batch, 128256)
        assert (cfg.model.remat, cfg.model.attention, cfg.model.head_dim) == ("auto", "auto", 64)
        assert feasible_sizes(cfg) == [1] and cfg.placement.devices_per_worker == 1
        assert resolve(cfg.model.attention, seq, cfg.model.head_dim, "tpu") == "splash"  # on a TPU: the kernel
        assert name in TPU_DEFAULT
    assert SHAPES["llama3.2-1b"].config().optimizer.global_batch == preset.optimizer.global_batch  # the defaults
    assert CPU_DEFAULT == ("cpu-small",)  # on CPU the row stays small


def test_the_row_chooses_remat_auto_on_its_own_device_and_says_why() -> None:
    """In the measuring process, as on a TPU (there the device's own memory is the limit)."""
    import jax

    from benchmarks.accelerator import resolve_remat

    cfg = load_config(
        "tiny", None, {"model.remat": "auto", "model.scan_layers": True, "placement.devices_per_worker": 1}
    )
    chosen, reason = resolve_remat(cfg, jax.devices()[0])
    assert chosen.model.remat == "none" and reason.startswith("remat auto: none, the fewest FLOPs a step")
    fixed = load_config("tiny", None, {"model.remat": "dots"})
    assert resolve_remat(fixed, jax.devices()[0]) == (fixed, "")


def test_the_table_names_each_row_s_kernel_and_remat_and_why() -> None:
    from benchmarks.accelerator import Measured, table_lines

    m = Measured("llama3.2-1b", "tpu", "TPU v5 lite", step_s=[0.3], tokens_per_s=13653.0, mfu=0.55, compiled_gib=12.0)
    m.remat, m.attention, m.remat_reason = "dots", "splash", "remat auto: dots, the fewest FLOPs a step (...)"
    lines = table_lines({"platform": "tpu", "device_kind": "TPU v5 lite", "rows": [m.__dict__]})
    assert "llama3.2-1b" in lines[1] and "s (splash, remat dots), 13,653 tok/s, MFU 55.0%" in lines[1]
    assert lines[2] == "    remat auto: dots, the fewest FLOPs a step (...)"


def test_the_kernel_check_at_head_width_64() -> None:
    from benchmarks.accelerator import check_kernel

    got = check_kernel(seq_len=256, head_dim=64)  # on CPU auto is XLA's; on a TPU the splash kernel
    assert got["head_dim"] == 64 and got["kernel"] == "xla"
    assert max(float(got[k]) for k in ("dq", "dk", "dv")) < 1e-3 and float(got["loss"]) < 1e-2
