"""The model: transformers' GPT-2, built from a small config (no download), on byte tokens."""
import torch

from fastoptim.measure import quiet_transformers

SIZES = {
    "small": {"n_layer": 4, "n_head": 4, "n_embd": 128, "context": 128},  # the default: 0.84M params
    "tiny": {"n_layer": 1, "n_head": 2, "n_embd": 32, "context": 32},  # for tests and smoke runs
}
VOCAB = 256  # bytes


def build(size, seed):
    """GPT-2 of ``size`` with its initial weights drawn from ``seed``, so every run starts alike."""
    import transformers
    quiet_transformers()
    shape = SIZES[size]
    # No dropout, as in nanoGPT's pretraining: a run sees less than one pass over the data, and a
    # step that draws no random numbers resumes exactly from the checkpointed generator alone.
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=shape["context"], n_layer=shape["n_layer"],
                                     n_head=shape["n_head"], n_embd=shape["n_embd"], resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)
