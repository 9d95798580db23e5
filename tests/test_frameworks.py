"""fastoptim inside the training frameworks people use: Hugging Face's Trainer (built by class and
kwargs, or handed in; resumed from its checkpoints with fastoptim's state), Lightning (its
closures and checkpoints) and timm's optimizer registry, and Muon's param groups of a model through
them. Tiny models, a few steps: the checks are that a resumed run ends bit-identical to an
uninterrupted one, and that the frameworks step the optimizer as a plain loop does."""
import functools
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
    """Four steps of Trainer with fastoptim's Adan (fused engine), a checkpoint every two; ``how="muon"``:
    Muon (fused) on the model's muon_param_groups, handed in."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = tiny_gpt2()
    options = dict(lr=1e-2, weight_decay=0.02, fused=True)
    if how == "muon":
        muon = fastoptim.Muon(frameworks.muon_param_groups(model, lr=3e-3), lr=0.02, weight_decay=0.01, fused=True)
        handed = dict(optimizers=(muon, None))
    elif how == "optimizers":
        handed = dict(optimizers=(fastoptim.Adan(model.parameters(), **options), None))
    else:
        handed = dict(optimizer_cls_and_kwargs=(fastoptim.Adan, options))
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, save_steps=2, per_device_train_batch_size=4,
        lr_scheduler_type="constant", logging_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=token_batches(), **handed)
    trainer.train(resume_from_checkpoint=resume_from)
    return model, trainer


def test_muon_param_groups_split_a_model_as_keller_jordans_examples():
    """Hidden matrices with Muon (experts' weights as batches), conv filters flattened; the first and
    last layers (the stem and the head), the model's own params (a position embedding), embeddings,
    gains and biases with AdamW."""

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2, 8, 8))
            self.router = torch.nn.Linear(8, 2, bias=False)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 8, 3)
            self.position = torch.nn.Parameter(torch.zeros(1, 4, 8))
            self.body = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Linear(8, 8),
                                            torch.nn.Embedding(5, 8), torch.nn.Linear(8, 8, bias=False), Experts())
            self.head = torch.nn.Linear(8, 10)

    model = Net()
    model.body[4].weight.requires_grad_(False)  # frozen: not trained
    names = {id(param): name for name, param in model.named_parameters()}
    groups = frameworks.muon_param_groups(model, lr=3e-4, weight_decay=0.0)
    assert [({k: v for k, v in group.items() if k != "params"}, [names[id(p)] for p in group["params"]])
            for group in groups] == [
        ({"use_muon": True}, ["body.2.weight", "body.5.weight", "body.5.router.weight"]),
        ({"use_muon": True, "flatten": True}, ["body.0.weight"]),
        ({"use_muon": False, "lr": 3e-4, "weight_decay": 0.0},
         ["position", "stem.weight", "stem.bias", "body.0.bias", "body.1.weight", "body.1.bias", "body.2.bias",
          "body.3.weight", "head.weight", "head.bias"])]
    fastoptim.Muon(groups, lr=0.02)


@pytest.mark.parametrize("wrap", [torch.nn.utils.parametrizations.weight_norm,
                                  torch.nn.utils.parametrizations.spectral_norm])
def test_muon_param_groups_take_a_parametrized_layer_as_the_layer_it_is(wrap):
    """A Linear whose weight torch's parametrizations hold has a submodule (their holder): a head wrapped so was
    no layer, its originals went to Muon and the hidden layer before it to AdamW as the last (helper-100). A
    parametrized filter is still a filter."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Conv1d(8, 8, 1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 8), wrap(torch.nn.Linear(8, 3)))
    wrap(model[2])
    names = {id(param): name for name, param in model.named_parameters()}
    groups = frameworks.muon_param_groups(model)
    muon = [[names[id(p)] for p in group["params"]] for group in groups if group["use_muon"]]
    assert muon == [["1.weight", "4.weight"], [name for name in names.values() if name.startswith("2.parametrizations")]]
    companions = [names[id(p)] for group in groups if not group["use_muon"] for p in group["params"]]
    assert {name for name in names.values() if name.startswith("5.")} <= set(companions)


@pytest.mark.parametrize("option", ["params", "use_muon", "flatten", "split_sizes", "num_heads"])
def test_muon_param_groups_refuse_companion_options_that_they_decide(option):
    """They were merged last into the AdamW group: use_muon=True orthogonalized the embeddings and head,
    params=[] dropped them (helper-100)."""
    with pytest.raises(ValueError, match=f"muon_param_groups decides {option}"):
        frameworks.muon_param_groups(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), **{option: 1})


@pytest.mark.parametrize("how", ["optimizer_cls_and_kwargs", "optimizers"])
def test_hugging_face_trainer_steps_fastoptim_and_resumes_from_its_checkpoint(tmp_path, how):
    straight, trainer = hf_train(tmp_path / "straight", how)
    optimizer = trainer.optimizer.optimizer  # accelerate's wrapper around ours
    assert isinstance(optimizer, fastoptim.Adan)
    assert [int(group["step"]) for group in optimizer.param_groups] == [4] * len(optimizer.param_groups)
    resumed, _ = hf_train(tmp_path / "resumed", how, resume_from=str(tmp_path / "straight" / "checkpoint-2"))
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)  # fastoptim's state came back from the checkpoint, bit for bit


def test_hugging_face_trainer_steps_muon_on_muon_param_groups_and_resumes_from_its_checkpoint(tmp_path):
    """GPT-2's attention and MLP matrices with Muon; its embeddings (the head tied to the token one), layer
    norms and biases with AdamW."""
    straight, trainer = hf_train(tmp_path / "straight", "muon")
    optimizer = trainer.optimizer.optimizer
    names = {id(param): name for name, param in straight.named_parameters()}
    (muon, muon_names), (adamw, adamw_names) = [(group, [names[id(p)] for p in group["params"]])
                                                for group in optimizer.param_groups]
    assert muon["use_muon"] and muon_names == [f"transformer.h.0.{layer}.weight" for layer in (
        "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert not adamw["use_muon"] and adamw["lr"] == 3e-3 and adamw["eps"] == 1e-8
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"} <= set(adamw_names)
    assert straight.lm_head.weight is straight.transformer.wte.weight
    assert all(int(optimizer.state[param]["step"]) == 4 for param in adamw["params"])
    resumed, _ = hf_train(tmp_path / "resumed", "muon", resume_from=str(tmp_path / "straight" / "checkpoint-2"))
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


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


def timm_checks():
    """In a subprocess: register fastoptim in timm's registry and build each optimizer by name (Muon:
    ``timm_muon_checks``)."""
    import timm.optim
    names = frameworks.register_timm()
    assert all("_" not in name for name in names)
    assert set(names) <= set(timm.optim.list_optimizers())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    for cls in (cls for cls in frameworks.CLASSES if cls is not fastoptim.Muon):
        optimizer = timm.optim.create_optimizer_v2(model, frameworks.timm_name(cls), lr=1e-3, weight_decay=0.02)
        assert type(optimizer) is cls
        # timm's own grouping: no weight decay on biases and norms
        assert sorted(group["weight_decay"] for group in optimizer.param_groups) == [0.0, 0.02]
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    return names


def timm_muon_checks():
    """In a subprocess: fastoptim-muon from timm's factory, refused on timm's own groups; on
    muon_param_groups, a ViT's and a ResNet's split (names and options per group), a ViT's step, and
    the lrs timm's scheduler sets. Returns what the test checks."""
    import timm
    import timm.optim
    import timm.scheduler
    frameworks.register_timm()
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10)
    resnet = timm.create_model("resnet18", num_classes=10)
    try:
        timm.optim.create_optimizer_v2(vit, "fastoptim-muon", lr=0.02)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    groups = functools.partial(frameworks.muon_param_groups, lr=3e-4, weight_decay=0.0)
    checked = dict(refusal=refusal)
    for name, model in (("vit", vit), ("resnet", resnet)):
        optimizer = timm.optim.create_optimizer_v2(model, "fastoptim-muon", lr=0.02, weight_decay=0.01,
                                                   param_group_fn=groups)
        names = {id(param): name for name, param in model.named_parameters()}
        checked[name] = [[{key: group[key] for key in ("use_muon", "flatten", "lr", "weight_decay", "momentum")},
                          [names[id(param)] for param in group["params"]]] for group in optimizer.param_groups]
    optimizer = timm.optim.create_optimizer_v2(vit, "fastoptim-muon", lr=0.02, momentum=0.95, param_group_fn=groups)
    scheduler, _ = timm.scheduler.create_scheduler_v2(optimizer, "step", decay_epochs=1, decay_rate=0.5)
    scheduler.step(1)
    vit(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    checked["scheduled"] = [[group["lr"], group["momentum"]] for group in optimizer.param_groups]
    return checked


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


def run_with_timm(spec):
    """``spec["checks"]``, a function of this module, with torchvision stubbed out if ``spec["stub"]``."""
    if spec["stub"]:
        sys.meta_path.insert(0, StubTorchvision())
    return globals()[spec["checks"]]()


def in_timm_process(checks):
    """``checks()`` in a subprocess with timm (see StubTorchvision), its result."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed")
    loads = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0
    return in_subprocess("tests.test_frameworks:run_with_timm", dict(checks=checks, stub=not loads))


def test_timm_builds_fastoptim_by_name():
    names = in_timm_process("timm_checks")
    assert names == [f"fastoptim-{cls.__name__.lower()}" for cls in frameworks.CLASSES]


def test_timm_builds_fastoptim_muon_on_muon_param_groups_and_refuses_its_own_groups():
    checked = in_timm_process("timm_muon_checks")
    assert "pass param_group_fn=fastoptim.frameworks.muon_param_groups" in checked["refusal"]
    muon_options = dict(use_muon=True, flatten=False, lr=0.02, weight_decay=0.01, momentum=0.9)  # timm's momentum
    adamw_options = muon_options | dict(use_muon=False, lr=3e-4, weight_decay=0.0)
    hidden = [f"blocks.{i}.{layer}.weight" for i in range(2)
              for layer in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    (muon, muon_names), (adamw, adamw_names) = checked["vit"]
    assert (muon, muon_names, adamw) == (muon_options, hidden, adamw_options)
    assert {"cls_token", "pos_embed", "patch_embed.proj.weight", "head.weight", "head.bias", "norm.weight",
            "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias"} <= set(adamw_names)
    assert len(adamw_names) == 4 + 2 * 8 + 4  # the stem, tokens and position; 8 gains and biases a block; norm, head
    (filters, filter_names), (adamw, adamw_names) = checked["resnet"]
    assert (filters, adamw) == (muon_options | dict(flatten=True), adamw_options)
    assert "conv1.weight" not in filter_names and "layer4.1.conv2.weight" in filter_names
    assert "layer2.0.downsample.0.weight" in filter_names and len(filter_names) == 19
    assert {"conv1.weight", "fc.weight", "fc.bias", "bn1.weight", "layer1.0.bn1.bias"} <= set(adamw_names)
    assert checked["scheduled"] == [[0.01, 0.95], [1.5e-4, 0.95]]  # timm scales each group's own lr


def test_the_frameworks_module_is_an_attribute_after_import_fastoptim_as_the_docs_use_it():
    """docs/frameworks.md calls ``fastoptim.frameworks.muon_param_groups`` after ``import fastoptim``, which
    raised AttributeError unless the submodule was imported by name first (helper-83). A fresh process."""
    run = subprocess.run([sys.executable, "-c", "import fastoptim; print(fastoptim.frameworks.muon_param_groups.__name__)"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["muon_param_groups"], run.stderr[-3000:]
