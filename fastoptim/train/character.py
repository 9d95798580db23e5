"""A 3-character-context MLP language model on Python's standard-library sources: a training run of
seconds, on every machine, that the tests and ``benchmarks/state_bits.py`` compare state formats on."""
import glob
import os

import torch


def stdlib_text(limit=400_000):
    """Python's own standard-library sources: real code text on every machine."""
    paths = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    return "".join(open(path, encoding="utf-8", errors="replace").read() for path in paths)[:limit]


def train(cls, state_bits, steps=200, after_step=None):
    """The training losses of the model with optimizer ``cls`` (lr 3e-3, weight decay 0.01), and the
    optimizer; ``after_step(optimizer)``, if given, is called after each step."""
    data = torch.tensor([min(ord(c), 127) for c in stdlib_text()])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(128, 32), torch.nn.Flatten(), torch.nn.Linear(96, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 128))
    optimizer = cls(model.parameters(), lr=3e-3, weight_decay=0.01, state_bits=state_bits)
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        start = torch.randint(0, len(data) - 4, (256,), generator=generator)
        context = torch.stack([data[start + k] for k in range(3)], dim=1)
        loss = torch.nn.functional.cross_entropy(model(context), data[start + 3])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if after_step:
            after_step(optimizer)
        losses.append(loss.item())
    return losses, optimizer


def final_loss(losses):
    """The mean of the last 50 losses."""
    return sum(losses[-50:]) / 50
