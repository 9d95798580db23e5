"""Parameter shapes of the models the benchmark steps on."""


def gpt2(n_layer=12, n_embd=768, vocab=50257, n_ctx=1024):
    """GPT-2's parameter shapes (124M with the defaults), in the order of its modules."""
    d = n_embd
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (n_ctx, d)] + block * n_layer + [(d,), (d,)]


def small_tensors(count=2000, low=1000, high=5000):
    """``count`` 1-d tensors of ``low``..``high`` elements: the many-small-tensors case."""
    step = (high - low) / max(count - 1, 1)
    return [(low + round(i * step),) for i in range(count)]


MODELS = {"gpt2-124m": gpt2, "small-tensors": small_tensors}
