"""fastoptim in other libraries' optimizer factories. Hugging Face's Trainer and Lightning take a
torch.optim.Optimizer as it is (see the README); timm builds optimizers by name from its registry."""
import inspect

import fastoptim

CLASSES = [fastoptim.Adan, fastoptim.AdamW, fastoptim.AdamWSN, fastoptim.RMSPropSN, fastoptim.Lion]


def timm_name(cls):
    """The name an optimizer class gets in timm's registry: timm reads an underscore as a prefix
    (``lookahead_adamw``), so the names have none."""
    return "fastoptim-" + cls.__name__.lower()


def register_timm(registry=None):
    """Registers fastoptim's optimizers in timm's optimizer registry (default: timm's own), as
    fastoptim-adan, fastoptim-adamw, fastoptim-adamwsn, fastoptim-rmspropsn and fastoptim-lion, so that
    ``timm.optim.create_optimizer_v2(model, "fastoptim-adan", lr=...)`` builds them. Returns the names."""
    from timm.optim import OptimInfo
    from timm.optim._optim_factory import default_registry  # not exported by timm.optim

    registry = registry or default_registry
    for cls in CLASSES:
        parameters = inspect.signature(cls).parameters
        registry.register(OptimInfo(name=timm_name(cls), opt_class=cls, description=f"fastoptim.{cls.__name__}",
                                    has_eps="eps" in parameters, has_betas="betas" in parameters,
                                    num_betas=cls.algorithm.n_betas))
    return [timm_name(cls) for cls in CLASSES]
