"""``AutoSPTrainer`` refuses settings that cannot work, before any process group work, saying what to do."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the Trainer integration needs transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")


def _trainer(tmp_path, **kwargs):
    from transformers import TrainingArguments

    from autosp.testing import hf_causal_lm
    from autosp_tools.hf import AutoSPTrainer

    compile_args = kwargs.pop("compile_args", {})
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1, **compile_args)
    return AutoSPTrainer(model=hf_causal_lm(layers=1), args=args, **kwargs)


def test_sp_size_that_does_not_divide_the_processes(tmp_path):
    with pytest.raises(ValueError, match="sp_size=2 does not divide the 1 processes"):
        _trainer(tmp_path, sp_size=2)


def test_sp_size_below_one(tmp_path):
    with pytest.raises(ValueError, match="sp_size must be a positive number of ranks, got 0"):
        _trainer(tmp_path, sp_size=0)


def test_compile_backend_comes_from_training_arguments_or_is_refused(tmp_path):
    assert _trainer(tmp_path)._autosp_inner_backend() == "inductor"
    trainer = _trainer(tmp_path, compile_args={"torch_compile": True, "torch_compile_backend": "aot_eager"})
    assert trainer._autosp_inner_backend() == "aot_eager"
    assert _trainer(tmp_path, autosp_backend="eager")._autosp_inner_backend() == "eager"
    trainer = _trainer(tmp_path, compile_args={"torch_compile": True, "torch_compile_backend": "cudagraphs"})
    with pytest.raises(ValueError, match="torch_compile_backend='cudagraphs'.*autosp_backend="):
        trainer._autosp_inner_backend()


def test_an_already_compiled_model_is_refused(tmp_path):
    import torch

    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match="pass the plain model"):
        trainer._wrap_model(torch.compile(trainer.model))
