"""fastoptim in other libraries' optimizer factories. Hugging Face's Trainer and Lightning take a
torch.optim.Optimizer as it is (see the README); timm builds optimizers by name from its registry.
Muon needs a model's params split into its groups, which :func:`muon_param_groups` does."""
import inspect

import torch
from torch.nn.utils import parametrize

import fastoptim

CLASSES = [fastoptim.Adan, fastoptim.AdamW, fastoptim.AdamWSN, fastoptim.RMSPropSN, fastoptim.Lion, fastoptim.Muon]
EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)
# Where a model names its input and output layers: Hugging Face's models, timm's (its classifier)
LAYER_GETTERS = ("get_input_embeddings", "get_output_embeddings", "get_classifier")


def named_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that the model names as its input and output layers (see ``LAYER_GETTERS``)."""
    layers = []
    for getter in LAYER_GETTERS:
        try:
            layer = getattr(model, getter)()
        except (AttributeError, NotImplementedError):  # a model without one (Hugging Face raises)
            continue
        if isinstance(layer, torch.nn.Module):
            layers.append(layer)
    return layers


def parametrized_leaf(module: torch.nn.Module) -> bool:
    """Whether ``module``'s only submodules hold its parametrized params (torch.nn.utils.parametrize)."""
    return parametrize.is_parametrized(module) and [name for name, _ in module.named_children()] == ["parametrizations"]


def muon_param_groups(model: torch.nn.Module, **companion_options) -> list[dict]:
    """``model``'s trainable params as :class:`fastoptim.Muon`'s param groups, split as Keller
    Jordan's examples split them: the hidden matrices with Muon (convolution filters, of
    ``torch.nn`` conv layers, with ``flatten=True``), and with AdamW (``use_muon=False``, with
    ``companion_options``, say ``lr``) the params of the input and output layers, the embeddings,
    and the gains and biases (params of fewer than 2 dims). The input and output layers are the
    first and the last module without submodules that holds a param of 2+ dims, the model's
    ``nn.Embedding`` and ``nn.EmbeddingBag`` modules, the params ``model`` holds itself, outside its
    submodules (position embeddings, class tokens; a submodule's own params, as experts' weights beside
    their router, are matrices), and what the model names as such: Hugging Face's
    ``get_input_embeddings()`` and ``get_output_embeddings()``, timm's ``get_classifier()``. Frozen
    params are left out, and so is an empty group; each group sets ``use_muon``.

    A module whose params torch's parametrizations hold (``weight_norm``, ``spectral_norm``) is one without
    submodules, and its ``original`` params are its own. ``companion_options`` may not set what this function
    decides: ``params``, ``use_muon``, or Muon's own ``flatten``, ``split_sizes`` and ``num_heads``.

    Also timm's ``param_group_fn`` (see :func:`register_timm`)."""
    decided = sorted(set(companion_options) & {"params", "use_muon", "flatten", "split_sizes", "num_heads"})
    if decided:
        raise ValueError(f"muon_param_groups decides {', '.join(decided)}: companion_options are the AdamW groups' "
                         "other options (lr, betas, weight_decay, ...)")
    layers = [module for module in model.modules()
              if (not next(module.children(), None) or parametrized_leaf(module))
              and any(p.dim() >= 2 for p in module.parameters())]
    nonhidden = [*layers[:1], *layers[-1:], *named_layers(model),
                 *(module for module in model.modules() if isinstance(module, EMBEDDINGS))]
    nonhidden_ids = {id(param) for module in nonhidden for param in module.parameters()}
    nonhidden_ids |= set(map(id, model.parameters(recurse=False)))
    filters = {id(param) for module in model.modules() if isinstance(module, torch.nn.modules.conv._ConvNd)
               for param in module.parameters()}  # a parametrized filter's originals too
    groups = {"hidden": [], "filters": [], "companions": []}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        kind = ("companions" if param.dim() < 2 or id(param) in nonhidden_ids
                else "filters" if id(param) in filters else "hidden")
        groups[kind].append(param)
    return [group for group in ({"params": groups["hidden"], "use_muon": True},
                                {"params": groups["filters"], "use_muon": True, "flatten": True},
                                {"params": groups["companions"], "use_muon": False, **companion_options})
            if group["params"]]


def timm_muon(params, **options) -> fastoptim.Muon:
    """fastoptim.Muon as timm's factory builds it: on param groups that each set ``use_muon``, as
    :func:`muon_param_groups` makes them (timm's ``param_group_fn``), or on matrices alone. timm's
    own groups split a model by weight decay, putting its embeddings and head with its hidden
    matrices, so they are refused, with what to pass instead."""
    params = list(params)
    if any(isinstance(group, dict) and "use_muon" not in group for group in params):
        raise ValueError(
            "fastoptim-muon takes a model's params split into Muon's groups, and timm's weight-decay groups are "
            "not (they put the embeddings and the head with the hidden matrices): pass "
            "param_group_fn=fastoptim.frameworks.muon_param_groups to timm.optim.create_optimizer_v2 (with "
            "functools.partial for the AdamW groups' options, say lr), or param groups that each set use_muon")
    return fastoptim.Muon(params, **options)


def timm_name(cls):
    """The name an optimizer class gets in timm's registry: timm reads an underscore as a prefix
    (``lookahead_adamw``), so the names have none."""
    return "fastoptim-" + cls.__name__.lower()


def register_timm(registry=None):
    """Registers fastoptim's optimizers in timm's optimizer registry (default: timm's own), as
    fastoptim-adan, fastoptim-adamw, fastoptim-adamwsn, fastoptim-rmspropsn, fastoptim-lion and
    fastoptim-muon, so that ``timm.optim.create_optimizer_v2(model, "fastoptim-adan", lr=...)`` builds
    them. fastoptim-muon takes ``param_group_fn=fastoptim.frameworks.muon_param_groups`` (see
    :func:`timm_muon`), and timm's ``momentum`` (0.9 unless given, as for timm's own muon).
    Returns the names."""
    from timm.optim import OptimInfo
    from timm.optim._optim_factory import default_registry  # not exported by timm.optim

    registry = registry or default_registry
    for cls in CLASSES:
        parameters = inspect.signature(cls).parameters
        registry.register(OptimInfo(name=timm_name(cls), opt_class=timm_muon if cls is fastoptim.Muon else cls,
                                    description=f"fastoptim.{cls.__name__}", has_eps="eps" in parameters,
                                    has_momentum="momentum" in parameters, has_betas="betas" in parameters,
                                    num_betas=cls.algorithm.n_betas))
    return [timm_name(cls) for cls in CLASSES]
