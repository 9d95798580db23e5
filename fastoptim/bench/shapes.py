"""Parameter shapes of the models the benchmark steps on, each with whether it is the weight of a
Linear layer (where the seeds put subset-norm states)."""


def gpt2(n_layer=12, n_embd=768, vocab=50257, n_ctx=1024):
    """GPT-2's parameters (124M with the defaults), in the order of its modules."""
    d = n_embd
    block = [((d,), False), ((d,), False), ((d, 3 * d), True), ((3 * d,), False), ((d, d), True), ((d,), False),
             ((d,), False), ((d,), False), ((d, 4 * d), True), ((4 * d,), False), ((4 * d, d), True), ((d,), False)]
    return [((vocab, d), False), ((n_ctx, d), False)] + block * n_layer + [((d,), False), ((d,), False)]


def llama(n_layer=8, hidden=512, intermediate=1376, vocab=32000):
    """LLaMA's parameters; the defaults are GaLore's LLaMA-60M (8 heads share the hidden size)."""
    h, i = hidden, intermediate
    block = [((h, h), True)] * 4 + [((i, h), True)] * 2 + [((h, i), True), ((h,), False), ((h,), False)]
    return [((vocab, h), False)] + block * n_layer + [((h,), False), ((vocab, h), True)]


def small_tensors(count=2000, low=1000, high=5000):
    """``count`` 1-d tensors of ``low``..``high`` elements: the many-small-tensors case."""
    step = (high - low) / max(count - 1, 1)
    return [((low + round(i * step),), False) for i in range(count)]


MODELS = {"gpt2-124m": gpt2, "llama-60m": llama, "small-tensors": small_tensors}
