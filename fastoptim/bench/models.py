"""The models the benchmark steps on: real definitions from transformers, built without weights.

Each model comes with an example batch, so its gradients can come from one real backward pass.
The GPT-2 grid is the seed's (heads x layers x embedding size, vocab 49280, 2048 positions); the
vision models are those of the seed's table, in their usual ImageNet configurations.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..measure import params_and_sn, quiet_transformers

GPT2_GRID = [(6, 6, 768), (12, 6, 768), (16, 6, 768), (6, 12, 768), (12, 12, 768), (16, 12, 768),
             (16, 6, 1024), (16, 12, 1024), (6, 24, 768), (12, 24, 768), (16, 24, 768), (6, 6, 1536),
             (12, 6, 1536), (16, 6, 1536), (16, 24, 1024), (16, 6, 2048), (6, 12, 1536), (12, 12, 1536),
             (16, 12, 1536), (16, 6, 2560), (16, 12, 2048), (6, 24, 1536), (12, 24, 1536), (16, 24, 1536),
             (16, 24, 2048)]


@dataclass(frozen=True)
class Model:
    build: Callable[[], torch.nn.Module]
    batch: Callable[[], dict]  # keyword arguments of one forward pass whose output has a .loss


def tokens(vocab, length=32):
    def batch():
        ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
        return dict(input_ids=ids, labels=ids)
    return batch


def image(size=224):
    def batch():
        pixels = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))
        return dict(pixel_values=pixels, labels=torch.tensor([1]))
    return batch


def gpt2(heads, layers, dim, vocab=49280, positions=2048):
    def build():
        import transformers
        config = transformers.GPT2Config(n_head=heads, n_layer=layers, n_embd=dim, vocab_size=vocab,
                                         n_positions=positions, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    return Model(build, tokens(vocab))


def llama(layers=8, hidden=512, intermediate=1376, heads=8, vocab=32000):
    def build():
        import transformers
        config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                          num_attention_heads=heads, vocab_size=vocab)
        return transformers.LlamaForCausalLM(config)
    return Model(build, tokens(vocab))


def vision(config_name, model_name, **config):
    def build():
        import transformers
        return getattr(transformers, model_name)(getattr(transformers, config_name)(num_labels=1000, **config))
    return Model(build, image())


class SmallTensors(torch.nn.Module):
    """``count`` 1-d params of ``low``..``high`` elements: the many-small-tensors case, where per-tensor
    overheads dominate. Its loss touches every param, so backward gives each a gradient."""

    def __init__(self, count=2000, low=1000, high=5000):
        super().__init__()
        step = (high - low) / max(count - 1, 1)
        self.tensors = torch.nn.ParameterList(torch.randn(low + round(i * step)) * 0.02 for i in range(count))

    def forward(self, scale):
        return type("Output", (), {"loss": sum((t * scale).square().sum() for t in self.tensors)})


MODELS = {f"gpt2-h{h}-l{layer}-d{d}": gpt2(h, layer, d) for h, layer, d in GPT2_GRID}
MODELS |= {
    "gpt2-124m": gpt2(12, 12, 768, vocab=50257, positions=1024),  # GPT-2 small as released
    "gpt2-tiny": gpt2(2, 2, 64, vocab=512, positions=64),  # for smoke tests
    "llama-60m": llama(),  # GaLore's and the subset-norm paper's smallest LLaMA
    "resnet50": vision("ResNetConfig", "ResNetForImageClassification", depths=[3, 4, 6, 3],
                       hidden_sizes=[256, 512, 1024, 2048], layer_type="bottleneck"),
    "resnet101": vision("ResNetConfig", "ResNetForImageClassification", depths=[3, 4, 23, 3],
                        hidden_sizes=[256, 512, 1024, 2048], layer_type="bottleneck"),
    "vit-b": vision("ViTConfig", "ViTForImageClassification"),
    "vit-l": vision("ViTConfig", "ViTForImageClassification", hidden_size=1024, num_hidden_layers=24,
                    num_attention_heads=16, intermediate_size=4096),
    "swin-b": vision("SwinConfig", "SwinForImageClassification", embed_dim=128, depths=[2, 2, 18, 2],
                     num_heads=[4, 8, 16, 32]),
    "swin-l": vision("SwinConfig", "SwinForImageClassification", embed_dim=192, depths=[2, 2, 18, 2],
                     num_heads=[6, 12, 24, 48]),
    "convnext-b": vision("ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[128, 256, 512, 1024],
                         depths=[3, 3, 27, 3]),
    "convnext-l": vision("ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[192, 384, 768, 1536],
                         depths=[3, 3, 27, 3]),
    "small-tensors": Model(SmallTensors, lambda: dict(scale=torch.tensor(1.0))),
}
# The seed's FusedAdan tables: its GPT-2 grid, then its vision models.
SEED_MODELS = [f"gpt2-h{h}-l{layer}-d{d}" for h, layer, d in GPT2_GRID] + [
    "resnet50", "resnet101", "vit-b", "vit-l", "swin-b", "swin-l", "convnext-b", "convnext-l"]


def shapes(name):
    """The (shape, subset-norm) pair of every param of model ``name``, from a build on the meta
    device: no memory, no weights."""
    quiet_transformers()
    with torch.device("meta"):
        module = MODELS[name].build()
    return [(tuple(p.shape), sn) for p, sn in zip(*params_and_sn(module))]


def with_gradients(name, dtype=torch.float32, device="cpu", backward=True):
    """Model ``name``'s params in ``dtype`` on ``device`` with gradients: from one backward pass on
    its example batch, or random normal ones (``backward=False``), and which get subset-norm states."""
    quiet_transformers()
    torch.manual_seed(0)
    module = MODELS[name].build().to(device=device, dtype=dtype)
    params, sn = params_and_sn(module)
    if backward:
        batch = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device)
                 for k, v in MODELS[name].batch().items()}
        module(**batch).loss.backward()
    for p in params:
        if p.grad is None:  # not reached by the loss (or no backward): random, at a gradient's scale
            p.grad = torch.randn_like(p) * 1e-3
    return params, sn
