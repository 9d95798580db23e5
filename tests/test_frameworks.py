"""fastoptim inside the training frameworks people use: Hugging Face's Trainer (built by class and
kwargs, or handed in; resumed from its checkpoints with fastoptim's state), Lightning (its
closures and checkpoints) and timm's optimizer registry. Tiny models, a few steps: the checks are
that a resumed run ends bit-identical to an uninterrupted one, and that the frameworks step the
optimizer as a plain loop does."""
import importlib.abc
import importlib.machinery
import importlib.util
import subprocess
import sys
from unittest import mock

import pytest
import torch

import fastoptim
from fastoptim import frameworks
from fastoptim.bench.memory import in_subprocess


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16, resid_pdrop=0,
                                     embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(config)


def token_batches(count=16, length=8):
    ids = torch.randint(0, 64, (count, length), generator=torch.Generator().manual_seed(1))
    return [dict(input_ids=row, labels=row) for row in ids]


def hf_train(tmp_path, how, resume_from=None):
    """Four steps of Trainer with fastoptim's Adan (fused engine), a checkpoint every two."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = tiny_gpt2()
    options = dict(lr=1e-2, weight_decay=0.02, fused=True)
    handed = dict(optimizers=(fastoptim.Adan(model.parameters(), **options), None)) if how == "optimizers" else \
        dict(optimizer_cls_and_kwargs=(fastoptim.Adan, options))
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, save_steps=2, per_device_train_batch_size=4,
        lr_scheduler_type="constant", logging_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=token_batches(), **handed)
    trainer.train(resume_from_checkpoint=resume_from)
    return model, trainer


@pytest.mark.parametrize("how", ["optimizer_cls_and_kwargs", "optimizers"])
def test_hugging_face_trainer_steps_fastoptim_and_resumes_from_its_checkpoint(tmp_path, how):
    straight, trainer = hf_train(tmp_path / "straight", how)
    optimizer = trainer.optimizer.optimizer  # accelerate's wrapper around ours
    assert isinstance(optimizer, fastoptim.Adan)
    assert [int(group["step"]) for group in optimizer.param_groups] == [4] * len(optimizer.param_groups)
    resumed, _ = hf_train(tmp_path / "resumed", how, resume_from=str(tmp_path / "straight" / "checkpoint-2"))
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)  # fastoptim's state came back from the checkpoint, bit for bit


def lightning_module():
    lightning = pytest.importorskip("lightning")

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)
            self.losses_computed = 0

        def training_step(self, batch, _index):
            self.losses_computed += 1  # inside the closure Lightning hands to optimizer.step
            inputs, targets = batch
            return torch.nn.functional.mse_loss(self.layer(inputs), targets)

        def configure_optimizers(self):
            return fastoptim.Adan(self.parameters(), lr=1e-2, weight_decay=0.02, fused=True)
    return lightning, Regression()


def regression_batches():
    """Two batches an epoch: a checkpoint after two steps closes an epoch, where Lightning resumes exactly
    (a plain DataLoader restarts its epoch on resume)."""
    generator = torch.Generator().manual_seed(2)
    inputs = torch.randn(8, 4, generator=generator)
    return list(zip(inputs.split(4), (inputs.sum(1, keepdim=True) + 1).split(4)))


def lightning_fit(tmp_path, ckpt_path=None):
    """Four steps, with Lightning's ModelCheckpoint saving every two."""
    lightning, module = lightning_module()
    checkpoints = lightning.pytorch.callbacks.ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = lightning.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, callbacks=[checkpoints],
                                enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(regression_batches(), batch_size=None),
                ckpt_path=ckpt_path)
    return module


def test_lightning_steps_fastoptim_through_its_closure_like_a_plain_loop_and_resumes_it(tmp_path):
    module = lightning_fit(tmp_path)
    assert module.losses_computed == 4  # each step ran Lightning's closure once
    _, reference = lightning_module()
    optimizer = reference.configure_optimizers()
    for inputs, targets in regression_batches() * 2:  # two epochs
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference.layer(inputs), targets).backward()
        optimizer.step()
    for a, b in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    resumed = lightning_fit(tmp_path / "resumed", ckpt_path=next(tmp_path.glob("*step=2.ckpt")))
    for a, b in zip(module.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)  # fastoptim's state came back from Lightning's checkpoint, bit for bit


def timm_checks(_spec=None):
    """In a subprocess: register fastoptim in timm's registry and build each optimizer by name."""
    import timm.optim
    names = frameworks.register_timm()
    assert all("_" not in name for name in names)
    assert set(names) <= set(timm.optim.list_optimizers())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    for cls in frameworks.CLASSES:
        optimizer = timm.optim.create_optimizer_v2(model, frameworks.timm_name(cls), lr=1e-3, weight_decay=0.02)
        assert type(optimizer) is cls
        # timm's own grouping: no weight decay on biases and norms
        assert sorted(group["weight_decay"] for group in optimizer.param_groups) == [0.0, 0.02]
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    return names


class StubTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """torchvision as empty modules: timm's package imports it, its optimizers never use it, and the
    PyPI build of torchvision does not load beside a CPU build of torch."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return mock.MagicMock(__path__=[], __spec__=spec, __name__=spec.name)

    def exec_module(self, module):
        pass


def timm_checks_with_torchvision_stubbed(_spec=None):
    sys.meta_path.insert(0, StubTorchvision())
    return timm_checks()


def test_timm_builds_fastoptim_by_name():
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed")
    loads = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0
    target = "timm_checks" if loads else "timm_checks_with_torchvision_stubbed"
    names = in_subprocess(f"tests.test_frameworks:{target}", None)
    assert names == [f"fastoptim-{cls.__name__.lower()}" for cls in frameworks.CLASSES]
