"""The training data: the Python standard library's own sources, as bytes.

Real code text is present wherever Python is, so the comparison needs no download. The *.py files at
the top of ``sysconfig.get_paths()["stdlib"]`` are read in sorted order, one token per byte
(vocabulary 256). The split is by file: a file is for validation when the CRC-32 of its name is 0
modulo 10 (about one file in ten). CRC-32 is the same on every machine and Python (``hash()`` is
salted per process), and adding or removing a file moves no other file between the splits.
"""
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

VALIDATION_MODULUS = 10  # crc32(name) % 10 == 0: about a tenth of the files
VALIDATION_WINDOWS = 128  # validation loss is the mean over this many fixed windows


def stdlib_files():
    """The standard library's top-level *.py files, sorted by name."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def is_validation(name):
    return zlib.crc32(name.encode()) % VALIDATION_MODULUS == 0


def split(paths):
    """(train, validation): ``paths`` split by file name, each in the given order."""
    return ([path for path in paths if not is_validation(path.name)],
            [path for path in paths if is_validation(path.name)])


def read_tokens(paths):
    """The files' bytes one after another, as a uint8 tensor."""
    return torch.frombuffer(bytearray(b"".join(path.read_bytes() for path in paths)), dtype=torch.uint8)


def windows(stream, starts, context):
    """The ``context`` tokens of ``stream`` from each start, as an int64 (len(starts), context) tensor."""
    return stream[starts[:, None] + torch.arange(context)].long()


def train_batch(stream, size, context, generator):
    """``size`` windows at places in ``stream`` drawn from ``generator``."""
    return windows(stream, torch.randint(0, len(stream) - context + 1, (size,), generator=generator), context)


@dataclass
class Corpus:
    train: torch.Tensor  # the train files' tokens, one stream
    validation: torch.Tensor  # the fixed validation windows
    summary: dict  # files and bytes of each split, for the report


def load(context):
    train_paths, validation_paths = split(stdlib_files())
    train, validation = read_tokens(train_paths), read_tokens(validation_paths)
    starts = torch.linspace(0, len(validation) - context, VALIDATION_WINDOWS).long()  # spread evenly over the files
    summary = {"stdlib": sysconfig.get_paths()["stdlib"], "train_files": len(train_paths), "train_bytes": len(train),
               "validation_files": len(validation_paths), "validation_bytes": len(validation),
               "validation_windows": VALIDATION_WINDOWS}
    return Corpus(train, windows(validation, starts, context), summary)
