"""Grouping of tensors into buckets that one engine call can take: one device and one dtype each."""


def buckets(params):
    """Indices of ``params`` grouped by (device, dtype), in first-seen order."""
    groups = {}
    for i, param in enumerate(params):
        groups.setdefault((param.device, param.dtype), []).append(i)
    return list(groups.values())
